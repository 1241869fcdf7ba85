"""Megatron-Core 0.16 training on the ranks of a pool (gloo, CPU): a tiny GPTModel under tensor
parallelism, checkpointed through Megatron's ``dist_checkpointing`` with anyshard's strategies
(`anyshard.dcp.megatron`) and with Megatron's own ``torch_dist`` format, resumed, and resumed
under another layout (tensor parallel 2 -> pipeline parallel 2).

Megatron-Core assumes CUDA in a few places that have nothing to do on a CPU; the shims below
stand in for them, here in the test and only for the task's duration:

- ``torch.cuda.synchronize()`` (``torch_dist``'s writer waits on its copies to the CPU) and
  ``torch.cuda.current_device()`` (its writer broadcasts its failure flag from a tensor there;
  tensor-parallel layers allocate there): no-ops / the CPU.
- the pool's workers are daemon processes, and the torch_dist writer starts a multiprocessing
  manager for its results, which a daemon may not: the flag is lifted for the task, and the
  manager collected after it.
- attention forks Megatron's CUDA RNG tracker around its dropout (0 here, so no random number is
  drawn): the fork is a no-op.
- `FP32Optimizer` keeps its loss scale, 1.0, in a CUDA tensor: `_CPUFP32Optimizer` keeps it on
  the CPU.
- Megatron's pipeline schedules allocate on ``"cuda"``: the pipeline-parallel run sends the
  activations and their gradients itself (one micro-batch: forward on stage 0, send, forward,
  loss and backward on stage 1, send the gradient back, backward on stage 0).
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist

SEQ, BATCH, VOCAB, HIDDEN, HEADS, FFN, LAYERS, LR = 8, 2, 64, 16, 4, 32, 2, 1e-2


@contextlib.contextmanager
def _cpu_shims():
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.tensor_parallel import random as mrandom

    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    mrandom.initialize_rng_tracker()
    tracker = mrandom.get_cuda_rng_tracker()
    tracker.fork = lambda *args, **kwargs: contextlib.nullcontext()
    me = multiprocessing.current_process()
    daemon = me._config.get("daemon")
    me._config["daemon"] = False  # the pool's workers are daemons; torch_dist starts a manager
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved
        del tracker.fork
        me._config["daemon"] = daemon
        filesystem_async._results_queue = None  # its manager process ends when collected
        gc.collect()


def forget_megatron_safe_globals() -> None:
    """Importing megatron.core registers classes (io.BytesIO, argparse.Namespace, numpy arrays...)
    as safe for ``torch.load(weights_only=True)`` in the whole process: dropped again, so that
    the tests that run after these in the same process see torch's own list."""
    from megatron.core.safe_globals import SAFE_GLOBALS

    ours = {id(g) for g in SAFE_GLOBALS}
    rest = [g for g in torch.serialization.get_safe_globals() if id(g) not in ours]
    torch.serialization.clear_safe_globals()
    torch.serialization.add_safe_globals(rest)


def _imports():
    warnings.filterwarnings("ignore", module="megatron")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer
    from megatron.core.transformer import TransformerConfig

    return (
        parallel_state,
        GPTModel,
        get_gpt_layer_local_spec,
        OptimizerConfig,
        FP32Optimizer,
        MegatronOptimizer,
        TransformerConfig,
    )


def _build(tp: int, pp: int, seed: int):
    """Megatron's model-parallel groups for (tp, pp) on the pool's 2 ranks; a GPTModel (this
    rank's stage and tensor shard; CPU initialisation: the same full weights under any layout)
    and an Adam optimizer in Megatron's FP32Optimizer."""
    ps, GPTModel, layer_spec, OptimizerConfig, FP32Optimizer, MegatronOptimizer, TC = _imports()

    class _CPUFP32Optimizer(FP32Optimizer):
        def __init__(self, optimizer, config, init_state_fn):
            MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
            self._scale = torch.tensor([1.0])
            self.is_stub_optimizer = optimizer is None

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    config = TC(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        perform_initialization=True,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
    )
    torch.manual_seed(seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=False,
    )
    # the group keys Megatron's optimizers match param groups by when loading
    group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
    adam = torch.optim.Adam([{"params": list(model.parameters()), **group}], lr=LR)

    def init_state(opt, _config=None):  # Megatron's: zero moments, so that the state has keys
        for group in opt.param_groups:
            for p in group["params"]:
                if len(opt.state[p]) == 0:
                    opt.state[p]["step"] = torch.tensor(0.0)
                    opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                    opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)

    opt = _CPUFP32Optimizer(adam, OptimizerConfig(lr=LR, clip_grad=0.0), init_state)
    return ps, model, opt


