"""Crash soak: SIGKILL saving process groups at seeded random moments; after every kill, from
what is on disk only, every committed step verifies and the newest restores bit-exact.

    python tools/crash_soak.py --seed 1 --kills 20 --write-docs

It runs tests/unit/test_crash_safety.py with ``ANYSHARD_CRASH_SEED`` (the kills' modes, their
order and delays) and ``ANYSHARD_CRASH_KILLS`` (kills per mode for async, tiered and incremental
saves, and for sync and async saves to SeaweedFS; the sync test kills 12 times and until a kill
leaves a step's data writes unfinished). The suite runs the same tests with the default seed and
6 kills per local mode, 4 per object-store mode; ``--kills 50`` kills 12 + 5 x 50 times, 100 of
them during saves to the object store. Where a kill lands also depends on the machine's timing:
it prints, per save mode, the kills the tests counted and where they landed, as the files on
disk tell it.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

import benchkit as h

TEST = "tests/unit/test_crash_safety.py"
FAULTS = "tests/dist/test_failed_saves.py::test_a_seeded_fault_soak_loses_nothing_and_every_next_save_succeeds"
LINE = re.compile(r"^([\w-]+): (\d+) kills in ([\d.]+)s; newest commit (\w+)(?:; where: (.*))?$")
HEADING = "## Crash safety: SIGKILL at random moments (`tools/crash_soak.py`)"
INTRO = """A 2-rank group saves every step with `Checkpointer(keep_last=2)` (sync, async, tiered, incremental;
and sync and async to SeaweedFS) and is SIGKILLed at seeded random moments and restarted; after
every kill every committed step must verify and the newest restore bit-exact; at the end of the
object-store runs `anyshard gc --stale-after 0` leaves no debris. Kills per mode, where they
landed as the files on disk tell it (`-`: none; the object-store tests do not classify them).
Then `--faults` rounds of seeded storage faults (ENOSPC, EIO, EACCES on some ranks, sync or
async) on 2 ranks: each faulted save must fail on every rank within 10 s and leave no file, the
save after the fault clears must succeed, and every commit must load bit-exact."""


def main(argv: list[str] | None = None) -> int:
    p = h.parser(__doc__, records=False)
    kills = "kills per mode: async, tiered, incremental, s3-sync, s3-async"
    p.add_argument("--kills", type=int, default=40, help=kills)
    p.add_argument("--seed", type=int, default=20240611, help="the kills' seed (the suite's)")
    p.add_argument("--faults", type=int, default=20, help="rounds of injected storage faults")
    args = p.parse_args(argv)
    print(f"seed {args.seed}, {args.kills} kills per mode, {args.faults} faults", flush=True)
    env = dict(os.environ, ANYSHARD_CRASH_KILLS=str(args.kills), ANYSHARD_CRASH_SEED=str(args.seed))
    env.update(ANYSHARD_FAULT_ROUNDS=str(args.faults), ANYSHARD_FAULT_SEED=str(args.seed))
    load = h.RunLoad()
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-n", "0", "-p", "no:cacheprovider"]
    done = subprocess.run([*cmd, TEST, FAULTS], cwd=h.ROOT, env=env, capture_output=True, text=True)
    out = done.stdout.splitlines()
    runs = [m.groups() for m in map(LINE.match, out) if m]
    where = [ast.literal_eval(w) if w else None for *_, w in runs]
    places = sorted({k for w in where if w for k in w})
    kills = [f"{n} ({s} s; {c})" for _, n, s, c, _ in runs]
    rows = [["kills (seconds; newest commit at the end)", *kills]]
    rows += [[k, *("n/a" if w is None else w.get(k, "-") for w in where)] for k in places]
    result = [ln.strip("= ") for ln in out if " passed" in ln or " failed" in ln] or ["no result"]
    # anywhere in a line: pytest's progress dots may precede a printed line
    faults = re.findall(r"fault-soak:.*", done.stdout) or ["fault-soak: no result"]
    if done.returncode:  # no docs section: the output instead
        args.write_docs = None
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
    opts = ["--seed", str(args.seed), "--kills", str(args.kills), "--faults", str(args.faults)]
    total = f"{sum(int(r[1]) for r in runs)} kills; pytest: {result[-1]}"
    blocks = [(["where the kill landed", *(r[0] for r in runs)], rows), total, faults[-1]]
    h.report(args, opts, __file__, "crash_soak", f"seed {args.seed}", blocks, load,
             heading=HEADING, intro=INTRO)  # fmt: skip
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
