"""What the benchmarks in tools/ share: measuring, spawning ranks, repeating, reporting.

A tool imports it as ``import benchkit``. `Meter`/`measure` take the same counters for every
system (wall and CPU seconds, the /proc/self/io counters `IO_KEYS`, the peak RSS: VmHWM after a
reset through /proc/self/clear_refs, else a 2 ms VmRSS sampler thread); `run_process` the same of
a command. `run_ranks` starts gloo ranks; `rotations`/`paired` alternate systems (A B, B A, ...)
so that each pair sees the same machine state; `Records`, `table`, `report`: the results.
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
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IO_KEYS = ("rchar", "wchar", "read_bytes", "write_bytes")
BASES = {"tmpfs": "/dev/shm", "disk": tempfile.gettempdir()}  # where --roots tmpfs,disk write


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/io: ``rchar`` (bytes asked of the kernel, any file system), ``read_bytes``
    (fetched from a block device), ``wchar``, ``write_bytes``."""
    with open(f"/proc/{pid}/io") as f:
        return {k: int(v) for k, v in (ln.split(": ") for ln in f.read().splitlines() if ln)}


def status_kib(field: str, pid: int | str = "self") -> int:
    """A KiB field of /proc/PID/status (VmRSS, VmHWM); -1 where it is missing."""
    with open(f"/proc/{pid}/status") as f:
        return next((int(ln.split()[1]) for ln in f if ln.startswith(field + ":")), -1)


def own_cpu_s() -> float:
    """User + sys seconds of this process (all threads) and of its waited-for children."""
    a, b = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return a.ru_utime + a.ru_stime + b.ru_utime + b.ru_stime