def _batch(step: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    position_ids = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    return tokens[:, :-1].contiguous(), position_ids, mask, tokens[:, 1:].contiguous()


def _step(ps, model, opt, step: int) -> float:
    """One training step; the loss (the mean over tokens) as every rank has it."""
    ids, pos, mask, labels = _batch(step)
    opt.zero_grad()
    if ps.get_pipeline_model_parallel_world_size() == 1:
        loss = model(ids, pos, mask, labels=labels).float().mean()
        loss.backward()
    else:  # 2 stages, one micro-batch, the activations and their gradient sent by hand
        shape = (SEQ, BATCH, HIDDEN)
        if ps.is_pipeline_first_stage():
            out = model(ids, pos, mask)
            dist.send(out.detach().contiguous(), 1)
            grad = torch.empty(shape)
            dist.recv(grad, 1)
            out.backward(grad)
            loss = torch.empty(())
        else:
            act = torch.empty(shape)
            dist.recv(act, 0)
            act.requires_grad_(True)
            model.set_input_tensor(act)
            loss = model(None, pos, mask, labels=labels).float().mean()
            loss.backward()
            dist.send(act.grad.contiguous(), 0)
        dist.broadcast(loss, src=1)
    opt.step()
    return float(loss.detach())


def _sharded(model, opt, step: int, *, loading: bool = False) -> dict:
    from megatron.core.dist_checkpointing import ShardedObject

    rank, world = dist.get_rank(), dist.get_world_size()
    model_sd = model.sharded_state_dict()
    return {
        "model": model_sd,
        "optimizer": opt.sharded_state_dict(model_sd, is_loading=loading),
        "iteration": step,
        "opt_param_scheduler": {"max_lr": LR, "num_steps": step, "decay_style": "constant"},
        "params_dtype": torch.float32,
        # a ShardedObject per rank, with a tensor inside (Megatron-LM keeps its RNG states so)
        "rng_state": ShardedObject(
            "rng_state",
            {"seed": 1234 + rank, "torch": torch.get_rng_state(), "calls": (rank, step)},
            (world,),
            (rank,),
            replica_id=0,
        ),
    }


def _full_weights(ps, model) -> dict[str, torch.Tensor]:
    """The model's parameters, whole: tensor-parallel shards gathered along their partition dim;
    with pipeline stages, each stage's named by the global layer number."""
    out = {}
    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * (
        LAYERS // ps.get_pipeline_model_parallel_world_size()
    )
    for name, p in model.named_parameters():
        t = p.detach()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t.contiguous(), group=tp_group)
            t = torch.cat(parts, dim=p.partition_dim)
        if name.startswith("decoder.layers."):
            rest = name.split(".")
            rest[2] = str(int(rest[2]) + offset)
            name = ".".join(rest)
        out[name] = t.clone()
    return out


def _resume(tp: int, pp: int, path: str, first: int, last: int) -> tuple[dict, list[float], dict]:
    from megatron.core import dist_checkpointing

    ps, model, opt = _build(tp, pp, seed=99)  # other initial weights: the load must set them all
    sd = _sharded(model, opt, first - 1, loading=True)
    state = dist_checkpointing.load(sd, path)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    restored = _full_weights(ps, model)
    losses = [_step(ps, model, opt, s) for s in range(first, last + 1)]
    extras = {
        "iteration": state["iteration"],
        "opt_param_scheduler": state["opt_param_scheduler"],
        "params_dtype": str(state["params_dtype"]),
        "rng_state": state["rng_state"],
    }
    return restored, losses, extras


def run(root: str, steps: int = 4, saved_at: int = 2) -> dict[str, Any]:
    """Train ``steps`` steps under tp=2, saving after ``saved_at`` through anyshard (with and
    without Megatron's common.pt) and through Megatron's torch_dist; resume each under tp=2, and
    anyshard's under tp=1 x pp=2. Returns what the test compares, rank by rank."""
    try:
        return _run(root, steps, saved_at)
    finally:
        forget_megatron_safe_globals()


def _run(root: str, steps: int, saved_at: int) -> dict[str, Any]:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import (
        get_default_save_common_strategy,
        load_sharded_metadata,
    )

    import anyshard.dcp.megatron as anyshard_megatron
    from anyshard.errors import AnyshardError

    torch.manual_seed(0)
    out: dict[str, Any] = {}
    paths = {k: os.path.join(root, k) for k in ("anyshard", "anyshard_common_pt", "torch_dist")}
    with _cpu_shims():
        ps, model, opt = _build(2, 1, seed=1)
        losses = []
        for s in range(1, steps + 1):
            losses.append(_step(ps, model, opt, s))
            if s == saved_at:
                out["weights"] = _full_weights(ps, model)
                if dist.get_rank() == 0:
                    for p in paths.values():
                        os.makedirs(p)
                dist.barrier()
                anyshard_megatron.save(_sharded(model, opt, s), paths["anyshard"])
                dist_checkpointing.save(
                    _sharded(model, opt, s),
                    paths["anyshard_common_pt"],
                    sharded_strategy=anyshard_megatron.AnyshardSaveStrategy(),
                )
                dist_checkpointing.save(
                    _sharded(model, opt, s), paths["torch_dist"], sharded_strategy=("torch_dist", 1)
                )
        out["losses"] = losses
        out["sharded_metadata"] = {
            kind: {
                k: (type(v).__name__, tuple(v.global_shape), str(getattr(v, "dtype", "")))
                for k, v in load_sharded_metadata(paths[kind]).items()
            }
            for kind in ("anyshard", "torch_dist")
        }
        # a value anyshard cannot store: refused on every rank, naming it; nothing committed
        bad = os.path.join(root, "refused")
        if dist.get_rank() == 0:
            os.makedirs(bad)
        dist.barrier()
        sd = _sharded(model, opt, steps)
        sd["opt_param_scheduler"]["hook"] = object()
        try:
            anyshard_megatron.save(sd, bad)
        except AnyshardError as e:
            out["refused"] = str(e)
        out["refused_files"] = sorted(os.listdir(bad))
        out["common_default_after"] = type(get_default_save_common_strategy()).__name__
        for kind in paths:
            restored, resumed, extras = _resume(2, 1, paths[kind], saved_at + 1, steps)
            out[kind] = {"restored": restored, "losses": resumed, **extras}
        restored, resumed, extras = _resume(1, 2, paths["anyshard"], saved_at + 1, steps)
        out["tp1_pp2"] = {"restored": restored, "losses": resumed, **extras}
        ps.destroy_model_parallel()
    out["files"] = {k: sorted(os.listdir(p)) for k, p in paths.items()}
    return out
