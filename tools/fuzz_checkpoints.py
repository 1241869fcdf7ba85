"""Mutation fuzzer: damaged and hostile checkpoints through every entry point of anyshard.

    python tools/fuzz_checkpoints.py --mutations 100000 --seed 0 --write-docs  # ~1.5 h, 2 cores
    python tools/fuzz_checkpoints.py --mutations 300 --seed 1                  # smoke test
    python tools/fuzz_checkpoints.py --every-byte --write-docs   # each metadata byte flipped

The seed draws the mutations (``--only N``: mutation N of it alone); SIGINT or SIGTERM stops a
run, which still reports. A mutation damages a copy of a pristine checkpoint (anyshard: plain,
with a UCL spec, an incremental step, the plain and incremental ones holding checksum tiles of a
2-d and of a 3-d tensor, data file version 4; DCP; Hugging Face) once (`benchkit.mutations`),
then every
entry point is called on it (`benchkit.fuzzing`; loads in ``--procs`` gloo processes). Recorded:
every exception but an ``AnyshardError`` (the CLI's exit code 3), every call over 5 s or growing
the peak RSS by 1 GiB, and the reads after a flipped data bit that returned a wrong value.
Edits of the manifest or a header as JSON are sealed again (a hostile writer's checksum is
right), so that what lies behind the seal is fuzzed too. ``--every-byte`` instead flips every
byte of the manifest and of every data file's header (length and JSON) of the anyshard
checkpoints, one at a time (byte i XOR ``MASKS[i % 3]``), and runs each as above.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import benchkit as h  # noqa: E402
from benchkit.fuzzing import SLOW_S, Findings, fuzz  # noqa: E402

MEMORY_CAP = 8 << 30
HEADING = "## Reliability: damaged and hostile checkpoints (`tools/fuzz_checkpoints.py`)"
INTRO = """Each mutation damages a copy of a small checkpoint (anyshard, with a UCL spec, DCP, Hugging Face)
and calls every entry point on it: `anyshard.open`, `anyshard.load` (in 1 and 4 processes),
`verify_checkpoint`, the CLI's `inspect` and `convert`. The anyshard checkpoints hold checksum
tiles of a 2-d and of a 3-d tensor (data file version 4), which column slices and the 4-process
loads (a 3-d tensor split along its last dim) read by tiles. The seed draws the mutations."""
ROWS = (
    "mutations; calls; calls refused with an `AnyshardError`",
    "exceptions other than `AnyshardError`",
    f"calls over {SLOW_S:.0f} s; calls growing the peak RSS by over 1 GiB",
    "flipped data bits; reads of a whole tensor after one that returned the pristine / a wrong value",
    "reads of part of a tensor after a flipped bit that returned a wrong value without an error",
    "tensors and JSON values returned after a flipped metadata byte; wrong ones",
)


def summary(f: Findings) -> list:
    """The counts as a table, and a line per finding (the first few of each kind)."""
    wrong_full = len(f.flips_undetected_full)
    counts = [f"{f.mutations}; {f.calls}; {f.refused}", len(f.internal)]
    counts += [f"{len(f.slow)}; {len(f.rss)}"]
    counts += [f"{f.flips}; {f.flips_returned_full - wrong_full} / {wrong_full}"]
    counts += [f"{f.flips_undetected_part} of {f.flips_returned_part}"]
    counts += [f"{f.meta_returned}; {len(f.meta_wrong)}"]
    lines = [f"- internal: {entry} on {label}: {what}" for label, entry, what in f.internal[:20]]
    lines += [f"- slow: {entry} on {label}: {took} s" for label, entry, took in f.slow[:10]]
    lines += [f"- peak RSS +{n >> 20} MiB: {entry} on {label}" for label, entry, n in f.rss[:10]]
    lines += [f"- undetected whole read: {item}" for item in f.flips_undetected_full[:10]]
    lines += [f"- wrong after a metadata byte: {item}" for item in f.meta_wrong[:10]]
    return [(["what", "count"], list(zip(ROWS, counts, strict=True))), "\n".join(lines)]


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, records=False)
    p.add_argument("--mutations", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0, help="draws the mutations (default: 0)")
    p.add_argument("--only", type=int, default=None, help="run mutation number N of the seed alone")
    p.add_argument("--procs", type=int, default=4, help="gloo processes that also load (0: none)")
    p.add_argument("--procs-every", type=int, default=10, help="load in them every N-th round")
    p.add_argument("--every-byte", action="store_true", help="instead: each metadata byte flipped")
    args = p.parse_args(argv)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)  # an absurd allocation: a MemoryError
    if hard == resource.RLIM_INFINITY or hard > MEMORY_CAP:  # recorded, not the OOM killer
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, hard))
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # raises KeyboardInterrupt
    print(f"seed {args.seed}", flush=True)
    load = h.RunLoad()
    with tempfile.TemporaryDirectory(prefix="anyshard-fuzz-") as work:
        f = fuzz(args.mutations, args.seed, work, True, args.only, args.procs, args.procs_every,
                 args.every_byte)  # fmt: skip
    kinds = ", ".join(f"{k} {n}" for k, n in sorted(f.kinds.items()))
    run, blocks = f"seed {args.seed}; mutations: {kinds}", summary(f)
    opts = ["--mutations", args.mutations, "--seed", args.seed]
    opts = [*(["--every-byte"] if args.every_byte else opts), "--procs", args.procs]
    opts = [str(x) for x in [*opts, "--procs-every", args.procs_every]]
    if args.every_byte:  # a section under the same heading
        h.report(args, opts, __file__, "fuzz_every_byte", run, blocks, load)
    else:
        h.report(args, opts, __file__, "fuzz", run, blocks, load, heading=HEADING, intro=INTRO)
    return 1 if f.internal or f.slow or f.rss or f.flips_undetected_full or f.meta_wrong else 0


if __name__ == "__main__":
    sys.exit(main())
