"""Would a copy-on-write snapshot (``fork``) make an async save cheaper than staging copies?

    python tools/probe_fork_snapshot.py            # 1 GiB state, 1 GiB of other memory, 5 rounds

Holds a state of ``--gib`` GiB fp32 (tensors of 128 MiB) plus as much other memory. First it
times the copy of the state into reused staging buffers: what an async save blocks for without a
snapshot. Then per round: ``os.fork()`` (the child sleeps, as a child writing the checkpoint
would live on), an optimizer-like in-place update of the whole state while the child lives
(every page the parent writes is copied first), the same update after the child has exited, and
the staging copy (into buffers the fork left write-protected). CPU only, one torch thread; one
line per round, then the medians.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def ms(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size, GiB (default: 1.0)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (default: 5)")
    ap.add_argument("--child-s", type=float, default=0.5, help="the child's life (default: 0.5)")
    args = ap.parse_args()
    if not hasattr(os, "fork"):
        print("os.fork is not available here")
        return 1
    torch.set_num_threads(1)
    n = max(1, int(args.gib * 8))  # 128 MiB tensors
    state = [torch.randn(32 << 20) for _ in range(n)]
    other = torch.randn(n * (32 << 20))  # the rest of a training process's memory
    staging = [torch.empty_like(t) for t in state]

    def stage() -> None:  # the first call faults the staging pages in, as reused buffers are
        for s, t in zip(staging, state, strict=True):
            s.copy_(t)

    def update() -> None:
        for t in state:
            t.add_(1.0)

    stage()
    clean = statistics.median(ms(stage) for _ in range(3))
    print(f"staging copy into reused buffers, no fork yet: {clean:.0f} ms (median of 3)")
    rows = []
    for r in range(args.rounds):
        t0 = time.perf_counter()
        if (pid := os.fork()) == 0:
            time.sleep(args.child_s)
            os._exit(0)
        fork, cow = (time.perf_counter() - t0) * 1e3, ms(update)
        os.waitpid(pid, 0)
        rows.append((fork, cow, plain := ms(update), copy := ms(stage)))
        line = f"round {r + 1}: fork {fork:.1f} ms; update while the child lives {cow:.0f} ms; "
        print(f"{line}after {plain:.0f} ms; staging copy after {copy:.0f} ms", flush=True)
    fork, cow, plain, copy = (statistics.median(c) for c in zip(*rows, strict=True))
    size, rest = sum(t.numel() * 4 for t in state) / (1 << 30), other.numel() * 4 / (1 << 30)
    print(
        f"\nmedians ({size:.2f} GiB state, {rest:.2f} GiB other memory): fork {fork:.1f} ms; "
        f"in-place update {cow:.0f} ms while the child lives vs {plain:.0f} ms after; staging "
        f"copy {clean:.0f} ms before any fork, {copy:.0f} ms after one"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