def cpu_s_of(pids: Sequence[int]) -> float:
    """User + sys seconds of other processes (a server's), summed; NaN if one is gone."""
    try:
        stats = [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split() for pid in pids]
        return sum(int(s[11]) + int(s[12]) for s in stats) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class _RssSampler(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak_kib, self.own_rchar, self.stop = 0, 0, threading.Event()

    def run(self) -> None:
        fd = os.open("/proc/self/status", os.O_RDONLY)
        while True:
            data = os.pread(fd, 4096, 0)
            self.own_rchar += len(data)
            if m := re.search(rb"VmRSS:\s+(\d+)", data):
                self.peak_kib = max(self.peak_kib, int(m.group(1)))
            if self.stop.wait(0.002):
                break
        os.close(fd)


class Meter:
    """``with Meter() as m: ...``; then ``m.record`` holds, for the block: ``wall_s``,
    ``cpu_s``, the `IO_KEYS` deltas, ``rss_peak`` and ``rss_over`` (bytes: the peak VmRSS, and
    that minus VmRSS at entry) and, with ``other_pids``, ``other_cpu_s`` of those processes."""

    def __init__(self, other_pids: Sequence[int] = ()):
        self.other_pids, self.record = list(other_pids), {}

    def __enter__(self) -> Meter:
        self._rss0, self._sampler = status_kib("VmRSS"), None
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # VmHWM reset to VmRSS
        except OSError:
            self._sampler = _RssSampler()
            self._sampler.start()
        self._io0, self._other0 = proc_io(), cpu_s_of(self.other_pids)
        self._cpu0, self._t0 = own_cpu_s(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall, cpu, io1 = time.perf_counter() - self._t0, own_cpu_s() - self._cpu0, proc_io()
        r = self.record
        r.update(wall_s=wall, cpu_s=cpu, **{k: io1[k] - self._io0[k] for k in IO_KEYS})
        peak = status_kib("VmHWM")
        if self._sampler:
            self._sampler.stop.set()
            self._sampler.join()
            r["rchar"] -= self._sampler.own_rchar
            peak = max(self._sampler.peak_kib, status_kib("VmRSS"))
        r.update(rss_peak=peak * 1024, rss_over=(peak - self._rss0) * 1024)
        if self.other_pids:
            r["other_cpu_s"] = cpu_s_of(self.other_pids) - self._other0


def measure(fn: Callable[[], Any], other_pids: Sequence[int] = ()) -> dict[str, Any]:
    """`Meter`'s record of ``fn()``; what ``fn`` returns, if not None, under ``result``."""
    with Meter(other_pids) as m:
        value = fn()
    return m.record if value is None else {**m.record, "result": value}


def run_process(cmd: Sequence[str], log_path: str) -> dict[str, Any]:
    """Run ``cmd`` in a fresh process (output to ``log_path``); `Meter`'s counters of it
    (``rss_peak`` is its ``ru_maxrss``; the I/O read before its exit status is collected),
    ``rc``, and the log's tail under ``log``."""
    with open(log_path, "w+") as log:
        t0 = time.perf_counter()
        pid = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT).pid
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
        wall = time.perf_counter() - t0
        try:
            io = {k: v for k, v in proc_io(pid).items() if k in IO_KEYS}
        except OSError:
            io = dict.fromkeys(IO_KEYS, -1)
        _, status, use = os.wait4(pid, 0)
        log.seek(0)
        out = {"wall_s": wall, "cpu_s": use.ru_utime + use.ru_stime, "log": log.read()[-4000:]}
    return {**out, **io, "rss_peak": use.ru_maxrss * 1024, "rc": os.waitstatus_to_exitcode(status)}


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
    for d, _, names in os.walk(path) if os.path.isdir(path) else [("", [], [path])]:
        for name in names:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    return "fadvise"


def _child(conn: Any, fn: Callable[..., Any], args: tuple, where: tuple) -> None:
    (rank, world, store, threads, environ), ok = where, True
    if environ is not None:  # the parent's environment now, not the fork server's at its start
        os.environ.clear()
        os.environ.update(environ)
    try:
        if store is None:
            value = fn(*args)
        else:
            import torch
            import torch.distributed as dist

            os.environ["LOCAL_WORLD_SIZE"] = str(world)  # as torchrun sets it
            torch.set_num_threads(threads)
            files = dist.FileStore(store, world)
            dist.init_process_group("gloo", store=files, rank=rank, world_size=world)
            value = fn(rank, world, *args)
    except BaseException as e:  # the parent raises it, naming the rank
        import traceback

        ok, value = False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    conn.send((ok, value))
    if store is not None and "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if ok else 1)  # gloo's threads can abort a finalizing interpreter (pytorch#179291)


def _spawn(
    fn: Callable[..., Any], args: tuple, world: int, store: str | None, threads: int
) -> list:
    """Gloo ranks (``store`` given) fork from a server that imported torch once: each rank
    starts in milliseconds and with the same modules, where a spawned rank imports torch for
    seconds; a fresh process (no ``store``) is spawned."""
    if store is None:
        ctx, environ = mp.get_context("spawn"), None
    else:
        ctx, environ = mp.get_context("forkserver"), dict(os.environ)
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = []
    for rank, (_, send) in enumerate(pipes):
        where = (rank, world, store, threads, environ)
        procs.append(ctx.Process(target=_child, args=(send, fn, args, where)))
        procs[-1].start()
        send.close()
    results, errors, waiting = [None] * world, [], {recv: r for r, (recv, _) in enumerate(pipes)}
    while waiting:  # a failed rank ends the others, which would wait for it forever
        for conn in mp.connection.wait(list(waiting)):
            rank = waiting.pop(conn)
            try:
                ok, results[rank] = conn.recv()
            except EOFError:
                ok, results[rank] = False, "the process died without a result"
            if not ok:
                errors.append(f"rank {rank} of {fn.__name__}: {results[rank]}")
                waiting.clear()
                for p in procs:
                    p.terminate()
                break
    for rank, p in enumerate(procs):
        p.join()
        if p.exitcode and not errors:
            errors.append(f"rank {rank} of {fn.__name__} exited {p.exitcode}")
    if errors:
        raise RuntimeError("\n".join(errors))
    return results


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, threads: int = 1) -> list[Any]:
    """Start ``world`` processes that join one gloo group (a FileStore; ``LOCAL_WORLD_SIZE``
    set as torchrun sets it; ``threads`` torch threads each) and call ``fn(rank, world,
    *args)``; the ranks' return values, in rank order. A failed rank raises, naming it."""
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
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, measure(fn))
    return out


