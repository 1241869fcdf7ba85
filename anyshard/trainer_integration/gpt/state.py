"""What a rank trains: the model, AdamW and data of a layout (`build_training`), and
`TrainState`, the one Stateful a checkpoint saves and a resume or relayout restores."""

from __future__ import annotations

from typing import Any

import torch

from anyshard._compat import local_tensor, module_members
from anyshard.trainer_integration.gpt.config import Config
from anyshard.trainer_integration.gpt.data import DataLoader, load_corpus
from anyshard.trainer_integration.gpt.parallel import (
    TrainStep,
    build,
    forget_older_placements,
    make_optimizer,
    setup_mesh,
)

_EMBEDDING, _OUTPUT = "tok_embeddings.weight", "output.weight"


def _renamed(sd: dict[str, Any], old: str, new: str, *, only: bool = False) -> dict[str, Any]:
    """``sd`` with parameter ``old`` named ``new`` in the ``state.{fqn}.*`` and
    ``param_groups.{fqn}.*`` keys of a flattened optimizer state dict (``only``: just those
    entries)."""
    out = {}
    for k, v in sd.items():
        for head in ("state.", "param_groups."):
            if k.startswith(head + old + "."):
                out[head + new + k[len(head + old) :]] = v
                break
        else:
            if not only:
                out[k] = v
    return out


