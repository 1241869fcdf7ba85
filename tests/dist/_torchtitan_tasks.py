"""torchtitan 0.3 training on every rank of a pool of gloo ranks, on CPU: a two-layer llama3
(dim 64) on a generated tokenizer and corpus, checkpointed by torchtitan's own DCP manager or,
through ``--override.imports anyshard.dcp.torchtitan.anyshard_checkpoint``, by anyshard's.

torchtitan 0.3 assumes an accelerator; `cpu_shims` is the CPU entry point's patches (test code,
not the library's), none of them in what is saved or loaded:

- the device is the CPU (torchtitan takes ``_get_available_device_type() or "cuda"``), and the
  memory monitor reports zeros (it asks ``torch.cpu`` for CUDA's memory statistics);
- ``triton`` imports, as a stub, while torchtitan imports the one module that needs it at
  module level (a kernel llama3 never runs); torch itself goes on finding no triton;
- FlexAttention runs as dense attention with the same block-causal mask (its CPU backward
  raises), and the block mask is made eagerly;
- FSDP reduces gradients with a plain sum: torchtitan sets the divide factor to 1, for which
  FSDP would use a pre-multiplied sum that gloo does not have;
- torchtitan's timeout change after step 1 is skipped: a barrier on ``device_ids``, which
  gloo refuses, then ``dist.set_timeout``, which torch 2.13 does not have;
- the trainer's closing two-second sleep goes (time only).

The runs use ``--parallelism.spmd_backend partial_dtensor`` and no ``--debug.deterministic``
(it compiles FlexAttention again, over the dense shim); on CPU with one thread a run repeats
bit for bit anyway.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import types
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

VOCAB = 200  # words w0..w199 after the special tokens, within the model's vocabulary
MODEL_VOCAB = 256
BOS, EOS, UNK = "<|begin_of_text|>", "<|end_of_text|>", "<|unk|>"
MODULE = "_dist_task__torchtitan_tasks"  # this file, as the pool's harness imports it


def make_assets(root: str, docs: int = 400, seed: int = 0) -> tuple[str, str]:
    """A word-level tokenizer (tokenizer.json and tokenizer_config.json) and a corpus of random
    documents (one JSON line each, {"text": ...}) under ``root``: (tokenizer dir, data dir)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    vocab = {BOS: 0, EOS: 1, UNK: 2} | {f"w{i}": 3 + i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK}, f)
    g = torch.Generator().manual_seed(seed)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        for _ in range(docs):
            n = int(torch.randint(8, 40, (1,), generator=g))
            words = torch.randint(0, VOCAB, (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(f"w{w}" for w in words)}) + "\n")
    return tok_dir, data_dir


_SHIMMED = False


class _Anything:
    """Whatever a Triton kernel module asks of ``triton`` at import: decorators that return
    the function, attributes and subscripts that are this again."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __getattr__(self, name: str) -> Any:
        return self

    def __getitem__(self, key: Any) -> Any:
        return self


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # __file__, __path__: what inspect and importlib look for
            raise AttributeError(name)
        return _Anything()


@contextlib.contextmanager
def _triton_stub():
    """``triton`` and ``triton.language`` importable as stubs while the block runs, and gone
    again after it (torch itself must go on finding no triton)."""
    names = ("triton", "triton.language")
    saved = {n: sys.modules.get(n) for n in names}
    for n in names:
        sys.modules[n] = _StubModule(n)
    sys.modules["triton"].language = sys.modules["triton.language"]  # type: ignore[attr-defined]
    try:
        yield
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def cpu_shims() -> None:
    """Patch torchtitan 0.3 to train on CPU with gloo (once per process, before it is
    imported). See the module's docstring."""
    global _SHIMMED
    if _SHIMMED:
        return
    _SHIMMED = True
    torch._utils._get_available_device_type = lambda: "cpu"  # torchtitan: this or "cuda"
    importlib.import_module("torch._dynamo")  # first: torch settles that triton is absent

    with _triton_stub():  # torchtitan imports it at module level, on a path llama3 never runs
        import torchtitan.distributed.minimal_async_ep  # noqa: F401

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.fsdp as fsdp
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    import torchtitan.trainer as trainer_module
    from torch.nn.attention.flex_attention import create_mask

    def dense_flex(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, **_):
        assert score_mod is None and not return_aux.lse, "the dense shim covers llama3 only"
        b, _, lq, _ = q.shape
        mask = create_mask(block_mask.mask_mod, b, None, lq, k.shape[2], device=q.device)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        return out, None

    attention.FlexAttention._compiled_flex_attn = staticmethod(dense_flex)
    from torch.nn.attention.flex_attention import create_block_mask

    attention._compiled_create_block_mask = create_block_mask

    class CpuMemory:  # torchtitan's monitor asks torch.cpu for CUDA's memory statistics
        device_name = "cpu"

        def get_peak_stats(self) -> Any:
            return metrics.DeviceMemStats(0.0, 0.0, 0.0, 0.0, 0, 0)

        def reset_peak_stats(self) -> None:
            pass

    metrics.build_device_memory_monitor = CpuMemory
    no_division = fsdp.disable_fsdp_gradient_division

    def sum_on_gloo(model: torch.nn.Module) -> None:
        no_division(model)  # factor 1: FSDP would reduce with PREMUL_SUM, which gloo lacks
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    fsdp.disable_fsdp_gradient_division = sum_on_gloo
    # after step 1 torchtitan shortens the groups' timeouts: a barrier on device_ids, then
    # dist.set_timeout, which torch 2.13 does not have
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    trainer_module.time = types.SimpleNamespace(  # type: ignore[attr-defined]
        perf_counter=trainer_module.time.perf_counter, sleep=lambda s: None
    )


