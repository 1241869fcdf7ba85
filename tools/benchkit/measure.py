"""Counters of a block of code or of a command: wall and CPU seconds, the /proc/self/io counters
`IO_KEYS`, the peak RSS (VmHWM after a reset through /proc/self/clear_refs, else a 2 ms VmRSS
sampler thread); cold page caches; how busy the rest of the machine was during a run.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

MiB, GiB = 1 << 20, 1 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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
