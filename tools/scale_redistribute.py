"""How `anyshard.redistribute`'s planning grows with the number of ranks: no processes, the
library's own planning code on the descriptions N ranks would exchange.

    python tools/scale_redistribute.py                  # N = 8 .. 1,024
    python tools/scale_redistribute.py --n 16 256 4096

The state of tools/bench_reshard.py (1 GiB fp32, 138 tensors), as DTensors on a (dp_shard = N/4,
tp=4) mesh (FSDP2 over TP), redistributed to a (dp_shard = N/8, tp=8) mesh. Each rank's
description is built as `redistribute` builds it (the mesh, and the mapping `hold_mapping`
derives from the placements); the plan as every rank computes it (`plan_redistribution` for its
own part, then `rounds_for`). Reported per N: one rank's planning time (one core), rank 0's
moves (local copies and messages) and its rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import benchkit as h  # noqa: E402
from benchkit.llama import MESHES, model_spec, placements  # noqa: E402

from anyshard.api.redistribute import DEFAULT_MAX_INFLIGHT_BYTES, plan_redistribution  # noqa: E402
from anyshard.api.tensor_layout import hold_mapping  # noqa: E402
from anyshard.format.mesh import MeshEntry  # noqa: E402
from anyshard.reshard.exchange import rounds_for  # noqa: E402


def describe(n: int, tp: int) -> dict:
    """One rank's description of the state on a (dp_shard = n / tp, tp) mesh."""
    sizes = {"dp_shard": n // tp, "tp": tp}
    mesh, names, dims = MeshEntry.row_major(sizes).to_json(), tuple(sizes), tuple(sizes.values())
    out = {}
    for name, shape, kind in model_spec(1.0):
        m = hold_mapping(name, placements(kind, MESHES["src"][1]), names, dims, names, {})
        out[name] = {"shape": list(shape), "mesh": mesh, "map": str(m), "dtype": "F32"}
    return {"tensors": out, "values": {}}


def measure(n: int) -> list:
    """A row: ranks, one rank's planning seconds, rank 0's moves and rounds."""
    mine = {"src": describe(n, 4), "dst": describe(n, 8), "problems": []}
    t0 = time.perf_counter()
    plan, _ = plan_redistribution([mine] * n, DEFAULT_MAX_INFLIGHT_BYTES, rank=0)  # all alike
    rounds = rounds_for(plan, 0, n)
    took = time.perf_counter() - t0
    own = len(plan.local) + sum(len(g) for msgs in plan.messages.values() for g in msgs)
    return [f"{n:,}", f"{took:.2f}", f"{own:,}", len(rounds)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, nargs="+", default=[8, 64, 256, 1024], help="rank counts")
    args = p.parse_args(argv)
    if bad := [n for n in args.n if n % 8]:
        p.error(f"--n {bad}: the meshes need a multiple of 8 ranks")
    head = ["ranks", "planning s / rank", "rank 0's moves", "rank 0's rounds"]
    print(h.table(head, [], markdown=True))
    for n in args.n:
        print(h.table(head, [measure(n)], markdown=True).splitlines()[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
