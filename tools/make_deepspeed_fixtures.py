"""Write the DeepSpeed checkpoints the loader tests read, with real DeepSpeed on CPU.

Run (needs ``deepspeed``; the tests that read the result do not):

    DS_BUILD_OPS=0 pip install deepspeed
    DS_ACCELERATOR=cpu python tools/make_deepspeed_fixtures.py [OUT]   # OUT: tests/fixtures/deepspeed

A tiny model (an embedding and two linear layers, sizes chosen so that ZeRO pads) is trained for
three steps of ``torch.optim.Adam`` with two parameter groups by ``deepspeed.initialize`` on two
CPU processes (gloo), under each of:

- ``zero1``: ZeRO stage 1, bf16 (optimizer files named ``bf16_zero_pp_rank_*``);
- ``zero2``: ZeRO stage 2, fp32;
- ``zero3``: ZeRO stage 3, bf16;

and saved with ``engine.save_checkpoint(OUT/<name>, tag="global_step3")``. Each directory also
gets ``truth.safetensors``: every parameter's fp32 master copy and Adam ``exp_avg`` /
``exp_avg_sq``, as ``P``, ``P.exp_avg``, ``P.exp_avg_sq``, gathered from the live engine with
``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` in the same
run (not read back from the files). ``universal`` and ``universal_zero3`` are DeepSpeed's
``ds_to_universal`` run on ``zero2`` and ``zero3`` (with ``--inject_missing_state``), with the
same truth. The ``zero_to_fp32.py`` / ``zero_to_torch.py`` scripts DeepSpeed copies next to a
checkpoint are removed: they are code, not checkpoint.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

RUNS = {"zero1": (1, True), "zero2": (2, False), "zero3": (3, True)}
UNIVERSAL = {"universal": "zero2", "universal_zero3": "zero3"}
TAG = "global_step3"
WORLD_SIZE = 2


def _model():
    import torch
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(11, 6)
            self.fc1 = nn.Linear(6, 10)
            self.fc2 = nn.Linear(10, 3)

        def forward(self, ids):
            return self.fc2(torch.relu(self.fc1(self.embed(ids)))).float().pow(2).mean()

    return Tiny()


def _train_and_save(rank: int, out: str, name: str, port: int) -> None:
    import torch

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
    )
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    stage, bf16 = RUNS[name]
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = _model()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.Adam(
        [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}],
        lr=1e-2,
    )
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": bf16},
        "steps_per_print": 10**6,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        loss = engine(torch.randint(0, 11, (2, 5), generator=g))
        engine.backward(loss)
        engine.step()
    root = os.path.join(out, name)
    engine.save_checkpoint(root, tag=TAG)
    zero = engine.optimizer
    if getattr(zero, "_hp_optimizer_states_linked", False):
        # DeepSpeed links every group's Adam state to the parameters after the first group's
        # first step, before the later groups have any state; link again now that all have.
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()
    truth = {}
    for pname, p in engine.module.named_parameters():  # collective: every rank takes part
        truth[pname] = safe_get_full_fp32_param(p).detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            truth[f"{pname}.{key}"] = safe_get_full_optimizer_state(p, key).detach().clone()
    if rank == 0:
        from safetensors.torch import save_file

        meta = {
            "deepspeed": deepspeed.__version__,
            "torch": torch.__version__,
            "zero_stage": str(stage),
            "bf16": str(bf16),
            "world_size": str(WORLD_SIZE),
        }
        save_file(
            {k: v.contiguous() for k, v in truth.items()},
            os.path.join(root, "truth.safetensors"),
            metadata=meta,
        )
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            if os.path.exists(os.path.join(root, script)):
                os.remove(os.path.join(root, script))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _to_universal(out: str, name: str, source: str) -> None:
    dst = os.path.join(out, name)
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        os.path.join(out, source, TAG),
        "--output_folder",
        os.path.join(dst, f"{TAG}_universal"),
        "--num_extract_workers",
        "1",
        "--num_merge_workers",
        "1",
        "--inject_missing_state",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    shutil.copy(os.path.join(out, source, "truth.safetensors"), dst)


def main(argv: list[str]) -> int:
    import torch.multiprocessing as mp

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    here = os.path.dirname(os.path.abspath(__file__))
    out = argv[0] if argv else os.path.join(here, "..", "tests", "fixtures", "deepspeed")
    out = os.path.abspath(out)
    for name in (*RUNS, *UNIVERSAL):
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    for name in RUNS:
        mp.spawn(_train_and_save, args=(out, name, _free_port()), nprocs=WORLD_SIZE)
    for name, source in UNIVERSAL.items():
        _to_universal(out, name, source)
    total = 0
    for dirpath, _, files in sorted(os.walk(out)):
        for f in sorted(files):
            path = os.path.join(dirpath, f)
            total += os.path.getsize(path)
            print(f"{os.path.getsize(path):8d}  {os.path.relpath(path, out)}")
    print(f"{total:8d}  bytes in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
