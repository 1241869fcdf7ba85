"""What the benchmarks in tools/ share: measuring, spawning ranks, repeating, reporting.

A tool imports it as ``import harness`` (a script's own folder is on ``sys.path``).

* Measuring: `Meter` (a ``with`` block) and `measure` (a call) take the same counters for every
  system: wall seconds, CPU seconds (user + sys of this process, all threads, and of its waited
  children; optionally of other processes such as a server), the ``/proc/self/io`` counters
  ``rchar``, ``wchar``, ``read_bytes``, ``write_bytes``, and the peak RSS during the block
  (VmHWM after a reset through ``/proc/self/clear_refs``; a 2 ms VmRSS sampler thread where the
  reset is refused, its own /proc reads subtracted from ``rchar``). `run_process` takes the
  same counters of a command in a fresh process.
* Ranks: `run_ranks` spawns N processes joined in a gloo group; `measure_ranks` measures one
  operation on every rank from a common barrier; `in_fresh_process` runs one call alone.
* Repeating: `rotations` and `paired` alternate the systems (A B, B A, ...), so that each pair
  of measurements sees the same machine state; `spread` and `fmt_spread` give the median with
  min/max.
* Reporting: `Records` (one JSON line per measurement), `table` (text or markdown),
  `write_section` (a ``<!-- name:begin -->``/``<!-- name:end -->`` section of a markdown file),
  `machine_lines` and `RunLoad` (the machine and how busy it was), `check_lines` (targets).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import multiprocessing.connection
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IO_KEYS = ("rchar", "wchar", "read_bytes", "write_bytes")

# --------------------------------------------------------------------------- counters


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """The I/O counters of ``/proc/PID/io`` (``rchar``: bytes asked of the kernel, any file
    system; ``read_bytes``: bytes fetched from a block device; ``wchar``, ``write_bytes``)."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (ln.split(": ") for ln in f.read().splitlines() if ln)}


def status_kib(field: str, pid: int | str = "self") -> int:
    """A KiB field of ``/proc/PID/status`` (VmRSS, VmHWM); -1 where it is missing."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def reset_hwm() -> bool:
    """Reset this process's VmHWM to its VmRSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def own_cpu_s() -> float:
    """User + sys seconds of this process (all threads) and of its waited-for children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def cpu_s_of(pids: Sequence[int]) -> float:
    """User + sys seconds of other processes (a server's), summed; NaN if one is gone."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return float("nan")
    return total


class _RssSampler(threading.Thread):
    def __init__(self, period: float = 0.002):
        super().__init__(daemon=True)
        self.period, self.peak_kib, self.own_rchar = period, 0, 0
        self.stop = threading.Event()

    def run(self) -> None:
        fd = os.open("/proc/self/status", os.O_RDONLY)
        try:
            while True:
                data = os.pread(fd, 4096, 0)
                self.own_rchar += len(data)
                if m := re.search(rb"VmRSS:\s+(\d+)", data):
                    self.peak_kib = max(self.peak_kib, int(m.group(1)))
                if self.stop.wait(self.period):
                    break
        finally:
            os.close(fd)


class Meter:
    """``with Meter() as m: ...``; then ``m.record`` holds, for the block: ``wall_s``,
    ``cpu_s``, the `IO_KEYS` deltas, ``rss_peak`` and ``rss_over`` (bytes: the peak VmRSS, and
    that minus VmRSS at entry) and, with ``other_pids``, ``other_cpu_s`` of those processes."""

    def __init__(self, other_pids: Sequence[int] = ()):
        self.other_pids = list(other_pids)
        self.record: dict[str, Any] = {}

    def __enter__(self) -> Meter:
        self._rss0 = status_kib("VmRSS")
        self._sampler = None if reset_hwm() else _RssSampler()
        if self._sampler:
            self._sampler.start()
        self._io0, self._other0 = proc_io(), cpu_s_of(self.other_pids)
        self._cpu0, self._t0 = own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, cpu, io1 = time.perf_counter() - self._t0, own_cpu_s() - self._cpu0, proc_io()
        r = self.record
        r.update(wall_s=wall, cpu_s=cpu, **{k: io1[k] - self._io0[k] for k in IO_KEYS})
        if self._sampler:
            self._sampler.stop.set()
            self._sampler.join()
            r["rchar"] -= self._sampler.own_rchar
            peak = max(self._sampler.peak_kib, status_kib("VmRSS"))
        else:
            peak = status_kib("VmHWM")
        r.update(rss_peak=peak * 1024, rss_over=(peak - self._rss0) * 1024)
        if self.other_pids:
            r["other_cpu_s"] = cpu_s_of(self.other_pids) - self._other0


def measure(fn: Callable[[], Any], other_pids: Sequence[int] = ()) -> dict[str, Any]:
    """`Meter`'s record of ``fn()``; what ``fn`` returns, if not None, under ``result``."""
    with Meter(other_pids) as m:
        value = fn()
    if value is not None:
        m.record["result"] = value
    return m.record


def run_process(cmd: Sequence[str], log_path: str) -> dict[str, Any]:
    """Run ``cmd`` in a fresh process (output to ``log_path``) and take `Meter`'s counters of
    it: ``wall_s``, ``cpu_s``, the `IO_KEYS` (read from /proc before the exit status is
    collected) and ``rss_peak`` (``ru_maxrss``); ``rc``, and the log's tail under ``log``."""
    with open(log_path, "w+") as log:
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT)
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        wall = time.perf_counter() - t0
        try:
            io = proc_io(proc.pid)
        except OSError:
            io = dict.fromkeys(IO_KEYS, -1)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read()[-4000:]
    return {
        "wall_s": wall,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        **{k: io[k] for k in IO_KEYS},
        "rss_peak": usage.ru_maxrss * 1024,  # KiB on Linux
        "rc": proc.returncode,
        "log": text,
    }