def tiny() -> Any:
    """``--config tiny``: llama3's debug model at two layers of dim 64, four heads."""
    cpu_shims()
    import torchtitan.models.llama3 as llama3
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.models.common import (
        ComplexRoPE,
        Embedding,
        Linear,
        RMSNorm,
        compute_ffn_hidden_dim,
    )
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    def _tiny(attn_backend: str, tp_gemm_backend: str = "default"):
        dim, heads = 64, 4
        return llama3.Llama3Model.Config(
            dim=dim,
            vocab_size=MODEL_VOCAB,
            tok_embeddings=Embedding.Config(
                num_embeddings=MODEL_VOCAB, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT
            ),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
            lm_head=Linear.Config(
                in_features=dim,
                out_features=MODEL_VOCAB,
                param_init=llama3._output_linear_init(dim),
            ),
            layers=llama3._build_llama3_layers(
                fuse_qkv=True,
                n_layers=2,
                dim=dim,
                n_heads=heads,
                hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=64),
                rope=ComplexRoPE.Config(
                    dim=dim // heads, max_seq_len=256, theta=500000, scaling="llama"
                ),
                attn_backend=attn_backend,
                tp_gemm_backend=tp_gemm_backend,
            ),
        )

    llama3.llama3_configs["tiny"] = _tiny
    config = llama3_debugmodel()
    config.model_spec = llama3.model_registry("tiny")
    config.loss = ChunkedLossWrapper.Config(
        loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(config.model_spec))
    )
    return config


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def args_for(
    root: str, assets: tuple[str, str], *, anyshard: bool, dp: int = 2, tp: int = 1, extra=()
) -> list[str]:
    """The command line of a run whose outputs and checkpoints go under ``root``."""
    tok_dir, data_dir = assets
    out = [
        "--module", MODULE, "--config", "tiny",
        "--dump_folder", root,
        "--hf_assets_path", tok_dir,
        "--dataloader.dataset_path", data_dir,
        "--training.seq_len", "32",
        "--training.local_batch_size", str(4 // dp),
        "--training.steps", "6",
        "--parallelism.data_parallel_shard_degree", str(dp),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--parallelism.spmd_backend", "partial_dtensor",
        "--debug.seed", "0",
        "--checkpoint.enable",
        "--checkpoint.interval", "2",
        "--metrics.log_freq", "1",
    ]  # fmt: skip
    if anyshard:
        out += ["--override.imports", "anyshard.dcp.torchtitan.anyshard_checkpoint"]
    return out + list(extra)


def train(args: list[str], stop_after: int | None = None) -> dict:
    """One torchtitan run on this rank (the CPU entry point): parse ``args`` as torchtitan's
    command line, build the trainer, train (stopping after step ``stop_after``, once its
    checkpoint is saved, as a job killed then would), close. Returns the loss of every step,
    the step it started from, the manager's class, anyshard's warnings and, after a restore, the
    model's full state dict (rank 0)."""
    cpu_shims()
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))
    os.environ.setdefault("WORLD_SIZE", str(dist.get_world_size()))
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(args)
    trainer = config.build()
    losses: dict[int, float] = {}
    restored: dict[str, torch.Tensor] = {}
    log = trainer.metrics_processor.log

    def record(step, loss, *rest, **kw):
        losses[int(step)] = float(loss)
        return log(step, loss, *rest, **kw)

    trainer.metrics_processor.log = record
    load = trainer.checkpointer.load

    def load_and_look(*a, **kw):
        done = load(*a, **kw)
        if done:
            for name, t in trainer.checkpointer.states["model"].state_dict().items():
                restored[name] = _full(t)
        return done

    trainer.checkpointer.load = load_and_look
    if stop_after is not None:
        trainer.should_continue_training = lambda: trainer.step < stop_after
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
            trainer.checkpointer.maybe_wait_for_saving()
    finally:
        trainer.close()
    first = min(losses) if losses else None
    return {
        "losses": [losses[s] for s in sorted(losses)],
        "first_step": first,
        "manager": type(trainer.checkpointer).__qualname__,
        "warnings": [str(w.message) for w in caught if "anyshard" in str(w.message)],
        "restored": restored if dist.get_rank() == 0 else {},
    }
