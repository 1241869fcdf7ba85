"""The ``anyshard`` command line's parser: one function per subcommand, each with its help,
options and examples, and the command it runs (``args.run``)."""

from __future__ import annotations

import argparse
import functools

from anyshard.cli.converting import convert_command, diff_command
from anyshard.cli.inspecting import inspect_command, verify_command
from anyshard.cli.plugins import plugin_commands, summary
from anyshard.cli.roots import gc_command, ls_command
from anyshard.cli.ucl_commands import ucl_check, ucl_explain
from anyshard.cli.values import seconds

_EXAMPLES = {
    "inspect": "examples:\n  anyshard inspect /ckpt/step-001000\n  anyshard inspect /ckpt/step-001000 --json",
    "verify": "examples:\n  anyshard verify /ckpt/step-001000",
    "ls": "examples:\n  anyshard ls /ckpt\n  anyshard ls s3://bucket/run1 --json",
    "gc": "examples:\n  anyshard gc /ckpt --dry-run\n  anyshard gc s3://bucket/run1\n"
    "  anyshard gc /ckpt --stale-after 3600   # also a killed job's newer, unfinished steps",
    "convert": "examples:\n"
    "  anyshard convert /ckpt/step-001000 ./hf                    # anyshard -> Hugging Face\n"
    "  anyshard convert ./hf ./hf-bf16 --to hf --dtype bf16 --max-shard-size 2GB\n"
    "  anyshard convert ./hf /ckpt/tp2 --spec hf_llama --layout tp=2,hidden=4096,heads=32,"
    "kv_heads=8,ffn=11008,vocab=32000,layers=32\n"
    "  anyshard convert ./hf /ckpt/plain                          # one plain rank, no spec\n"
    "  anyshard convert /ckpt/step-001000 ./hf --only '^model\\.' --rename '^model\\.=model.model.'\n"
    "  anyshard convert /ckpt/step-001000 ./dcp --to dcp           # for torch.distributed.checkpoint\n"
    "  anyshard convert /ckpt/step-001000 ./export.zarr --to zarr  # consolidated zarr v3 store",
    "diff": "examples:\n  anyshard diff /ckpt/step-001000 ./hf\n"
    "  anyshard diff ./hf ./hf-bf16 --atol 1e-2\n  anyshard diff a b --json",
    "ucl check": "examples:\n  anyshard ucl check my_model.ucl\n"
    "  anyshard ucl check megatron_gpt --layout pp=2,dp=2,tp=2,hidden=4096,heads=32,kv_heads=8,"
    "ffn=11008,vocab=32000,layers=32",
    "ucl explain": "examples:\n  anyshard ucl explain megatron_gpt --layout tp=2,hidden=64,heads=4,"
    "ffn=128,vocab=100,layers=2 model.layers.0.self_attn.q_proj.weight",
}
_FMT = argparse.RawDescriptionHelpFormatter