def drop_cache(path: str) -> str:
    """Make every file under ``path`` cold: ``drop_caches`` where permitted, else fsync and
    ``posix_fadvise(DONTNEED)`` on each file. Returns the method used."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return "drop_caches"
    except OSError:
        pass
    files = (
        [path]
        if os.path.isfile(path)
        else [os.path.join(d, n) for d, _, ns in os.walk(path) for n in ns]
    )
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


# --------------------------------------------------------------------------- processes, ranks


def _child(
    conn: Any,
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world: int,
    store: str | None,
    threads: int,
) -> None:
    ok, value, group = True, None, False
    try:
        if store is not None:
            import torch
            import torch.distributed as dist

            os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it
            torch.set_num_threads(threads)
            dist.init_process_group(
                "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world
            )
            group = True
            value = fn(rank, world, *args)
        else:
            value = fn(*args)
    except BaseException as e:  # the parent raises it, naming the rank
        import traceback

        ok, value = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    conn.send((ok, value))
    conn.close()
    if group:
        import torch.distributed as dist

        dist.destroy_process_group()
    sys.stdout.flush()
    # no interpreter finalization: gloo's threads can abort the process there (pytorch#179291)
    os._exit(0 if ok else 1)


def _spawn(
    fn: Callable[..., Any], args: tuple, world: int, store: str | None, threads: int
) -> list[Any]:
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(send, fn, args, rank, world, store, threads))
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    results: list[Any] = [None] * world
    errors: list[str] = []
    waiting = dict(enumerate(pipes))
    while waiting:  # a failed rank ends the others, which would wait for it forever
        for conn in mp.connection.wait(list(waiting.values())):
            rank = pipes.index(conn)  # type: ignore[arg-type]
            del waiting[rank]
            try:
                ok, results[rank] = conn.recv()
            except EOFError:
                ok, results[rank] = False, "the process died without a result"
            if not ok:
                errors.append(f"rank {rank} of {fn.__name__}: {results[rank]}")
                for p in procs:
                    p.terminate()
                waiting.clear()
    for rank, p in enumerate(procs):
        p.join()
        if p.exitcode and not errors:
            errors.append(f"rank {rank} of {fn.__name__} exited {p.exitcode}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1) -> list[Any]:
    """Spawn ``world`` processes that join one gloo group (a FileStore; ``LOCAL_WORLD_SIZE``
    set as torchrun sets it; ``threads`` torch threads each) and call ``fn(rank, world,
    *args)``; the ranks' return values, in rank order. A failed rank raises, naming it."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="bench-ranks-") as d:
        return _spawn(fn, args, world, os.path.join(d, "store"), threads)


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a freshly spawned process (nothing this process imported in it)."""
    return _spawn(fn, args, 1, None, 1)[0]


def measure_ranks(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> list[dict]:
    """Inside a rank: `measure` ``fn`` on every rank, timed from a common barrier (``before``
    runs on rank 0 between two barriers, e.g. `drop_cache`); every rank's record, rank order."""
    import gc

    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    if before is not None and dist.get_rank() == 0:
        before()
    dist.barrier()
    rec = measure(fn)
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, rec)
    return out