def rotations(names: Sequence[str], reps: int) -> Iterator[tuple[int, list[str]]]:
    """``(rep, order)``: the systems rotated by one each repetition (A B C, B C A, ...)."""
    for rep in range(reps):
        yield rep, list(names[rep % len(names) :]) + list(names[: rep % len(names)])


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
            out[name].append(records.add(rec, system=name, rep=rep, **labels) if records else rec)
    return out


def median(xs: Sequence[float]) -> float:
    """The median of ``xs`` (NaN for none)."""
    return statistics.median(xs) if len(xs) else float("nan")


def median_of(recs: Sequence[dict], key: str) -> float:
    """The median of one counter over repetitions' records."""
    return median([r[key] for r in recs])


def fmt_spread(xs: Sequence[float], form: str = ".2f") -> str:
    """``median [min-max]``, or the one value."""
    tail = f" [{min(xs):{form}}-{max(xs):{form}}]" if len(xs) > 1 else ""
    return f"{median(xs):{form}}{tail}"


class Records:
    """Measurements of one run; with a path, each also goes there as one JSON line."""

    def __init__(self, path: str | None, bench: str):
        self.path, self.bench, self.rows = path, bench, []
        if path:
            open(path, "w").close()

    def add(self, rec: dict, **labels: Any) -> dict:
        """Keep ``rec`` with ``labels`` (system, rep, ...) and write its line; returns ``rec``."""
        self.rows.append({"bench": self.bench, **labels, **rec})
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(self.rows[-1], default=str) + "\n")
        return rec


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], markdown: bool) -> str:
    """A table: markdown, or right-aligned text columns under a rule."""
    body = [[str(c) for c in r] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body])
    widths = [max(len(x[i]) for x in [list(head), *body]) for i in range(len(head))]
    lines = [list(head), ["-" * w for w in widths], *body]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in lines)


