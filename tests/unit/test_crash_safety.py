"""Crash safety: SIGKILL a saving process group at random moments, over and over, on one root.

A 2-rank gloo group (forked by tests/crash_worker.py) restores the newest committed step and
saves steps 1, 2, 3, ... with ``Checkpointer(root, every_steps=1, keep_last=2)``: a DTensor
sharded over the ranks, a plain tensor and JSON values, all derived from the step number. The
test kills the whole group (``os.killpg``, SIGKILL) at seeded random moments — some at a random
time, some aimed at a step's data-file writes, at its manifest's temporary file, right after
its commit (retention), or during the restart itself — and restarts it, like a job under
``torchrun --max-restarts``. After every kill, from what is on disk only: every committed step
verifies, no commit was lost, and ``restore_latest`` restores the newest commit bit-exact. At the
end ``anyshard gc`` removes the debris older than the newest commit and nothing else.

Run: python -m pytest tests/unit/test_crash_safety.py -q -s   (-s prints where the kills landed)
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import os
import random
import signal
import struct
import subprocess
import sys
import time

import pytest
from cli_runner import cli

import anyshard
from anyshard.format.steps import list_steps
from anyshard.reshard.verify import verify_checkpoint
from anyshard.trainer_integration import Checkpointer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="forks ranks and reads /proc"
)

WORKER = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "crash_worker.py"
)
_spec = importlib.util.spec_from_file_location("_crash_worker", WORKER)
cw = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cw)

# the kills' seed: tools/crash_soak.py --seed sets it (with more kills)
SEED = int(os.environ.get("ANYSHARD_CRASH_SEED", "20240611"))
KILLS = 12
# how each kill's moment is chosen (see _kill_moment); shuffled with the seed
MODES = ["random"] * 4 + ["data"] * 3 + ["manifest"] * 2 + ["commit"] * 2 + ["restart"] * 1
ROUND_TIMEOUT = 30.0
POLL = 0.0005
# the object store's polls: each is a listing and a request per step, which the store serves on
# the ranks' cores (the kills there land at random times after a commit, not at a phase)
S3_POLL = 0.02


class Group:
    """The zygote of tests/crash_worker.py, and the rank processes it forks."""

    def __init__(self, scratch: str):
        self.scratch = scratch
        self.proc = subprocess.Popen(
            [sys.executable, WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout.readline().strip() == "ready"
        self.pids: list[int] = []
        self.spawns = 0

    def _ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def spawn(self, root: str, mode: str = "sync") -> None:
        self.spawns += 1
        self.log = os.path.join(self.scratch, f"run{self.spawns:03d}")
        store = os.path.join(self.scratch, f"store{self.spawns:03d}")
        msg = {"cmd": "spawn", "root": root, "store": store, "log": self.log, "mode": mode}
        msg["local"] = os.path.join(self.scratch, "local")
        self.pids = self._ask(msg)["pids"]

    def alive(self) -> bool:
        """Whether every rank is still running (not exited and waiting to be reaped)."""
        for pid in self.pids:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                        return False
            except FileNotFoundError:
                return False
        return True

    def logs(self) -> str:
        out = []
        for r in range(cw.WORLD):
            with open(f"{self.log}-rank{r}.log") as f:
                out.append(f"--- rank {r} ---\n{f.read()}")
        return "\n".join(out)

    def kill(self) -> None:
        """SIGKILL the whole group at once and reap it; every rank must have died of the kill."""
        os.killpg(self.pids[0], signal.SIGKILL)
        for pid in self.pids[1:]:  # in case a rank left the process group (it does not)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        status = self._ask({"cmd": "reap"})["status"]
        self.pids = []
        died = [os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in status]
        assert all(died), f"a rank exited on its own ({status}):\n{self.logs()}"

    def close(self) -> None:
        if self.pids:
            self.kill()
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# --- what is on disk ---------------------------------------------------------------------------


def _committed(root: str) -> list[int]:
    return [s.step for s in list_steps(root) if s.committed]


def _committed_after(root: str, step: int) -> bool:
    """Whether a step after ``step`` has committed: on a local ``root``, from one listing and a
    stat per newer step (`list_steps` also walks every step's files for its size), for the
    waits that ask it every `POLL` while the ranks save."""
    if "://" in root:
        return any(s > step for s in _committed(root))
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return False
    newer = [n for n in names if n.startswith("step-") and n[5:].isdigit() and int(n[5:]) > step]
    return any(os.path.exists(os.path.join(root, n, "manifest.json")) for n in newer)


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:09d}")


def _has_manifest_tmp(path: str) -> bool:
    try:
        return any(n.startswith("manifest.json.tmp") for n in os.listdir(path))
    except FileNotFoundError:
        return False


def _data_file_complete(path: str) -> bool:
    """Whether a data file holds all the bytes its header announces."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return False
            (n,) = struct.unpack("<Q", raw)
            header = f.read(n)
            if len(header) < n:
                return False
            ends = [
                e["data_offsets"][1] for k, e in json.loads(header).items() if k != "__metadata__"
            ]
            return os.path.getsize(path) == 8 + n + max(ends, default=0)
    except (FileNotFoundError, ValueError):
        return False


def _snapshot(root: str) -> dict[int, tuple[bool, dict]]:
    """step -> (committed, its files) of every step directory under ``root``."""
    return {s.step: (s.committed, _files(s.path)) for s in list_steps(root)}


def _where_it_landed(root: str, before: dict[int, tuple[bool, dict]]) -> str:
    """Which phase of the group's work the kill interrupted, as the files on disk tell it
    (``before``: the `_snapshot` taken before the group was started)."""
    if _snapshot(root) == before:
        return "restart (start-up or restore: nothing written yet)"
    listed = list_steps(root)
    committed = [s.step for s in listed if s.committed]
    newest = committed[-1] if committed else -1
    old_debris = {step for step, (done, _) in before.items() if not done and step < newest}
    if any(not s.committed and s.step < newest and s.step not in old_debris for s in listed):
        return "retention (an old step partly removed)"
    newer = [s for s in listed if not s.committed and s.step > newest]
    if newer:
        path = newer[-1].path
        if _has_manifest_tmp(path):
            return "manifest write (temporary file, not yet linked)"
        files = [os.path.join(path, "data", f"rank-{r:05d}.safetensors") for r in range(cw.WORLD)]
        if all(_data_file_complete(f) for f in files):
            return "data files written, manifest not yet (fsync / gather)"
        return "data file writes"
    if committed and _has_manifest_tmp(_step_dir(root, newest)):
        return "manifest commit (linked, temporary not yet removed)"
    if len(committed) > cw.KEEP_LAST:
        return "after a commit, before retention"
    return "between saves (state generation, restore, retention done)"


def _files(path: str) -> dict[str, tuple[int, int, int]]:
    """relative path -> (inode, size, mtime_ns) of every file under ``path``."""
    out = {}
    for d, _, names in os.walk(path):
        for name in names:
            st = os.stat(os.path.join(d, name))
            out[os.path.relpath(os.path.join(d, name), path)] = (
                st.st_ino,
                st.st_size,
                st.st_mtime_ns,
            )
    return out


def _check_root(root: str, fixed: bool = False) -> int | None:
    """Every committed step verifies; restore_latest gives the newest, bit-exact. Returns it.
    (``fixed``: the state of incremental saves, with a tensor that never changes.)"""
    committed = _committed(root)
    for step in committed:
        verify_checkpoint(_step_dir(root, step))
    state = cw.template(fixed)
    restored = Checkpointer(root).restore_latest(state)
    assert restored == (committed[-1] if committed else None)
    if restored is not None:
        want = cw.expected_state(restored, fixed)
        for name in ("w", "b", "f") if fixed else ("w", "b"):
            assert cw.bit_exact(state["model"][name], want["model"][name]), (restored, name)
        assert state["extra"] == want["extra"]
    return restored


def _gc(root: str, *options: str) -> list[str]:
    """``anyshard gc ROOT OPTIONS`` (the console script's function, in this process); the paths
    it removed."""
    done = cli("gc", root, *options)
    assert done.returncode == 0, done.stderr
    return [
        line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("removed /")
    ]


# --- choosing the moment -----------------------------------------------------------------------


def _wait_for(group: Group, cond, deadline: float, poll: float = POLL) -> bool:
    """Poll ``cond`` every ``poll`` s until it holds (True) or ``deadline`` passes (False); fail
    if a rank died (checked every 0.1 s)."""
    n, every = 0, max(1, round(0.1 / poll))
    while not cond():
        n += 1
        if n % every == 0 and not group.alive():
            pytest.fail(f"a rank died before the kill:\n{group.logs()}")
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
    return True


def _reached(path: str, mode: str) -> bool:
    """Whether the save of the step at ``path`` has reached the phase ``mode`` aims at."""
    if mode == "data":  # its data files are being written
        return os.path.exists(os.path.join(path, "data"))
    if mode == "manifest":  # its manifest is being written, not yet linked into place
        return _has_manifest_tmp(path)
    return os.path.exists(os.path.join(path, "manifest.json"))  # commit: just committed


def _kill_moment(group: Group, root: str, mode: str, rng: random.Random, before: int) -> None:
    """Return at the moment to kill, chosen by ``mode``, once the restarted group is saving.

    Targets are steps after ``before + 1``: the first save after a restart may find debris of
    the interrupted step on disk (which it clears), and that must not be taken for progress.
    """
    deadline = time.monotonic() + ROUND_TIMEOUT
    if mode == "restart":  # during start-up, restore, or the first save (clearing debris)
        time.sleep(rng.uniform(0.0, 1.5))
        return
    # a commit after ``before`` (under tiered saves, the step the group restored may be one
    # that committed on local disk only, and is never uploaded: the next one is)
    if not _wait_for(group, lambda: _committed_after(root, before), deadline):
        pytest.fail(f"no step after {before} committed within {ROUND_TIMEOUT}s:\n{group.logs()}")
    before = max(_committed(root)) - 1
    if mode == "random":  # anywhere in the save loop
        time.sleep(rng.uniform(0.0, 0.15))
        return
    target = before + 1 + rng.randint(1, 3)
    delay = rng.uniform(0.0, 0.004)
    for step in range(target, target + 20):  # a poll can miss a short phase: try the next step
        path = _step_dir(root, step)
        _wait_for(group, lambda p=path: _reached(p, mode) or _reached(p, "commit"), deadline)
        if _reached(path, mode):
            if mode == "data":
                time.sleep(delay)
            return
    # the phase was never caught: kill now, wherever the group is


def test_sigkill_at_random_moments_never_loses_or_corrupts_a_commit(tmp_path):
    root = str(tmp_path / "ckpt")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rng = random.Random(SEED)
    modes = MODES[:KILLS]
    rng.shuffle(modes)
    landed: list[tuple[str, str, int | None]] = []
    group = Group(str(scratch))
    t0 = time.monotonic()
    try:
        newest = None
        for mode in modes:
            before, on_disk = newest or 0, _snapshot(root)
            group.spawn(root)
            _kill_moment(group, root, mode, rng, before)
            group.kill()
            where = _where_it_landed(root, on_disk)
            newest = _check_root(root)
            assert (newest or 0) >= before, f"commit {before} was lost ({where})"
            landed.append((mode, where, newest))

        # The end: the last kill in a step's data writes leaves debris newer than the newest
        # commit, which gc must leave alone (it may be a save in progress) ...
        for _ in range(5):
            before, on_disk = newest or 0, _snapshot(root)
            group.spawn(root)
            _kill_moment(group, root, "data", rng, before)
            group.kill()
            where = _where_it_landed(root, on_disk)
            newest = _check_root(root)
            landed.append(("data", where, newest))
            if any(not s.committed and s.step > newest for s in list_steps(root)):
                break
        debris = [s.step for s in list_steps(root) if not s.committed and s.step > newest]
        assert debris, "no kill left a step's data writes unfinished"
    finally:
        group.close()
    kills = len(landed)
    assert kills >= KILLS
    committed = _committed(root)
    before_gc = {s: _files(_step_dir(root, s)) for s in committed}
    older = [s.path for s in list_steps(root) if not s.committed and s.step < newest]
    assert sorted(_gc(root)) == older  # none, unless the last kill cut a retention short
    assert [s.step for s in list_steps(root) if not s.committed] == debris

    # ... and once a later step commits (a restarted job whose retention was cut short by a
    # kill, here written by the test), gc removes that debris and nothing else.
    later = max(debris) + 1
    state = cw.expected_state(later)
    anyshard.save(_step_dir(root, later), state)
    assert sorted(_gc(root)) == [_step_dir(root, s) for s in debris]
    listed = list_steps(root)
    assert [s.step for s in listed] == [*committed, later]
    assert all(s.committed for s in listed)
    assert {s: _files(_step_dir(root, s)) for s in committed} == before_gc
    assert _check_root(root) == later

    counts = collections.Counter(where for _, where, _ in landed)
    took = time.monotonic() - t0
    print(f"\nsync: {kills} kills in {took:.1f}s; newest commit {newest}; where: {dict(counts)}")
    for mode, where, step in landed:
        print(f"  {mode:9s} -> {where} (newest commit {step})")
    # the aimed kills land in these phases however fast the machine is (a poll that misses a
    # phase moves on to the next step's), so both must have been hit
    assert sum(n for where, n in counts.items() if where.startswith("data")) >= 1
    assert sum(n for where, n in counts.items() if where.startswith("manifest")) >= 1


# Async saves, tiered uploads and incremental saves, killed the same way: each kill lands in a
# background write, an upload, the hashing of an incremental save or a retention deletion (which,
# under incremental saves, keeps the files that kept steps reference). `python tools/crash_soak.py` runs many more of these.
OTHER_KILLS = int(os.environ.get("ANYSHARD_CRASH_KILLS", "6"))


@pytest.mark.parametrize("save_mode", ["async", "tiered", "incremental"])
def test_sigkill_during_async_saves_and_tiered_uploads_never_loses_a_commit(tmp_path, save_mode):
    root = str(tmp_path / "ckpt")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rng = random.Random(SEED + len(save_mode))
    modes = (MODES * (1 + OTHER_KILLS // len(MODES)))[:OTHER_KILLS]
    rng.shuffle(modes)
    group = Group(str(scratch))
    landed, t0 = [], time.monotonic()
    try:
        newest = None
        for mode in modes:
            before, on_disk = newest or 0, _snapshot(root)
            group.spawn(root, save_mode)
            _kill_moment(group, root, mode, rng, before)
            group.kill()
            where = _where_it_landed(root, on_disk)
            newest = _check_root(root, fixed=save_mode == "incremental")
            assert (newest or 0) >= before, f"commit {before} was lost ({where})"
            landed.append((mode, where, newest))
    finally:
        group.close()
    assert len(landed) == OTHER_KILLS and newest
    if save_mode == "incremental":  # the newest step references f, and its file is still there
        manifest = anyshard.open(_step_dir(root, newest)).manifest
        assert any("model.f" in per for per in manifest.refs.values()), manifest.refs
    counts = collections.Counter(where for _, where, _ in landed)
    took = time.monotonic() - t0
    print(
        f"\n{save_mode}: {len(landed)} kills in {took:.1f}s; newest commit {newest}; where: {dict(counts)}"
    )


# kills per save mode (sync, async) against the object store: the suite's 4, the soak's more
S3_KILLS = int(os.environ.get("ANYSHARD_CRASH_KILLS", "4"))


@pytest.mark.parametrize("save_mode", ["sync", "async"])
def test_sigkill_during_saves_to_an_object_store_never_loses_a_commit(tmp_path, s3, save_mode):
    """The same kills against SeaweedFS (a real object store, no rename, the manifest written
    last with a conditional PUT), during sync and async saves: at random moments of the save
    loop and of the restart. After every kill, from what the bucket holds: every committed step
    verifies, no commit was lost, and a new Checkpointer restores the newest bit-exact. At the
    end `anyshard gc` leaves every commit, and with ``--stale-after 0`` (no save runs any more)
    removes every uncommitted step: no debris is left."""
    root = f"{s3}/crash-{save_mode}"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    rng = random.Random(SEED + 3 + (save_mode == "async"))
    restarts = max(1, S3_KILLS // 3)
    modes = ["random"] * (S3_KILLS - restarts) + ["restart"] * restarts
    rng.shuffle(modes)
    group = Group(str(scratch))  # the zygote inherits the AWS_* environment of the server
    newest, t0 = None, time.monotonic()
    try:
        for mode in modes:
            before = newest or 0
            group.spawn(root, save_mode)
            if mode == "restart":
                time.sleep(rng.uniform(0.0, 1.5))
            else:
                deadline = time.monotonic() + 60
                newer = functools.partial(_committed_after, root, before)
                if not _wait_for(group, newer, deadline, poll=S3_POLL):
                    pytest.fail(f"no step after {before} committed within 60 s:\n{group.logs()}")
                time.sleep(rng.uniform(0.0, 0.5))
            group.kill()
            newest = _check_root(root)
            assert (newest or 0) >= before, f"commit {before} was lost ({mode})"
    finally:
        group.close()
    assert newest and newest >= 2
    took = time.monotonic() - t0
    print(f"\ns3-{save_mode}: {len(modes)} kills in {took:.1f}s; newest commit {newest}")
    committed = _committed(root)
    _gc(root)
    assert _committed(root) == committed
    _gc(root, "--stale-after", "0")
    assert [s.step for s in list_steps(root)] == committed  # no debris left