# --------------------------------------------------------------------------- repetitions


def rotations(names: Sequence[str], reps: int) -> Iterator[tuple[int, list[str]]]:
    """``(rep, order)``: the systems rotated by one each repetition (A B C, B C A, ...)."""
    for rep in range(reps):
        k = rep % len(names)
        yield rep, list(names[k:]) + list(names[:k])


def paired(
    systems: dict[str, Callable[[], Any]],
    reps: int,
    *,
    before: Callable[[str], Any] | None = None,
    check: Callable[[str], Any] | None = None,
    other_pids: Sequence[int] = (),
    records: Records | None = None,
    **labels: Any,
) -> dict[str, list[dict]]:
    """`measure` every system once per repetition in `rotations` order: ``before(name)`` ahead
    of each (untimed), ``check(name)`` after it (stored as ``exact``); the records per system,
    each also added to ``records`` with ``labels``."""
    out: dict[str, list[dict]] = {n: [] for n in systems}
    for rep, order in rotations(list(systems), reps):
        for name in order:
            if before is not None:
                before(name)
            rec = measure(systems[name], other_pids)
            if check is not None:
                rec["exact"] = check(name)
            out[name].append(rec)
            if records is not None:
                records.add(rec, system=name, rep=rep, **labels)
    return out


def spread(xs: Sequence[float]) -> dict[str, float]:
    """``median``, ``min`` and ``max`` of ``xs`` (NaN for none)."""
    if not xs:
        return dict.fromkeys(("median", "min", "max"), float("nan"))
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def median_of(recs: Sequence[dict], key: str) -> float:
    """The median of one counter over repetitions' records."""
    return spread([r[key] for r in recs])["median"]


def fmt_spread(xs: Sequence[float], form: str = ".2f") -> str:
    """``median [min-max]``, or the one value."""
    s = spread(xs)
    if len(xs) < 2:
        return format(s["median"], form)
    return f"{s['median']:{form}} [{s['min']:{form}}-{s['max']:{form}}]"


class Records:
    """Measurements of one run; with a path, each also goes there as one JSON line."""

    def __init__(self, path: str | None, bench: str):
        self.path, self.bench, self.rows = path, bench, []
        if path:
            open(path, "w").close()

    def add(self, rec: dict, **labels: Any) -> dict:
        row = {"bench": self.bench, **labels, **rec}
        self.rows.append(row)
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(row, default=str) + "\n")
        return rec


# --------------------------------------------------------------------------- reporting


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool) -> str:
    """A table: markdown, or right-aligned text columns under a rule."""
    body = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x[i]) for x in [list(head), *body]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([fmt(head), fmt(["-" * w for w in widths]), *map(fmt, body)])


def replace_section(
    path: str, begin: str, end: str, lines: list[str], *, heading: str | None = None
) -> None:
    """Write ``lines`` between the markers ``begin`` and ``end`` into the markdown file ``path``:
    in place of the existing section; else right under ``heading`` where the file has it, else
    at the end (after ``heading`` when given). A missing file starts as ``# Benchmarks``."""
    text = "\n".join([begin, *lines, end])
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) :]
    elif heading is not None and heading in old:
        at = old.index(heading) + len(heading)
        new = old[:at] + "\n\n" + text + "\n" + old[at:].lstrip("\n")
    elif heading is not None:
        new = old.rstrip("\n") + "\n\n\n" + heading + "\n\n" + text + "\n"
    else:
        new = old.rstrip("\n") + "\n\n" + text + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(new)


def write_section(path: str, name: str, lines: list[str], *, heading: str | None = None) -> None:
    """`replace_section` between ``<!-- name:begin -->`` and ``<!-- name:end -->``."""
    replace_section(path, f"<!-- {name}:begin -->", f"<!-- {name}:end -->", lines, heading=heading)


def rerun_command(tool: str, argv: Sequence[str] | None = None) -> str:
    """``python tools/NAME ARGS --write-docs``: the command that reproduces this run of
    ``tool`` (a file in tools/) and writes its section."""
    args = " ".join(sys.argv[1:] if argv is None else argv).replace("--write-docs", "")
    return f"python tools/{os.path.basename(tool)} {' '.join(args.split())} --write-docs".replace(
        "  ", " "
    )


def today() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d")


