"""The ranks' allocator mode (`gpt.malloc`): lean where a memory budget is set, and what lean
does, measured in a fresh process: a freed 4 MiB tensor goes back to the system at once, where
glibc as it is keeps it (after a freed 16 MiB block has raised its threshold)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from anyshard.trainer_integration.gpt import launch, malloc
from anyshard.trainer_integration.gpt.config import ConfigError, trainer_config

GLIBC = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None

FREED_MIB = textwrap.dedent(
    """
    import os, sys, torch
    from anyshard.trainer_integration.gpt import malloc
    if sys.argv[1] == "lean":
        assert malloc.set_lean()
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    big = torch.ones(4 << 20)  # 16 MiB, mapped on its own; freed, it raises glibc's threshold
    del big
    blocks = [torch.ones(1 << 20) for _ in range(6)]  # 6 x 4 MiB
    before = rss()
    del blocks
    print((before - rss()) >> 20)
    """
)


@pytest.mark.skipif(not (GLIBC or "").startswith("glibc"), reason="glibc's malloc alone")
def test_lean_gives_freed_tensors_back_where_glibc_keeps_them():
    freed = {}
    for mode in ("lean", "default"):
        out = subprocess.run(
            [sys.executable, "-c", FREED_MIB, mode], capture_output=True, text=True, check=True
        )
        freed[mode] = int(out.stdout.split()[-1])
    assert freed["lean"] >= 20 and freed["default"] <= 4, freed


@pytest.mark.parametrize(
    ("mode", "budget", "gpu", "lean"),
    [
        ("auto", None, False, False),
        ("auto", 1.0, False, True),
        ("auto", 1.0, True, False),  # the budget counts the accelerator's memory
        ("lean", None, True, True),
        ("default", 1.0, False, False),
    ],
)
def test_lean_where_a_budget_is_set_on_the_host_or_asked_for(mode, budget, gpu, lean):
    assert malloc.wanted(mode, budget, on_accelerator=gpu) is lean


def test_huge_pages_join_the_tunables_a_user_set_and_keep_a_hugetlb_choice():
    env = malloc.hugepage_env({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    assert malloc.hugepage_env({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    kept = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert malloc.hugepage_env(kept) == kept


def test_the_launcher_starts_ranks_with_huge_pages_only_under_a_budget(monkeypatch):
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host job
    budget = launch._rank_env(["--parallel.auto_memory_gib", "2", "--train.steps", "3"])
    assert budget["GLIBC_TUNABLES"] == malloc.HUGETLB_TUNABLE
    assert "GLIBC_TUNABLES" not in launch._rank_env(["--train.steps", "3"])
    # a config that does not load is left to the ranks, which report it
    assert "GLIBC_TUNABLES" not in launch._rank_env(["--train.malloc", "nope"])
    assert "GLIBC_TUNABLES" not in launch._rank_env(["--config", "/no/such/file.toml"])


def test_the_forkserver_starts_with_huge_pages_and_the_launcher_puts_the_environment_back(
    monkeypatch,
):
    import torch.distributed.launcher.api as api

    seen = []

    def fake_launch(config, entrypoint):
        return lambda args: seen.append(os.environ.get("GLIBC_TUNABLES"))

    monkeypatch.setattr(api, "elastic_launch", fake_launch)
    monkeypatch.setattr(launch.multiprocessing, "set_forkserver_preload", lambda mods: None)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a host job
    launch.launch(1, ["--parallel.auto_memory_gib", "1"])
    launch.launch(1, [])
    assert seen == ["glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "glibc.malloc.arena_max=2"]
    assert os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"


def test_the_trainer_command_line_takes_out_its_own_flags():
    argv = ["--stop-at", "4", "--relayout-at", "3:tp=2", "--parallel.dp_shard", "2"]
    cfg, stop = trainer_config([*argv, "--train.steps", "9"])
    assert (stop, cfg.train.steps, cfg.parallel.relayout_at) == (4, 9, "3:tp=2")
    with pytest.raises(ConfigError, match="--stop-at 'x'"):
        trainer_config(["--stop-at", "x"])
    with pytest.raises(ConfigError, match="--config needs a value"):
        trainer_config(["--config"])


@pytest.mark.skipif(not (GLIBC or "").startswith("glibc"), reason="glibc's malloc alone")
def test_a_trainer_under_a_budget_runs_lean_and_says_so(tmp_path):
    """One rank of the tiny model for four steps, with a budget and without: its start and
    memory events name the allocator mode it ran."""
    tiny = os.path.join(os.path.dirname(malloc.__file__), "tiny.toml")
    modes = {}
    for name, extra in (("budget", ["--parallel.auto_memory_gib", "4"]), ("none", [])):
        run = tmp_path / name
        cmd = [sys.executable, "-m", "anyshard.trainer_integration.gpt.train", "--config", tiny]
        cmd += ["--train.steps", "4", "--run_dir", str(run), "--checkpoint.root", str(run / "c")]
        env = {k: v for k, v in os.environ.items() if k != "ANYSHARD_FAULT"}
        subprocess.run([*cmd, *extra], check=True, timeout=300, env=env, capture_output=True)
        events = [json.loads(x) for x in open(run / "events.jsonl")]
        modes[name] = {e["event"]: e["malloc"] for e in events if "malloc" in e}
    assert modes == {
        "budget": {"start": "lean", "memory": "lean"},
        "none": {"start": "default", "memory": "default"},
    }
