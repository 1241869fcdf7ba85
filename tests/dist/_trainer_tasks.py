"""Task functions for the trainer's resume and elasticity tests: run the training loop on the
pool's ranks with a configuration, return this call's global losses."""

from __future__ import annotations

from anyshard.trainer_integration.gpt.config import TINY_CONFIG, load_config
from anyshard.trainer_integration.gpt.train import run


def train(overrides: list[str]) -> list[float]:
    return run(load_config(TINY_CONFIG, overrides))


def train_with_slow_staging(overrides: list[str], delay_s: float) -> list[float]:
    """`train`, with every staging copy of an async save starting ``delay_s`` late: an optimizer
    step that did not wait for the copy would change what the save holds."""
    import time

    from anyshard.api import async_save

    stage = async_save.stage

    def slow(*args, **kwargs):
        time.sleep(delay_s)
        return stage(*args, **kwargs)

    async_save.stage = slow
    try:
        return train(overrides)
    finally:
        async_save.stage = stage


def cached_state_dicts(overrides: list[str], steps: int) -> int:
    """Train ``steps`` steps with the learning rate changing every step, and check after each
    that `TrainState.state_dict` (remembered between calls) equals DCP's ``get_state_dict``
    taken anew: the same keys, the same hyperparameters, tensors over the same storage and
    equal. Then give the optimizer new state tensors (a load does) and check it again.
    Returns how many state dicts were compared."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from anyshard.trainer_integration.gpt.state import TrainState, _loader, build_training

    cfg = load_config(TINY_CONFIG, overrides)
    par, model, optimizer, step_fn = build_training(cfg)
    state = TrainState(model, optimizer, _loader(cfg, par))
    compared = 0

    def check() -> None:
        nonlocal compared
        mine = state.state_dict()
        model_sd, optim_sd = get_state_dict(model, optimizer, options=state._options())
        fresh = {"model": model_sd, "optim": optim_sd}
        for part in ("model", "optim"):
            if state._tied() and part == "optim":
                assert set(fresh[part]) <= set(mine[part])
            else:
                assert mine[part].keys() == fresh[part].keys(), part
            for k, v in fresh[part].items():
                got = mine[part][k]
                if isinstance(v, torch.Tensor):
                    local = v.to_local() if hasattr(v, "to_local") else v
                    mine_local = got.to_local() if hasattr(got, "to_local") else got
                    assert mine_local.data_ptr() == local.data_ptr(), k
                    assert torch.equal(mine_local, local), k
                else:
                    assert got == v, (k, got, v)
        compared += 1

    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 1e-3 / (step + 1)
        inputs, targets = state.loader.next_batch()
        step_fn(inputs, targets)
        check()
    # its own state dict, filled in place (as a heal fills it), loads by setting only the
    # hyperparameters: the tensors stay the same objects; a copy loads through DCP
    sd = state.state_dict()
    held = [id(v) for st in optimizer.state.values() for v in st.values()]
    for k in sd["optim"]:
        if k.startswith("param_groups.") and k.endswith(".lr"):
            sd["optim"][k] = 0.5
    assert state._filled_in_place(sd)
    state.load_state_dict(sd)
    assert all(g["lr"] == 0.5 for g in optimizer.param_groups)
    assert [id(v) for st in optimizer.state.values() for v in st.values()] == held
    check()
    clones = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd["model"].items()}
    assert not state._filled_in_place({**sd, "model": clones})
    # new state tensors, as a load that replaces them leaves: remembered ones must not be used
    for st in optimizer.state.values():
        for name, v in list(st.items()):
            st[name] = v.clone()
    check()
    for group in optimizer.param_groups:  # a hyperparameter other than the learning rate
        group["weight_decay"] = 0.25
    check()
    # a submodule added since the state dict was remembered: its buffer is in the state dict
    model.add_module("probe", torch.nn.Module())
    model.probe.register_buffer("seen", torch.arange(2.0))
    check()
    assert "probe.seen" in state.state_dict()["model"]
    return compared


def primed_state_trains_as_fresh(overrides: list[str], steps: int) -> list[float]:
    """Build the same model and AdamW twice; prime one (`TrainState.prime`: its state dict is
    taken and remembered before the first step), then train both ``steps`` steps on the same
    batches. Parameters, optimizer states and losses must be bit-identical, and the primed
    state's dict still the one remembered before training. Returns the primed run's losses."""
    import torch

    from anyshard.trainer_integration.gpt.state import TrainState, _loader, build_training

    cfg = load_config(TINY_CONFIG, overrides)
    states, step_fns = [], []
    for _ in range(2):
        torch.manual_seed(cfg.train.seed)
        par, model, optimizer, step_fn = build_training(cfg)
        states.append(TrainState(model, optimizer, _loader(cfg, par)))
        step_fns.append(step_fn)
    primed, fresh = states
    primed.prime()
    remembered = primed._cache
    assert remembered is not None and primed.optimizer.state and not fresh.optimizer.state
    losses = []
    for _ in range(steps):
        got = []
        for state, step_fn in zip(states, step_fns, strict=True):
            inputs, targets = state.loader.next_batch()
            got.append(step_fn(inputs, targets))
        assert got[0] == got[1], got
        losses.append(got[0])

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    for a, b in zip(primed.model.parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(local(a), local(b))
    ours, theirs = primed.optimizer.state, fresh.optimizer.state
    assert len(ours) == len(theirs) > 0
    for p, q in zip(primed.model.parameters(), fresh.model.parameters(), strict=True):
        assert ours[p].keys() == theirs[q].keys()
        for k in ours[p]:
            assert torch.equal(local(ours[p][k]), local(theirs[q][k])), k
    primed.state_dict()
    assert primed._cache is remembered  # no walk over the model after training began
    return losses


def save_after_another_hierarchy(root: str) -> list[str]:
    """Train a step under tp=2 x cp=2, then build tied pp=2 x tp=2 in the same processes (their
    tp slices are equal meshes of two hierarchies), train a step and save it. Returns the
    saved tensor names (the save refuses a state described under the wrong root)."""
    import torch

    import anyshard
    from anyshard.trainer_integration.checkpointer import Checkpointer
    from anyshard.trainer_integration.gpt.state import TrainState, _loader, build_training

    for overrides in (
        ["--parallel.tp", "2", "--parallel.cp", "2"],
        ["--parallel.pp", "2", "--parallel.tp", "2", "--parallel.pp_schedule", "GPipe"]
        + ["--model.tie_embeddings", "true"],
    ):
        cfg = load_config(TINY_CONFIG, overrides)
        torch.manual_seed(cfg.train.seed)  # as `run` does: the saved RNG state is replicated
        par, model, optimizer, step_fn = build_training(cfg)
        state = TrainState(model, optimizer, _loader(cfg, par))
        step_fn(*state.loader.next_batch())
        state.step += 1
    Checkpointer(root).save(1, {"train": state})
    with anyshard.open(Checkpointer(root).step_path(1)) as view:
        return sorted(view.keys())


def peer_wait(late_s: float) -> float:
    """The cost model's wait for a peer: rank 1's bursts run ``late_s`` longer than rank 0's,
    so each of rank 0's all-reduces waits about that long for it."""
    import time

    import torch.distributed as dist

    from anyshard.trainer_integration.gpt.layout_chooser.measure import peer_wait_s as _peer_wait_s

    rank = dist.get_rank()

    def burst() -> None:
        time.sleep(0.005 + (late_s if rank == 1 else 0.0))

    return _peer_wait_s(burst, dist.group.WORLD, n=4, pairs=3)
