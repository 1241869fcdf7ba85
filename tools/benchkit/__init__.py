"""What the benchmarks in tools/ share: the harness (measuring, spawning ranks, repeating,
reporting) and the workloads that several benchmarks run.

A tool imports it as ``import benchkit`` (tools/ is on sys.path where a tool runs). The harness,
its names all here: `Meter`/`measure` take the same counters for every system (wall and CPU
seconds, the /proc/self/io counters `IO_KEYS`, the peak RSS; ``measure``), `run_process` the same
of a command; `run_ranks` starts gloo ranks (``ranks``); `rotations`/`paired` alternate systems
(A B, B A, ...) so that each pair sees the same machine state, `median`, `worst_ranks`,
`spearman` sum repetitions up (``stats``); `Records`, `table`, `report`: the results
(``report``); `targets`: the checks against a benchmark's targets (``targets``); `s3_server`, an
S3 server on loopback, and `Relay`, the bytes it sends (``s3``).

The workloads, a module each:

- ``benchkit.llama``: Llama-shaped models (the tensors' shapes, their placements on a mesh,
  seeded values) and the states bench_reshard and bench_redistribute move between meshes;
- ``benchkit.trainer_runs``: the reference trainer run as a job (`train`) and its step times;
- ``benchkit.simulated_ranks``: N simulated ranks' save manifest and load planning (scale_sim);
- ``benchkit.mutations`` and ``benchkit.fuzzing``: damaged checkpoints and every entry point
  called on them (fuzz_checkpoints).
"""

from .measure import (
    BASES,
    IO_KEYS,
    ROOT,
    GiB,
    Meter,
    MiB,
    RunLoad,
    as_bytes,
    busy_cpu_s,
    cpu_s_of,
    drop_cache,
    du,
    measure,
    own_cpu_s,
    proc_io,
    run_process,
    status_kib,
)
from .ranks import in_fresh_process, measure_ranks, run_ranks
from .report import (
    Records,
    fs_type,
    git_state,
    machine_lines,
    parser,
    regime_dirs,
    report,
    rerun_command,
    table,
    version,
    words,
    write_section,
)
from .s3 import Relay, s3_server
from .stats import (
    fmt_spread,
    median,
    median_of,
    medians,
    paired,
    rotations,
    spearman,
    worst_ranks,
)
from .targets import Check, at_most, targets

__all__ = [
    "BASES", "IO_KEYS", "ROOT", "Check", "GiB", "Meter", "MiB", "Records", "Relay", "RunLoad",
    "as_bytes", "at_most", "busy_cpu_s", "cpu_s_of", "drop_cache", "du", "fmt_spread", "fs_type",
    "git_state", "in_fresh_process", "machine_lines", "measure", "measure_ranks", "median",
    "median_of", "medians", "own_cpu_s", "paired", "parser", "proc_io", "regime_dirs", "report",
    "rerun_command", "rotations", "run_process", "run_ranks", "s3_server", "spearman",
    "status_kib", "table", "targets", "version", "words", "worst_ranks", "write_section",
]  # fmt: skip