def write_section(path: str, name: str, lines: list[str], *, heading: str | None = None) -> None:
    """Write ``lines`` between ``<!-- name:begin -->`` and ``<!-- name:end -->`` into the markdown
    file ``path``: in place of the existing section; else right under ``heading`` where the file
    has it, else at the end (after ``heading`` when given). A missing file starts as
    ``# Benchmarks``. Prints ``wrote PATH``."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = "\n".join([begin, *lines, end])
    old = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    if begin in old and end in old:
        new = old[: old.index(begin)] + text + old[old.index(end) + len(end) :]
    elif heading is not None and heading in old:
        at = old.index(heading) + len(heading)
        new = old[:at] + "\n\n" + text + "\n" + old[at:].lstrip("\n")
    else:
        head = "\n\n\n" + heading if heading is not None else ""
        new = old.rstrip("\n") + head + "\n\n" + text + "\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        f.write(new)
    print(f"\nwrote {path}")


def rerun_command(tool: str, argv: Sequence[str] | None = None) -> str:
    """``python tools/NAME ARGS --write-docs``: the command that reproduces this run of
    ``tool`` (a file in tools/) and writes its section (a path given to --write-docs left out)."""
    args, skip = [], False
    for a in sys.argv[1:] if argv is None else argv:
        if not (skip and not a.startswith("-")) and not a.startswith("--write-docs"):
            args.append(a)
        skip = a == "--write-docs"
    return " ".join(["python", f"tools/{os.path.basename(tool)}", *args, "--write-docs"])


class _Parser(argparse.ArgumentParser):
    """Applies ``quick`` (the options ``--quick`` sets) to what it parses."""

    quick: dict = {}

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extra = super().parse_known_args(args, namespace)
        if getattr(ns, "quick", False):
            vars(ns).update(self.quick)
        return ns, extra


def parser(
    doc: str, reps: int = 0, quick: dict | None = None, dirs: bool = False, records: bool = True
) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, with the flags the benchmarks share:
    ``--reps`` (default ``reps``), ``--quick`` (sets the options in ``quick``), ``--disk-dir``
    and ``--tmpfs-dir`` (``dirs``), ``--write-docs [PATH]`` and (``records``) ``--json PATH``,
    ``--jsonl PATH``."""
    p = _Parser(description=doc.split("\n\n")[0])
    if reps:
        p.add_argument("--reps", type=int, default=reps, help=f"repetitions ({reps}; median kept)")
    if quick:
        p.quick = quick
        sets = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in quick.items())
        p.add_argument("--quick", action="store_true", help=f"smoke test: {sets}")
    if dirs:
        p.add_argument("--disk-dir", default="/tmp", help="(parent) directory on the real disk")
        p.add_argument("--tmpfs-dir", default="/dev/shm", help="(parent) directory on tmpfs")
    p.add_argument("--write-docs", nargs="?", const="docs/benchmarks.md", metavar="PATH")
    if records:
        p.add_argument("--json", default=None, help="also write the results to this JSON file")
        p.add_argument("--jsonl", default=None, help="also write one JSON line per measurement")
    return p


def regime_dirs(args: argparse.Namespace, names: Sequence[str]) -> dict[str, str]:
    """``--disk-dir`` and ``--tmpfs-dir`` of the regimes in ``names`` whose directory exists."""
    dirs = {"disk": args.disk_dir, "tmpfs": args.tmpfs_dir}
    return {r: dirs[r] for r in names if r in dirs and os.path.isdir(dirs[r])}


def words(p: argparse.ArgumentParser, flag: str, text: str, allowed=None) -> list[str]:
    """The comma-separated words of a flag's ``text``; ``p.error`` where there is none, or one
    not in ``allowed``."""
    got = [w.strip() for w in text.split(",") if w.strip()]
    if not got or (allowed is not None and not set(got) <= set(allowed)):
        p.error(f"{flag}: one or more of {','.join(allowed or ['...'])}, not {text!r}")
    return got


def as_bytes(t: Any) -> memoryview:
    """A contiguous tensor's bytes, writable through the view."""
    import torch

    flat = t.reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B") if flat.numel() else memoryview(b"")


def du(path: str) -> int:
    """Bytes of the file at ``path``, or of all the files under it."""
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def report(args, argv, tool: str, name: str, run: str, blocks: list, load: RunLoad, *,
           heading=None, intro=None, under=None, dirs=None, machine=(), data=None):  # fmt: skip
    """Print ``run``, ``blocks`` (lines, and ``(head, rows)`` tables) and ``load``'s note; with
    ``--write-docs`` the docs section ``name`` (a new one ``under`` that heading): ``heading``,
    ``intro``, the command that reproduces the run (`rerun_command` of ``argv``) with its date and
    ``run``, the machine (`machine_lines` of ``dirs``, ``machine``, the note) and the blocks in
    markdown; with ``--json``, ``data``."""
    note, blocks = load.note(), [b for b in blocks if b]
    text = [b if isinstance(b, str) else table(*b, markdown=False) for b in blocks]
    print("\n\n".join([run, *machine, *text, note]), flush=True)
    if args.write_docs:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
        section = [line for x in (heading, intro) if x for line in (x, "")]
        section += [f"Command: `{rerun_command(tool, argv)}` ({date}, {run}).", "", "Machine:", ""]
        section += [*machine_lines(dirs), *machine, f"- {note}", ""]
        md = [b if isinstance(b, str) else table(*b, markdown=True) for b in blocks]
        write_section(args.write_docs, name, section + "\n\n".join(md).split("\n"), heading=under)
    if getattr(args, "json", None):
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1, default=str)


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
        for dev, mnt, fs, *_ in (line.split() for line in f):
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, f"{fs} ({dev} on {mnt})"
    return kind