@functools.lru_cache(maxsize=1)
def command_parser() -> argparse.ArgumentParser:
    """The command line's parser, built once per process (argparse's gettext lookups make
    building it cost more than most commands it runs)."""
    p = argparse.ArgumentParser(
        prog="anyshard",
        description="Inspect, verify, convert, compare, list and clean checkpoints.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_inspect, _add_convert, _add_diff, _add_verify, _add_ls, _add_gc):
        add(sub)
    _add_plugins(sub)
    _add_ucl(sub)
    return p


def _command(sub, name: str, run, *, examples: str | None = None, **kwargs):
    """Subcommand ``name``, its examples (``_EXAMPLES[examples or name]``) under its help,
    which runs ``run``."""
    s = sub.add_parser(name, epilog=_EXAMPLES[examples or name], formatter_class=_FMT, **kwargs)
    s.set_defaults(run=run)
    return s


def _add_inspect(sub) -> None:
    s = _command(sub, "inspect", inspect_command, help="list a checkpoint's tensors")
    s.add_argument(
        "path", help="checkpoint directory or URL (anyshard, or Hugging Face safetensors)"
    )
    s.add_argument("--json", action="store_true", help="machine-readable output")


def _add_convert(sub) -> None:
    s = _command(
        sub,
        "convert",
        convert_command,
        help="convert a checkpoint to anyshard under a layout, Hugging Face, DCP or zarr",
        description="Convert SRC (any format anyshard reads, detected) into DST, "
        "streaming one tensor at a time. To anyshard, --spec and --layout give the target "
        "layout (every rank's files as if that layout had saved them); without them, one "
        "plain rank.",
    )
    s.add_argument("src", help="checkpoint directory, .safetensors file or URL")
    s.add_argument("dst", help="new directory or URL (or a .safetensors file with --to hf)")
    s.add_argument(
        "--to",
        choices=["anyshard", "hf", "dcp", "zarr"],
        help="target format: anyshard, hf (Hugging Face safetensors), dcp (PyTorch DCP, "
        "loadable by torch.distributed.checkpoint.load) or zarr (a consolidated zarr v3 store "
        "via tensorstore); default: hf for an anyshard source, anyshard otherwise",
    )
    s.add_argument("--spec", help="UCL spec of the target layout: a .ucl file or a shipped name")
    s.add_argument("--layout", help="mesh sizes and spec params, e.g. tp=2,hidden=64")
    s.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    s.add_argument("--only", metavar="REGEX", help="convert only the tensors whose names match")
    s.add_argument(
        "--rename",
        metavar="FROM=TO",
        action="append",
        help="rename tensors: re.sub(FROM, TO, name); repeat to apply several in order",
    )
    s.add_argument("--max-shard-size", default="5GB", help="Hugging Face shard size (default 5GB)")
    s.add_argument(
        "--progress", action="store_true", help="progress on stderr (default: when a terminal)"
    )


def _add_diff(sub) -> None:
    s = _command(
        sub,
        "diff",
        diff_command,
        help="compare two checkpoints tensor by tensor, across formats",
        description="Per-tensor largest absolute difference between A and B (any formats), "
        "and the names only one holds. Exit 0 when equal within --atol, 1 otherwise.",
    )
    s.add_argument("a", help="checkpoint directory, .safetensors file or URL")
    s.add_argument("b", help="checkpoint directory, .safetensors file or URL")
    s.add_argument("--atol", default="0", help="allowed absolute difference (default 0: exact)")
    s.add_argument("--json", action="store_true", help="machine-readable output")


def _add_verify(sub) -> None:
    s = _command(sub, "verify", verify_command, help="re-read every shard: checksums and coverage")
    s.add_argument("path", help="checkpoint directory or URL")


def _add_ls(sub) -> None:
    s = _command(
        sub,
        "ls",
        ls_command,
        help="list the step-* checkpoints under a root, committed or not, with sizes",
    )
    s.add_argument("root", help="directory or URL holding step-* checkpoint directories")
    s.add_argument("--json", action="store_true", help="machine-readable output")


def _add_gc(sub) -> None:
    s = _command(
        sub,
        "gc",
        gc_command,
        help="remove debris: uncommitted steps older than the newest committed step",
        description="Remove uncommitted step-* directories older than the newest committed step. "
        "Newer uncommitted steps may be saves in progress and are left alone, unless "
        "--stale-after is given: then those in which nothing was written for that long go "
        "too (a killed job's), as do data files of committed steps that neither their manifest "
        "nor any other step names and that are as old (a checkpoint replaced in place by a job "
        "killed before its cleanup).",
    )
    s.add_argument("root", help="directory or URL holding step-* checkpoint directories")
    s.add_argument(
        "--dry-run", action="store_true", help="print what would be removed, remove nothing"
    )
    s.add_argument(
        "--stale-after",
        type=seconds,
        metavar="SECONDS",
        help="also remove uncommitted steps newer than the newest commit (or in a root with no "
        "commit) in which nothing was written for SECONDS; take SECONDS above the longest save "
        "(on an object store a file appears when its upload ends, dated from its start)",
    )


def _add_plugins(sub) -> None:
    """The commands other packages add (`anyshard.cli.plugins`): they parse their own options."""
    for name, ep in sorted(plugin_commands().items()):
        if name not in sub.choices:
            c = sub.add_parser(name, help=summary(ep.module), add_help=False)
            c.add_argument("args", nargs=argparse.REMAINDER)
            c.set_defaults(run=lambda args, ep=ep: ep.load()(args.args))


def _add_ucl(sub) -> None:
    s = sub.add_parser(
        "ucl",
        help="check and explain UCL specs",
        description="Check a UCL spec (a .ucl file or the name of a shipped spec), or explain "
        "where a tensor lives under a layout.",
    )
    ucl_sub = s.add_subparsers(dest="ucl_command", required=True)
    c = _command(
        ucl_sub,
        "check",
        ucl_check,
        examples="ucl check",
        help="parse and check a spec; with --layout, compile it for every rank and check that "
        "every logical tensor is saved exactly once",
    )
    c.add_argument("file", help="a .ucl file or a shipped spec name")
    c.add_argument("--layout", help="mesh sizes and params, e.g. tp=2,pp=2,hidden=64")
    c = _command(
        ucl_sub,
        "explain",
        ucl_explain,
        examples="ucl explain",
        help="which rank holds which region of a tensor, as a small text diagram",
    )
    c.add_argument("file", help="a .ucl file or a shipped spec name")
    c.add_argument("--layout", required=True, help="mesh sizes and params, e.g. tp=2,hidden=64")
    c.add_argument("name", help="a logical tensor name, or a local tensor name")