def add_output_args(p: argparse.ArgumentParser) -> None:
    """``--write-docs [PATH]`` (docs/benchmarks.md), ``--json PATH``, ``--jsonl PATH``."""
    p.add_argument(
        "--write-docs",
        nargs="?",
        const="docs/benchmarks.md",
        default=None,
        metavar="PATH",
        help="write the tool's section of this markdown file",
    )
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--jsonl", default=None, help="also write one JSON line per measurement here")


def version(dist: str) -> str:
    """The installed version of a distribution, or ``?``."""
    from importlib.metadata import version as v

    try:
        return v(dist)
    except Exception:
        return "?"


def fs_type(path: str) -> str:
    """``TYPE (DEVICE on MOUNT)`` of the file system holding ``path``."""
    best, kind, real = "", "?", os.path.realpath(path)
    with open("/proc/mounts") as f:
        for parts in (line.split() for line in f):
            mnt = parts[1]
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, f"{parts[2]} ({parts[0]} on {mnt})"
    return kind


def git_state() -> str:
    """The commit of the library measured, and which of its files differ from it."""

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["git", "-C", ROOT, *args], capture_output=True, text=True, timeout=10
        )

    try:
        head, dirty = (
            git("rev-parse", "--short", "HEAD"),
            git("status", "--porcelain", "--", "anyshard"),
        )
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    if head.returncode != 0:
        return "commit unknown"
    changed = [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    state = (
        "library files modified in the work tree: " + ", ".join(changed[:6]) + more
        if changed
        else "library files as committed"
    )
    return f"commit {head.stdout.strip()} ({state})"


def machine_lines(dirs: dict[str, str] | None = None) -> list[str]:
    """Markdown bullets: CPU, memory, kernel, Python, torch; each named directory's file
    system; the library's commit."""
    model = platform.processor() or "?"
    with open("/proc/cpuinfo") as f:
        model = next(
            (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model
        )
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / (1 << 20)
    lines = [
        f"- CPU: {os.cpu_count()} cores ({model}), {mem:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {version('torch')}"
    ]
    lines += [f"- {name}: `{d}` on {fs_type(d)}" for name, d in (dirs or {}).items()]
    return lines + [f"- anyshard: {git_state()}"]


def busy_cpu_s() -> float:
    """Machine-wide non-idle CPU seconds so far (/proc/stat: user nice system irq softirq steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / os.sysconf(
        "SC_CLK_TCK"
    )


class RunLoad:
    """Started when made; `note` tells how long the run took and how busy the rest of the
    machine was meanwhile (CPU seconds not spent by this process or its children)."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0, self.load0 = (
            time.time(),
            busy_cpu_s(),
            own_cpu_s(),
            os.getloadavg()[0],
        )

    def note(self) -> str:
        wall = time.time() - self.t0
        foreign = max(0.0, busy_cpu_s() - self.busy0 - (own_cpu_s() - self.own0))
        return (
            f"run took {wall:.0f} s; CPU busy time of other processes on the machine during it: "
            f"{foreign:.0f} s of {wall * (os.cpu_count() or 1):.0f} core-seconds; load average "
            f"before: {self.load0:.1f}, after: {os.getloadavg()[0]:.1f}"
        )


def verdict(ok: bool | None) -> str:
    return "INFO" if ok is None else "PASS" if ok else "FAIL"


def check_lines(checks: Sequence[tuple[str, bool | None, str]], bullet: str = "- ") -> list[str]:
    """One line per target check ``(name, ok, detail)``: ``- PASS name: detail``."""
    return [f"{bullet}{verdict(ok)} {name}: {detail}" for name, ok, detail in checks]


@contextmanager
def s3_server(kind: str = "moto") -> Iterator[tuple[Any, list[int]]]:
    """An S3 server on 127.0.0.1 (``moto``'s, or ``seaweedfs``) for the ``with`` block, found
    through the AWS_* environment that is set for it: ``(server, its process ids)``."""
    if kind == "seaweedfs":
        from anyshard.trainer_integration.seaweed import SeaweedServer

        server: Any = SeaweedServer()
    else:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3_server import MotoServer

        server = MotoServer()
    server.start()
    try:
        os.environ.update(server.env())
        # a loaded server answers slowly: no spurious retry should enter the times
        os.environ.setdefault("ANYSHARD_STORAGE_DEADLINE", "600")
        procs = [server._proc] if kind != "seaweedfs" else list(server._procs.values())
        yield server, [p.pid for p in procs]
    finally:
        server.stop()
