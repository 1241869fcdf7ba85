"""`anyshard convert`, `diff` and `inspect` on Hugging Face checkpoints, run as a user runs them:
stdout, stderr and exit codes, through the console script's function in this process
(tests/cli_runner.py), and the installed console script in a subprocess for `--help`.

Run: python -m pytest tests/e2e/test_cli_convert.py -q
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from cli_runner import cli
from safetensors.torch import save_file

import anyshard

LAYOUT = "tp=2,hidden=8,heads=2,kv_heads=1,ffn=12,vocab=10,layers=1"


def run(*args: str) -> subprocess.CompletedProcess:
    return cli(*args)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and out.stderr.strip().count("\n") == 0, out.stderr
    return out.stderr


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A small Llama-shaped Hugging Face checkpoint, as safetensors writes it."""
    d = tmp_path_factory.mktemp("hf")
    g = torch.Generator().manual_seed(0)
    shapes = {
        "model.embed_tokens.weight": (10, 8),
        "model.norm.weight": (8,),
        "lm_head.weight": (10, 8),
        "model.layers.0.input_layernorm.weight": (8,),
        "model.layers.0.post_attention_layernorm.weight": (8,),
        "model.layers.0.self_attn.q_proj.weight": (8, 8),
        "model.layers.0.self_attn.k_proj.weight": (4, 8),
        "model.layers.0.self_attn.v_proj.weight": (4, 8),
        "model.layers.0.self_attn.o_proj.weight": (8, 8),
        "model.layers.0.mlp.gate_proj.weight": (12, 8),
        "model.layers.0.mlp.up_proj.weight": (12, 8),
        "model.layers.0.mlp.down_proj.weight": (8, 12),
    }
    tensors = {k: torch.randn(s, generator=g) for k, s in shapes.items()}
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_hf_to_anyshard_under_tp2_and_back_is_byte_identical_and_diff_agrees(hf, tmp_path):
    ck, back = str(tmp_path / "ck"), str(tmp_path / "back")
    out = run("convert", str(hf), ck, "--spec", "hf_llama", "--layout", LAYOUT, "--progress")
    assert out.returncode == 0, out.stderr
    assert "wrote 12 tensors" in out.stdout and "as anyshard in 2 file(s)" in out.stdout
    assert "convert: tensor 20/20" in out.stderr  # 12 logical tensors are 20 local ones
    assert run("verify", ck).returncode == 0
    out = run("convert", ck, back)  # the default target of an anyshard source: hf
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "back" / "model.safetensors").read_bytes() == (
        hf / "model.safetensors"
    ).read_bytes()
    out = run("diff", str(hf), ck)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "equal within atol 0: 12 tensors compared, 0 differ" in out.stdout