def git_state() -> str:
    """The commit of the library measured, and which of its files differ from it."""

    def git(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", ROOT, *words], capture_output=True, text=True)

    try:
        head, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "anyshard")
    except (OSError, subprocess.SubprocessError):
        return "commit unknown"
    changed = [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]
    more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
    state = f"library files modified in the work tree: {', '.join(changed[:6])}{more}"
    state = state if changed else "library files as committed"
    return f"commit {head.stdout.strip()} ({state})" if head.returncode == 0 else "commit unknown"


def machine_lines(dirs: dict[str, str] | None = None) -> list[str]:
    """Markdown bullets: CPU, memory, kernel, Python, torch; each named directory's file
    system; the library's commit."""
    with open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "?")
    with open("/proc/meminfo") as f:
        mem = int(f.readline().split()[1]) / (1 << 20)
    lines = [
        f"- CPU: {os.cpu_count()} cores ({cpu}), {mem:.0f} GiB RAM, Linux {platform.release()}, "
        f"Python {platform.python_version()}, torch {version('torch')}"
    ]
    lines += [f"- {name}: `{d}` on {fs_type(d)}" for name, d in (dirs or {}).items()]
    return lines + [f"- anyshard: {git_state()}"]


def busy_cpu_s() -> float:
    """Machine-wide non-idle CPU seconds (/proc/stat: user nice system irq softirq steal)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]] + [0]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


class RunLoad:
    """Started when made; `note` tells how long the run took and how busy the rest of the
    machine was meanwhile (CPU seconds not spent by this process or its children)."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.time(), busy_cpu_s(), own_cpu_s()
        self.load0 = os.getloadavg()[0]

    def note(self) -> str:
        wall = time.time() - self.t0
        foreign = max(0.0, busy_cpu_s() - self.busy0 - (own_cpu_s() - self.own0))
        return (
            f"run took {wall:.0f} s; CPU busy time of other processes on the machine during it: "
            f"{foreign:.0f} s of {wall * (os.cpu_count() or 1):.0f} core-seconds; load average "
            f"before: {self.load0:.1f}, after: {os.getloadavg()[0]:.1f}"
        )


def targets(checks: Sequence[tuple[str, bool | None, str]]) -> str:
    """``Targets:`` and a line per check ``(name, ok, detail)``: ``- PASS name: detail`` (or
    ``FAIL``; ``INFO`` where ``ok`` is None)."""
    verdict = lambda ok: "INFO" if ok is None else "PASS" if ok else "FAIL"  # noqa: E731
    return "\n".join(["Targets:", "", *(f"- {verdict(ok)} {n}: {d}" for n, ok, d in checks)])


@contextmanager
def s3_server(kind: str = "moto") -> Iterator[tuple[Any, list[int]]]:
    """An S3 server on 127.0.0.1 (``moto``'s, or ``seaweedfs``) for the ``with`` block, found
    through the AWS_* environment that is set for it: ``(server, its process ids)``."""
    if kind == "seaweedfs":
        from anyshard.trainer_integration.demos.seaweed import SeaweedServer as Server
    else:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from s3_server import MotoServer as Server
    server: Any = Server()
    server.start()
    try:
        os.environ.update(server.env())
        # a loaded server answers slowly: no spurious retry should enter the times
        os.environ.setdefault("ANYSHARD_STORAGE_DEADLINE", "600")
        procs = list(server._procs.values()) if kind == "seaweedfs" else [server._proc]
        yield server, [p.pid for p in procs]
    finally:
        server.stop()
