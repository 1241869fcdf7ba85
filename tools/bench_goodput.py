"""Goodput of the reference trainer with injected faults: recovery, stalls, lost steps, goodput.

One invocation runs the same fault schedule (one SIGKILL per ``--fault-every`` steps, the
default model, an asynchronous checkpoint every 2 steps) under each of ``--modes``, each once
without faults and once with them (FT-HSDP modes ``--reps`` times, each with its own fault-free
run just before it: this machine's speed drifts by more than the faults cost):

- ``restart`` (a): the demo's job, 4 ranks pp=2 x dp_shard=2 under torch's elastic agent
  (``--launcher warm``, as ``anyshard demo`` launches it, or ``torchrun``): rank 3 dies and the
  whole group restarts from its newest checkpoint;
- ``ft`` (b): FT-HSDP on torchft, 2 replica groups x 2 ranks (dp_shard=2); rank 1 of group 1
  dies, group 1 alone restarts and heals from group 0 (`anyshard.redistribute`) while group 0
  keeps training;
- ``ft-relayout`` (c): the same, but group 1 comes back under tp=2 and heals into that layout;
- ``ft-relayout-dp`` (c, the other way): both groups run tp=2, and group 1 comes back under
  dp_shard=2; its fault-free run is tp=2 too. On CPU tp=2 steps are about 1.4x slower than
  dp_shard=2, so in ``ft-relayout`` the healed group paces both groups for the rest of the run;
  here the healed group is not the slower one. On shared cores its faster steps also leave the
  other group more CPU, so this ratio can exceed 100% and does not isolate what a heal into
  another layout costs;
- ``elastic`` (d): group 1's whole node (agent and ranks) is lost; group 0 goes on alone on the
  whole batch (4 -> 2 ranks) until the node is relaunched ``--back-s`` later and heals from
  group 0's memory (2 -> 4 ranks).

Goodput is useful step time (steps x the median step time of the mode's fault-free run) over
the wall time of the whole job, launch included. The (c) modes also run the job without a
fault but with group 1 switching to the heal layout at the first fault's step
(``--group-args 1:--parallel.relayout_at``): goodput with faults against that run is what the
faults and heals cost, apart from how fast the new layout trains. FT-HSDP rows also give the
healthy group's stall per fault, the failed group's recovery and what each heal moved;
``--heal-gib`` measures the heal rate of a larger replica state in a table of its own (two
groups of 2 ranks, dp_shard=2 -> dp_shard=2, dp_shard=2 -> tp=2 and tp=2 -> dp_shard=2).

    python tools/bench_goodput.py                    # 100 steps, a fault every 50
    python tools/bench_goodput.py --write-docs       # also replace the section in docs/benchmarks.md
    python tools/bench_goodput.py --config anyshard/trainer_integration/gpt/tiny.toml  # other sizes

Other words (``--config FILE``, ``--model.dim 128``, ...) go to the trainer as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN, END = "<!-- goodput:begin -->", "<!-- goodput:end -->"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    run_dir: str, steps: int, faults: list[tuple[int, int]], extra: list[str], launcher: str
) -> float:
    if launcher == "torchrun":
        head = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", "1", "--nproc-per-node", "4", "--max-restarts", str(len(faults)),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{_port()}",
            "-m", "anyshard.trainer_integration.gpt.train",
        ]  # fmt: skip
    else:
        head = [
            sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
            "--nproc-per-node", "4", "--max-restarts", str(len(faults)),
            "--rdzv-endpoint", f"127.0.0.1:{_port()}",
        ]  # fmt: skip
    cmd = [
        *head,
        "--parallel.pp", "2", "--parallel.dp_shard", "2",
        "--train.steps", str(steps),
        "--checkpoint.keep_last", "2",
        "--checkpoint.root", os.path.join(run_dir, "ckpt"),
        "--run_dir", run_dir,
        *extra,
    ]  # fmt: skip
    schedule = ",".join(f"{r}:{s}" for r, s in faults)
    return _timed_run(cmd, "training", {"ANYSHARD_FAULTS": schedule} if faults else {})


def _timed_run(cmd: list[str], what: str, extra_env: dict[str, str]) -> float:
    """Run ``cmd`` (one thread per rank, no inherited fault schedule); its wall time."""
    env = {k: v for k, v in os.environ.items() if k not in ("ANYSHARD_FAULT", "ANYSHARD_FAULTS")}
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra_env)
    t = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t
    if out.returncode != 0:
        raise SystemExit(f"{what} failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return wall


def launch_ft(
    run_dir: str,
    steps: int,
    faults: list[int],
    extra: list[str],
    heal_layout: str | None,
    heartbeat_ms: int,
    lose_back_s: float | None = None,
    layout: str = "dp_shard",
    switch: str | None = None,
) -> float:
    """FT-HSDP: 2 replica groups x 2 ranks (``layout`` = 2), group 1 killed at each of
    ``faults`` (rank 1 SIGKILLed, or with ``lose_back_s`` its whole node, relaunched that much
    later); ``switch`` (STEP:LAYOUT): group 1 changes layout at STEP without a fault."""
    if lose_back_s is None:
        hits = [x for s in faults for x in ("--fault", f"1:1:{s}")]
    else:
        hits = [x for s in faults for x in ("--lose-group", f"1:{s}:{lose_back_s:g}")]
    cmd = [
        sys.executable, "-m", "anyshard.trainer_integration.gpt.launch",
        "--replicas", "2", "--nproc-per-node", "2", "--max-restarts", str(len(faults)),
        "--heartbeat-ms", str(heartbeat_ms),
        *hits,
        f"--parallel.{layout}", "2",
        "--train.steps", str(steps),
        "--checkpoint.keep_last", "2",
        "--checkpoint.root", os.path.join(run_dir, "ckpt"),
        "--run_dir", run_dir,
        *(["--ft.heal_layout", heal_layout] if heal_layout else []),
        *(["--group-args", f"1:--parallel.relayout_at {switch}"] if switch else []),
        *extra,
    ]  # fmt: skip
    return _timed_run(cmd, "FT-HSDP training", {})


def records(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def step_times(losses: list[dict]) -> list[float]:
    out = []
    for a, b in zip(losses, losses[1:], strict=False):
        if a["attempt"] == b["attempt"] and b["step"] == a["step"] + 1:
            out.append(b["time"] - a["time"])
    return out


def _phases(event: dict) -> str:
    p = event.get("process_to_run_s")
    head = f"{p:.1f}" if p is not None else "?"
    return f"{head} / {event['build_s']:.1f} / {event['restore_s']:.1f} s"


def _heal_worker(
    role: str, rank: int, port: int, src_port: int, out: str, gib: float, frm: str, into: str
) -> None:
    """One rank of a replica group for the heal-rate measurement: the source holds ``gib`` GiB
    of fp32 state in ``frm``, the healer receives it in ``into``: each dp_shard=2 (rows) or
    tp=2 (columns)."""
    import datetime

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from anyshard.trainer_integration.ft import AnyshardTransport
    from anyshard.ucl.library import preload

    torch.set_num_threads(1)
    preload()  # as the trainer's ranks have it: the launcher's forkserver builds the parsers
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False)
    dist.init_process_group("gloo", store=dist.PrefixStore("w/", store), rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("g",))
    cols = (into if role == "healer" else frm) == "tp=2"
    place = [Shard(1)] if cols else [Shard(0)]
    n = max(1, int(gib * 2**30 / 4 / (4096 * 4096)))  # 64 MiB tensors
    state = {}
    for i in range(n):
        local_shape = (4096, 2048) if cols else (2048, 4096)
        # the healer's tensors hold other values, written as a trainer's are by initialising
        # its model: the first touch of fresh pages is not part of a heal
        local = torch.full(local_shape, float(i) if role == "source" else -1.0)
        state[f"w{i}"] = DTensor.from_local(
            local, mesh, place, shape=(4096, 4096), stride=(4096, 1)
        )
    timeout = datetime.timedelta(seconds=300)
    tr = AnyshardTransport(
        state=lambda: {"default": state},
        replica_id=role,
        group_rank=rank,
        group_world_size=2,
        store_addr="127.0.0.1",
        store_port=port,
        timeout=timeout,
    )
    meta = tr.metadata()
    if role == "source":
        with open(f"{out}.meta{rank}", "w") as f:
            f.write(meta)
        tr.send_checkpoint(
            [1],
            1,
            {"user": {"default": state}, "torchft": {"step": 1, "batches_committed": 2}},
            timeout,
        )
    else:
        path = f"{out}.meta{rank}".replace("healer", "source")
        while not os.path.exists(path):
            time.sleep(0.05)
        time.sleep(0.2)
        t = time.perf_counter()
        tr.recv_checkpoint(0, open(path).read(), 1, timeout)
        took = time.perf_counter() - t
        ok = all(bool((v.to_local() == float(int(k[1:]))).all()) for k, v in state.items())
        with open(f"{out}.{rank}.json", "w") as f:
            json.dump({"seconds": took, "bytes": n * 4096 * 4096 * 4, "ok": ok}, f)
    dist.barrier()
    dist.destroy_process_group()


def heal_rate(gib: float, frm: str, into: str) -> dict:
    """Heal a ``gib`` GiB replica state from a 2-rank group (``frm``) into another (``into``);
    each dp_shard=2 or tp=2."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        src_port, dst_port = _port(), _port()
        procs = [
            ctx.Process(
                target=_heal_worker,
                args=(role, r, port, src_port, os.path.join(tmp, role), gib, frm, into),
            )
            for role, port in (("source", src_port), ("healer", dst_port))
            for r in range(2)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        if any(p.exitcode != 0 for p in procs):
            raise SystemExit("the heal-rate measurement failed")
        got = [json.load(open(os.path.join(tmp, f"healer.{r}.json"))) for r in range(2)]
    if not all(g["ok"] for g in got):
        raise SystemExit("the healed state differs from the source's")
    seconds = max(g["seconds"] for g in got)
    return {"gib": got[0]["bytes"] / 2**30, "seconds": seconds}


def _ft_columns(
    steps: int,
    faults: list[int],
    extra: list[str],
    heal_layout,
    heartbeat_ms: int,
    tmp: str,
    lose_back_s: float | None = None,
    layout: str = "dp_shard",
):
    from anyshard.trainer_integration.gpt.ft_demo import summarize

    tag = "elastic" if lose_back_s is not None else heal_layout or "same"
    clean_dir = os.path.join(tmp, f"ft-clean-{layout}")
    faulty_dir = os.path.join(tmp, f"ft-{layout}-{tag}")
    if not os.path.exists(clean_dir):  # one fault-free run serves the modes of its layout
        _CLEAN_WALL[clean_dir] = launch_ft(
            clean_dir, steps, [], extra, None, heartbeat_ms, layout=layout
        )
    clean_wall = _CLEAN_WALL[clean_dir]
    switch_wall = None
    if heal_layout is not None:  # the same layouts at the same steps, without a fault
        switch_wall = launch_ft(
            os.path.join(tmp, f"ft-{layout}-switch-{tag}"), steps, [], extra, None,
            heartbeat_ms, layout=layout, switch=f"{faults[0]}:{heal_layout}",
        )  # fmt: skip
    faulty_wall = launch_ft(
        faulty_dir, steps, faults, extra, heal_layout, heartbeat_ms, lose_back_s, layout
    )
    clean = records(os.path.join(clean_dir, "replica-0", "losses.jsonl"))
    faulty = records(os.path.join(faulty_dir, "replica-0", "losses.jsonl"))
    step = statistics.median(step_times(clean))
    summary = summarize(faulty_dir, "elastic" if lose_back_s is not None else "ft-hsdp")
    return {
        "layout": layout,
        "clean_wall": clean_wall,
        "faulty_wall": faulty_wall,
        "step": step,
        "faulty_step": statistics.median(step_times(faulty)),
        "goodput_clean": steps * step / clean_wall,
        "goodput_faulty": steps * step / faulty_wall,
        "switch_wall": switch_wall,
        "summary": summary,
    }


_CLEAN_WALL: dict[str, float] = {}


def _fmt(values, form: str) -> str:
    values = [v for v in values if v is not None]
    return ", ".join(form.format(v) for v in values) or "-"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--fault-every", type=int, default=50)
    p.add_argument(
        "--sync",
        dest="async_",
        action="store_false",
        help="synchronous checkpoints (default: async)",
    )
    p.add_argument("--every", type=int, default=2, help="checkpoint every N steps (default 2)")
    p.add_argument(
        "--launcher",
        choices=["warm", "torchrun"],
        default="warm",
        help="warm: anyshard.trainer_integration.gpt.launch (torch's elastic agent, ranks forked "
        "from a process with torch imported), as the demo runs; torchrun: new interpreters",
    )
    p.add_argument(
        "--modes",
        default="restart,ft,ft-relayout,ft-relayout-dp,elastic",
        help="comma-separated: restart (a: the whole group restarts), ft (b: FT-HSDP, the "
        "failed group heals into its layout), ft-relayout (c: it heals into tp=2), "
        "ft-relayout-dp (c the other way: groups run tp=2, it heals into dp_shard=2), elastic "
        "(d: group 1's node is lost, the job goes on at 2 ranks, the node returns --back-s "
        "later and heals: 4 -> 2 -> 4 ranks)",
    )
    p.add_argument("--back-s", type=float, default=5.0, help="elastic: seconds a lost node is away")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="FT-HSDP: lighthouse timeout")
    p.add_argument(
        "--heal-gib",
        type=float,
        default=1.0,
        help="state size of the heal-rate measurement (0: skip)",
    )
    p.add_argument("--heal-reps", type=int, default=3, help="repetitions of the heal-rate run")
    p.add_argument(
        "--reps",
        type=int,
        default=1,
        help="FT-HSDP: runs of each mode, each paired with a fault-free run just before it; "
        "the table shows the run of the median goodput ratio, and every run's ratio and stalls",
    )
    p.add_argument("--write-docs", action="store_true")
    args, trainer_args = p.parse_known_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    extra = ["--checkpoint.every_steps", str(args.every), *trainer_args]
    extra += ["--checkpoint.async_", "true"] if args.async_ else []
    fault_steps = list(range(args.fault_every // 2, args.steps, args.fault_every))
    sections = []
    if "restart" in modes:
        sections.append(_restart_table(args, extra, fault_steps))
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):  # each: a fault-free run per layout, each mode's faulty run
            rep_dir = os.path.join(tmp, f"rep{rep}")
            os.makedirs(rep_dir)
            for mode, layout, heal, back in (
                ("ft", "dp_shard", None, None),
                ("ft-relayout", "dp_shard", "tp=2", None),
                ("ft-relayout-dp", "tp", "dp_shard=2", None),
                ("elastic", "dp_shard", None, args.back_s),
            ):
                if mode in modes:
                    runs.setdefault(mode, []).append(
                        _ft_columns(
                            args.steps,
                            fault_steps,
                            extra,
                            heal,
                            args.heartbeat_ms,
                            rep_dir,
                            back,
                            layout,
                        )
                    )
    ft = {}
    for mode, got in runs.items():  # the run of the median ratio, with every run's ratio
        got.sort(key=lambda c: c["goodput_faulty"] / c["goodput_clean"])
        ft[mode] = {**got[len(got) // 2], "runs": got}
    rate = {}
    if args.heal_gib > 0:  # each in fresh processes, the layouts interleaved; median and fastest
        pairs = [("dp_shard=2", "dp_shard=2"), ("dp_shard=2", "tp=2"), ("tp=2", "dp_shard=2")]
        runs: dict[tuple[str, str], list] = {pair: [] for pair in pairs}
        for _ in range(args.heal_reps):
            for (frm, into), got in runs.items():
                got.append(heal_rate(args.heal_gib, frm, into))
        for pair, got in runs.items():
            seconds = sorted(r["seconds"] for r in got)
            rate[pair] = {
                "gib": got[0]["gib"],
                "seconds": statistics.median(seconds),
                "min": seconds[0],
            }
    if ft:
        sections.append(_ft_table(args, ft, fault_steps))
    if rate:
        sections.append(_rate_table(args, rate))
    for title, rows, head in sections:
        width = max(len(r[0]) for r in rows)
        print(title)
        print(f"{'':{width}}  " + "  ".join(f"{h:>22}" for h in head))
        for name, *cells in rows:
            print(f"{name:{width}}  " + "  ".join(f"{c:>22}" for c in cells))
        print()
    if args.write_docs:
        cmd = "python tools/bench_goodput.py " + " ".join(sys.argv[1:])
        body = [f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, 2 CPU cores, gloo)", ""]
        for title, rows, head in sections:
            body += [f"{title}", "", "| | " + " | ".join(head) + " |"]
            body += ["| --- |" + " --- |" * len(head)]
            body += ["| " + " | ".join(r) + " |" for r in rows]
            body += [""]
        section = "\n".join([BEGIN, *body[:-1], END])
        text = open(DOC).read()
        if BEGIN in text:
            text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
        else:
            text += (
                "\n\n## Goodput of the reference trainer with faults (`tools/bench_goodput.py`)\n\n"
                + section
                + "\n"
            )
        with open(DOC, "w") as f:
            f.write(text)
    return 0


def _restart_table(args, extra, fault_steps):
    faults = [(3, s) for s in fault_steps]
    with tempfile.TemporaryDirectory() as tmp:
        clean_dir, faulty_dir = os.path.join(tmp, "clean"), os.path.join(tmp, "faulty")
        clean_wall = launch(clean_dir, args.steps, [], extra, args.launcher)
        faulty_wall = launch(faulty_dir, args.steps, faults, extra, args.launcher)
        clean = records(os.path.join(clean_dir, "losses.jsonl"))
        faulty = records(os.path.join(faulty_dir, "losses.jsonl"))
        events = records(os.path.join(faulty_dir, "events.jsonl"))
        clean_events = records(os.path.join(clean_dir, "events.jsonl"))
    step = statistics.median(step_times(clean))
    useful = args.steps * step
    recoveries = [e for e in events if "recovery_s" in e]
    rows = [
        ("steps", f"{args.steps}", f"{args.steps}"),
        ("faults (rank 3, SIGKILL)", "0", f"{len(faults)} (at steps {', '.join(str(s) for _, s in faults)})"),
        ("wall time, launch to exit", f"{clean_wall:.1f} s", f"{faulty_wall:.1f} s"),
        ("median step time", f"{step * 1000:.0f} ms", f"{statistics.median(step_times(faulty)) * 1000:.0f} ms"),
        ("start-up to first step", f"{clean_events[0]['startup_to_first_step_s']:.1f} s", f"{events[0]['startup_to_first_step_s']:.1f} s"),
        (
            "recovery time (fault -> first step after restart)",
            "-",
            ", ".join(f"{e['recovery_s']:.1f} s" for e in recoveries) or "-",
        ),
        (
            "restart: process start -> run, build, restore",
            "-",
            ", ".join(_phases(e) for e in recoveries) or "-",
        ),
        ("lost steps per fault", "-", ", ".join(str(e["lost_steps"]) for e in recoveries) or "-"),
        ("healthy ranks restarted per fault", "-", "3 (the whole group)"),
        ("steps run in all", f"{len(clean)}", f"{len(faulty)}"),
        ("goodput (useful step time / wall time)", f"{useful / clean_wall:.0%}", f"{useful / faulty_wall:.0%}"),
    ]  # fmt: skip
    return "(a) Whole-group restart (4 ranks, pp=2 x dp_shard=2)", rows, ["no fault", "with faults"]


def _ft_table(args, ft, fault_steps):
    head, cols = [], []
    names = {
        "ft": "(b) heal, same layout",
        "ft-relayout": "(c) heal into tp=2",
        "ft-relayout-dp": "(c) tp=2, heal into dp_shard=2",
        "elastic": "(d) elastic 4 -> 2 -> 4",
    }
    for mode, c in ft.items():
        head.append(names[mode])
        cols.append(c)
    rows = []
    if cols:
        f = [c["summary"]["faults"] for c in cols]
        rows = [
            ("replica groups x ranks", *[f"2 x 2 ({c['layout']}=2)" for c in cols]),
            ("faults (group 1: rank 1 SIGKILLed; (d): its node) at steps", *[", ".join(map(str, fault_steps))] * len(cols)),
            ("wall time, no fault / with faults", *[f"{c['clean_wall']:.1f} s / {c['faulty_wall']:.1f} s" for c in cols]),
            ("median step, no fault / with faults", *[f"{c['step'] * 1000:.0f} / {c['faulty_step'] * 1000:.0f} ms" for c in cols]),
            ("goodput, no fault / with faults", *[f"{c['goodput_clean']:.1%} / {c['goodput_faulty']:.1%}" for c in cols]),
            ("goodput with faults / without", *[f"{c['goodput_faulty'] / c['goodput_clean']:.1%}" for c in cols]),
            *([
                ("goodput with faults / fault-free with group 1 switching layout at the first fault's step", *[f"{c['switch_wall'] / c['faulty_wall']:.1%}" if c["switch_wall"] else "-" for c in cols]),
                *([(f"the same, each of {args.reps} runs", *[", ".join(f"{r['switch_wall'] / r['faulty_wall']:.1%}" for r in c["runs"]) if c["switch_wall"] else "-" for c in cols])] if args.reps > 1 else []),
            ] if any(c["switch_wall"] for c in cols) else []),
            ("healthy group's stall per fault", *[_fmt([x["healthy_stall_s"] for x in fs], "{:.2f} s") for fs in f]),
            *([
                (f"goodput with faults / without, each of {args.reps} runs", *[", ".join(f"{r['goodput_faulty'] / r['goodput_clean']:.1%}" for r in c["runs"]) for c in cols]),
                (f"healthy group's stall per fault, each of {args.reps} runs", *["; ".join(_fmt([x["healthy_stall_s"] for x in r["summary"]["faults"]], "{:.2f}") for r in c["runs"]) + " s" for c in cols]),
            ] if args.reps > 1 else []),
            ("failed group's recovery (kill -> first step; (d): node away included)", *[_fmt([x["recovery_s"] for x in fs], "{:.1f} s") for fs in f]),
            ("heal source, layout", *[_fmt([f"{x['heal_source']}, {x['heal_layout']}" for x in fs], "{}") for fs in f]),
            ("bytes moved per heal", *[_fmt([x["heal_bytes"] and x["heal_bytes"] / 2**20 for x in fs], "{:.1f} MiB") for fs in f]),
            ("heal time (quorum + transfer)", *[_fmt([x["heal_s"] for x in fs], "{:.2f} s") for fs in f]),
            ("heal bit-identical (state digests)", *[_fmt([x["heal_bit_identical"] for x in fs], "{}") for fs in f]),
            ("healthy processes restarted", *[str(c["summary"]["healthy_restarts"]) for c in cols]),
            ("steps the healthy group redid", *[str(c["summary"]["lost_steps"]) for c in cols]),
            ("steps it saved after losing the other group", *[str(c["summary"].get("rescued_steps", 0)) for c in cols]),
        ]  # fmt: skip
    return "FT-HSDP on torchft (2 replica groups; the failed group restarts alone)", rows, head


def _rate_table(args, rate):
    rows = [
        (
            f"{frm} -> {into}",
            f"{r['gib']:.2f} GiB",
            f"{r['seconds']:.2f} s",
            f"{r['min']:.2f} s",
            f"{r['seconds'] / r['gib']:.2f} s",
        )
        for (frm, into), r in rate.items()
    ]
    head = ["replica state", f"median of {args.heal_reps}", "fastest", "median per GiB"]
    return "Heal rate (2 replica groups x 2 ranks, fp32 state)", rows, head


if __name__ == "__main__":
    sys.exit(main())