class TrainState:
    """Everything a resume needs, as one Stateful: model, AdamW, data position, RNG, step."""

    def __init__(self, model, optimizer, loader: DataLoader):
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.step = 0
        self._cache: tuple | None = None  # of `_get_state_dict`
        self._walk: list | None = None  # of `_holdings`

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=True)

    def _tied(self) -> bool:
        """Whether this rank's embedding and output are one parameter (tied, one stage)."""
        m = self.model
        cfg = getattr(m, "cfg", None)
        return bool(cfg and cfg.tie_embeddings) and None not in (m.output, m.tok_embeddings)

    def _holdings(self) -> tuple[list[Any], list[Any]]:
        """What a state dict's tensors are, as objects to compare by identity (every parameter,
        buffer and optimizer state tensor, and every module's children: the modules walked last
        time are the model's while those stay the same) and values to compare by equality (the
        storage each parameter and buffer holds, the names of each group's hyperparameters).
        Both stay the same while training only updates the tensors in place."""
        if self._walk is None:  # the modules, walked once (`modules()` builds every name)
            self._walk = list(self.model.modules())
        objects: list[Any] = []
        children: list[Any] = []  # a submodule added, removed or replaced: walked anew
        for m in self._walk:
            modules, parameters, buffers = module_members(m)
            children += modules.values()
            objects += parameters.values()
            objects += buffers.values()
        values: list[Any] = [local_tensor(t).data_ptr() for t in objects if t is not None]
        objects += children
        for st in self.optimizer.state.values():
            objects += st.values()
        values += (tuple(g) for g in self.optimizer.param_groups)
        return objects, values

    def _get_state_dict(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """DCP's ``get_state_dict``, remembered while the tensors it returns stay the same ones
        (`_holdings`), with the optimizer's hyperparameters read anew (those whose value changed
        are written into the remembered dict): a save then costs its caller a fraction of a
        millisecond instead of DCP's walk over the model (milliseconds per call, on the
        training thread)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        objects, values = self._holdings()
        cached = self._cache
        if (
            cached is not None
            and cached[1] == values
            and len(cached[0]) == len(objects)
            and all(a is b for a, b in zip(cached[0], objects, strict=True))
        ):
            model_sd, optim_sd, pairs = cached[2:]
            groups = self.optimizer.param_groups
            for (g, h), names in pairs.items():  # kept up to date in place: a few change
                v = groups[g][h]
                if optim_sd[names[0]] is not v:
                    for k in names:
                        optim_sd[k] = v
            return model_sd.copy(), optim_sd.copy()
        forget_older_placements()  # its detached tensors must be on this model's meshes
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._options())
        # taken after DCP's call, which makes the state of an optimizer that has none
        self._walk = None
        objects, values = self._holdings()
        # (group, name) -> its param_groups.{fqn}.{name} entries, each fqn's group found
        # through its state tensors
        group_of = {
            id(p): i for i, g in enumerate(self.optimizer.param_groups) for p in g["params"]
        }
        owner = {id(v): id(p) for p, st in self.optimizer.state.items() for v in st.values()}
        fqn_group = {}
        for k, v in optim_sd.items():
            if k.startswith("state.") and id(v) in owner:
                fqn_group[k[len("state.") : k.rindex(".")]] = group_of.get(owner[id(v)])
        pairs: dict[tuple[int, str], list[str]] = {}
        for k in optim_sd:
            if k.startswith("param_groups."):
                fqn, name = k[len("param_groups.") : k.rindex(".")], k[k.rindex(".") + 1 :]
                if fqn_group.get(fqn) is None:  # no state to tell its group by: not cached
                    self._cache = None
                    return model_sd, optim_sd
                pairs.setdefault((fqn_group[fqn], name), []).append(k)
        for (g, h), names in pairs.items():  # the group's own values, as later on
            for k in names:
                optim_sd[k] = self.optimizer.param_groups[g][h]
        self._cache = (objects, values, model_sd, optim_sd, pairs)
        return dict(model_sd), dict(optim_sd)

    def prime(self) -> None:
        """Take the state dict once before training, so that neither the first save nor a heal
        pays for DCP's walk over the model and optimizer (milliseconds) inside the training
        loop: `state_dict` remembers it (see `_get_state_dict`).

        An AdamW that has not stepped yet gets its state now: DCP makes it with one step of
        lr 0 and zero gradients, which leaves parameters and moments as they were, and the step
        counts go back to 0, so the first step computes exactly what it would have. Other
        optimizers are left without state (for them, DCP's step would be a real one)."""
        if not self.optimizer.state and not isinstance(
            self.optimizer, (torch.optim.Adam, torch.optim.AdamW)
        ):
            return
        fresh = not self.optimizer.state
        self.state_dict()
        if fresh:
            for st in self.optimizer.state.values():
                if isinstance(st.get("step"), torch.Tensor):
                    st["step"].zero_()

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = self._get_state_dict()
        if self._tied():
            # tied weights are saved under both names, model and optimizer state alike, as a
            # pipeline's first and last stages hold them: checkpoints of either kind of
            # layout load into the other
            optim_sd = {**optim_sd, **_renamed(optim_sd, _EMBEDDING, _OUTPUT, only=True)}
        return {
            "model": model_sd,
            "optim": optim_sd,
            "data": self.loader.state_dict(),
            "rng": torch.get_rng_state(),
            "step": self.step,
        }

    def _filled_in_place(self, sd: dict[str, Any]) -> bool:
        """Whether ``sd`` is this state's own state dict, its tensors filled in place (as a heal
        fills it): the same names, and under each the very tensor `state_dict` returns now."""
        if self._cache is None:
            return False
        mine = self.state_dict()
        if self._cache is None:  # taken anew, and not remembered: not the tensors of ``sd``
            return False
        for part in ("model", "optim"):
            theirs, ours = sd.get(part), mine[part]
            if not isinstance(theirs, dict) or theirs.keys() != ours.keys():
                return False
            for k, v in ours.items():
                if isinstance(v, torch.Tensor) and theirs[k] is not v:
                    return False
        return True

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        if self._filled_in_place(sd):
            # the model's and the optimizer's tensors already hold the values: only the
            # hyperparameters are left (DCP's load would copy every tensor onto itself)
            groups = self.optimizer.param_groups
            for (g, name), names in self._cache[4].items():
                groups[g][name] = sd["optim"][names[-1]]  # the last of its entries, as DCP's
        else:
            model_sd, optim_sd = sd["model"], sd["optim"]
            if self._tied():
                alias = _renamed(optim_sd, _EMBEDDING, _OUTPUT, only=True)
                optim_sd = {k: v for k, v in optim_sd.items() if k not in alias}
            set_state_dict(
                self.model,
                self.optimizer,
                model_state_dict=model_sd,
                optim_state_dict=optim_sd,
                options=self._options(),
            )
        self.loader.load_state_dict(sd["data"])
        torch.set_rng_state(sd["rng"])
        self.step = int(sd["step"])


def build_training(cfg: Config):
    """This rank's mesh, model part, AdamW and `TrainStep` for ``cfg`` (no checkpoint, no data)."""
    par = setup_mesh(cfg.parallel)
    model, experts = build(cfg.model, par, cfg.train.seed)
    t = cfg.train
    optimizer = make_optimizer(model, t.lr, (t.beta1, t.beta2), t.weight_decay)
    step_fn = TrainStep(
        model,
        par,
        optimizer,
        experts,
        grad_clip=t.grad_clip,
        microbatches=cfg.parallel.microbatches,
        schedule=cfg.parallel.pp_schedule,
    )
    return par, model, optimizer, step_fn


def _loader(cfg: Config, par) -> DataLoader:
    """This rank's data: under FT-HSDP each replica group takes its own share of every step's
    global batch (`ReplicaGroup.data_share` adjusts it to the groups of each step's quorum)."""
    t = cfg.train
    groups, group = cfg.ft.replicas, cfg.ft.replica
    return DataLoader(
        load_corpus(),
        seq_len=t.seq_len,
        global_batch=t.global_batch,
        dp_rank=group * par.data_size + par.data_rank,
        dp_size=groups * par.data_size,
        seed=t.seed,
    )