def test_diff_of_different_checkpoints_exits_1_and_names_what_differs(hf, tmp_path):
    view = anyshard.open(str(hf))
    tensors = {k: view.get_tensor(k) for k in view.keys() if k != "lm_head.weight"}
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 0.5
    tensors["extra"] = torch.zeros(2)
    anyshard.save(str(tmp_path / "other"), tensors)
    out = run("diff", str(hf), str(tmp_path / "other"))
    assert out.returncode == 1, out.stderr
    assert "only in A: lm_head.weight" in out.stdout and "only in B: extra" in out.stdout
    assert "DIFFERS  model.norm.weight: max abs diff 0.5" in out.stdout
    out = run("diff", str(hf), str(tmp_path / "other"), "--atol", "1", "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 1 and report["only_a"] == ["lm_head.weight"]  # names still differ
    assert all(t["equal"] for t in report["tensors"])


def test_convert_to_hf_casts_filters_renames_and_shards(hf, tmp_path):
    dst = tmp_path / "bf16"
    out = run(
        "convert",
        str(hf),
        str(dst),
        "--to",
        "hf",
        "--dtype",
        "bf16",
        "--only",
        r"^model\.",
        "--rename",
        r"^model\.=m.",
        "--max-shard-size",
        "500B",
    )
    assert out.returncode == 0, out.stderr
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert "m.norm.weight" in index["weight_map"] and "lm_head.weight" not in index["weight_map"]
    out = run("inspect", str(dst))
    assert out.returncode == 0, out.stderr
    assert "format huggingface-safetensors" in out.stdout and "bfloat16" in out.stdout
    data = json.loads(run("inspect", str(dst), "--json").stdout)
    assert data["format"] == "huggingface-safetensors" and len(data["tensors"]) == 11


@pytest.mark.parametrize("command", ["convert", "diff"])
def test_help_shows_examples(command):
    out = subprocess.run(
        ["anyshard", command, "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "examples:" in out.stdout and f"anyshard {command}" in out.stdout


@pytest.mark.parametrize(
    "args, expect",
    [
        (["convert", "{tmp}/missing", "{tmp}/out"], "no such checkpoint"),
        (["convert", "{hf}", "{tmp}/out", "--spec", "hf_llama", "--layout", "tp=two"], "NAME=INT"),
        (["convert", "{hf}", "{tmp}/out", "--dtype", "fp7"], "unknown dtype 'fp7'"),
        (["convert", "{hf}", "{tmp}/out", "--layout", "tp=2"], "--layout needs --spec"),
        (["convert", "{hf}", "{tmp}/out", "--max-shard-size", "lots"], "is not a size"),
        (["convert", "{hf}", "{tmp}/out", "--only", "("], "not a regular expression"),
        (["convert", "{hf}", "{tmp}/out", "--spec", "no_such_spec"], "not a shipped spec"),
        (["diff", "{hf}", "{tmp}/missing"], "no such checkpoint"),
        (["diff", "{hf}", "{hf}", "--atol", "-1"], "--atol"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(hf, tmp_path, args, expect):
    args = [a.format(tmp=tmp_path, hf=hf) for a in args]
    assert expect in one_line_error(run(*args))
    assert not (tmp_path / "out").exists()


FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures"


@pytest.mark.parametrize(
    "path,fmt,name",
    [
        ("deepspeed/zero3", "deepspeed-zero", "fc1.weight"),
        ("deepspeed/universal", "deepspeed-universal", "fc1.weight"),
        ("megatron_torch_dist/tp2", "megatron-torch-dist", "embedding.word_embeddings.weight"),
    ],
)
def test_inspect_reads_other_libraries_checkpoints(path, fmt, name):
    out = run("inspect", str(FIXTURES / path))
    assert out.returncode == 0, out.stderr
    assert f"format {fmt}" in out.stdout and name in out.stdout
    data = json.loads(run("inspect", str(FIXTURES / path), "--json").stdout)
    assert data["format"] == fmt and name in {t["name"] for t in data["tensors"]}


def test_inspect_dcp_torch_save_and_zarr(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3, 4)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    torch.save({"w": torch.ones(3, 4)}, tmp_path / "m.pt")
    assert (
        run("convert", str(tmp_path / "dcp"), str(tmp_path / "z.zarr"), "--to", "zarr").returncode
        == 0
    )
    for path, fmt in (("dcp", "pytorch-dcp"), ("m.pt", "torch-save"), ("z.zarr", "zarr")):
        out = run("inspect", str(tmp_path / path))
        assert out.returncode == 0, out.stderr
        assert f"format {fmt}" in out.stdout and "[3, 4]" in out.stdout


def test_a_real_deepspeed_checkpoint_converts_to_dcp_that_dcp_loads(tmp_path):
    """DeepSpeed ZeRO-2 (written by DeepSpeed itself) -> `anyshard convert --to dcp` ->
    torch.distributed.checkpoint.load: the engine's own fp32 parameters and Adam moments."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    truth = load_file(str(FIXTURES / "deepspeed" / "zero2" / "truth.safetensors"))
    out = run(
        "convert", str(FIXTURES / "deepspeed" / "zero2"), str(tmp_path / "dcp"), "--to", "dcp"
    )
    assert out.returncode == 0, out.stderr
    state = {k: torch.zeros_like(v) for k, v in truth.items()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for k, v in truth.items():
        assert torch.equal(state[k], v), k
