"""What megatron's optimizer wrappers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``,
``DistributedOptimizer``) see of their torch optimizer under ``--optimizer-cpu-offload``:
:class:`OffloadedTorchOptimizer`, stepped by ``hyper_adaptor.memory.OffloadOptimizer``; and the helpers
the other optimizer modules of this package share (hyper-parameters, local tensors, by-order state).

:class:`OffloadedTorchOptimizer` has the same ``param_groups`` as the torch optimizer it replaces
(megatron's parameters: fp32 main copies or their shards, DTensor shards under HSDP), ``state`` keyed by
them, ``state_dict`` / ``load_state_dict`` in torch's format. The step is ``OffloadOptimizer``'s: the
chosen parameters' state and fp32 master weights live on the host, the step runs there and the result is
copied back. ``state`` is a live view of the engine's two tiers, so megatron's checkpoint code reads and
writes the host tensors in place. Where megatron's bf16 / fp16 optimizer keeps fp32 main copies, those of
the offloaded share are released and the engine steps the model parameters (``model_params``; the
megatron side of that is ``main_copies.py``).
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from hyper_adaptor.memory.optimizer_offload import OffloadOptimizer, choose_offloaded, run_closure

_NOT_HYPERPARAMETERS = ("params", "offload")
# HybridDeviceOptimizer's own arguments (in every group, as megatron's class puts them) and the apex / TE
# style Adam arguments megatron's factory passes it: none of them is a torch optimizer's hyper-parameter
_HYBRID_ONLY = ("offload_fraction", "cpu_optimizer_cls", "gpu_optimizer_cls", "param_update_in_fp32", "pin_cpu_grads",
                "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d", "bias_correction", "fused")


def hyperparameters(group: dict) -> dict:
    """A megatron parameter group's hyper-parameters, for the engine's torch optimizers."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS and k not in _HYBRID_ONLY}


def hyperparameters_to(engine: OffloadOptimizer, groups: list) -> None:
    """megatron's scheduler writes lr / weight_decay into its groups: into the engine's before a step."""
    for group, engine_group in zip(groups, engine.param_groups):
        engine_group.update(hyperparameters(group))


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``param``'s values: a DTensor's local shard (HSDP), else itself."""
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param


def _alias(param: torch.Tensor) -> torch.Tensor:
    """What the engine steps for ``param``: a detached alias of the same storage. The distributed
    optimizer's shards are views of the parameters with autograd history, which a torch optimizer
    refuses at construction (megatron assigns them to ``param_groups`` afterwards); the alias is a
    leaf, and a write into it is a write into the parameter."""
    return local_tensor(param).detach()


class _TierState(dict):
    """One parameter's optimizer state on its tier: tensors written into it (by megatron's
    ``init_state_fn``, checkpoint loading, HSDP's DTensor conversion) are kept as local tensors on
    the tier's device, so a state tensor megatron allocates next to the parameter lands on the host."""

    def __init__(self, device: torch.device, *args):
        super().__init__(*args)
        self.device = device

    def __setitem__(self, key, value):
        super().__setitem__(key, _on_tier(key, value, self.device))


def _on_tier(key, value, device):
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        if key == "step":
            return value.detach().clone()  # one counter per parameter (torch's Adam steps it in place)
        if value.device != device:
            return value.detach().to(device)
    return value


class _StateView(MutableMapping):
    """``param -> state`` over the engine's tiers, keyed by megatron's parameters."""

    def __init__(self, owner: OffloadedTorchOptimizer):
        self.owner = owner

    def _tier(self, param):
        local = self.owner.locals[param]
        engine = self.owner.engine
        master = engine.masters.get(local)
        if master is not None:
            return engine.host_optimizer, master
        return engine.device_optimizer, local

    def __getitem__(self, param):
        if param not in self.owner.locals:
            raise KeyError(param)
        optimizer, key = self._tier(param)
        entry = optimizer.state.get(key)
        if not isinstance(entry, _TierState):
            entry = _TierState(key.device, entry or {})
            optimizer.state[key] = entry
        return entry

    def __setitem__(self, param, value):
        entry = self[param]
        entry.clear()
        for k, v in dict(value).items():
            entry[k] = v

    def __delitem__(self, param):
        self[param].clear()

    def __iter__(self):
        return (p for p in self.owner.locals if self._has_state(p))

    def __len__(self):
        return sum(1 for p in self.owner.locals if self._has_state(p))

    def __contains__(self, param):
        return param in self.owner.locals and self._has_state(param)

    def _has_state(self, param) -> bool:
        optimizer, key = self._tier(param)
        return bool(optimizer.state.get(key))


class OffloadedTorchOptimizer(torch.optim.Optimizer):
    """The torch optimizer inside a megatron optimizer wrapper, stepped by ``OffloadOptimizer``.

    ``param_groups`` are megatron's groups (its parameters and group keys: ``lr``, ``wd_mult``,
    ``max_lr``, ...), so the LR scheduler and the wrapper's bookkeeping work on them as before; they
    are copied into the engine's groups at every step. Being a ``torch.optim.Optimizer``, its ``step``
    runs torch's global step hooks with these parameters (HSDP marks its shards changed from one)."""

    def __init__(self, inner: torch.optim.Optimizer, optimizer_class: type, *, offload_fraction: float = 1.0,
                 pin_memory: bool | None = None, model_params: dict | None = None):
        # megatron's groups as they are (the distributed optimizer's shards are non-leaf views, which
        # torch's add_param_group refuses; megatron itself assigns them after construction)
        super().__init__([{"params": []}], inner.defaults)
        self.param_groups = inner.param_groups
        aliases = {p: _alias(p) for group in self.param_groups for p in group["params"]}
        chosen = choose_offloaded([{"params": [aliases[p] for p in g["params"]]} for g in self.param_groups],
                                  offload_fraction)
        # fp32 main copies (megatron's Float16OptimizerWithFloat16Params) of offloaded parameters: the
        # engine's host master takes their place, so the engine steps the half-precision model parameter
        # itself (its gradient: the main copy's, as ``decoupled_grad``) and the copy's device storage is
        # released below — ``hosted`` maps each such main copy to its model parameter
        self.hosted = {p: model for p, model in (model_params or {}).items() if aliases.get(p) in chosen}
        self.locals = {p: _alias(self.hosted[p]) if p in self.hosted else aliases[p] for p in aliases}
        offloaded = {self.locals[p] for p in aliases if aliases[p] in chosen}
        self._hosted_locals = {self.locals[main] for main in self.hosted}
        self.engine = OffloadOptimizer(
            [{**hyperparameters(group), "params": [self.locals[p] for p in group["params"]]}
             for group in self.param_groups],
            optimizer_class, offload_fn=lambda q, _group: q in offloaded, pin_memory=pin_memory,
            grad_attr="decoupled_grad" if self.hosted else "grad")
        for main in model_params or {}:
            if main not in self.hosted and local_tensor(main).untyped_storage().nbytes() == 0:
                raise RuntimeError(f"--optimizer-cpu-offload: the fp32 main copy of a parameter of shape "
                                   f"{tuple(main.shape)} was released as made, but the engine steps it on the "
                                   f"device (megatron's optimizer holds other parameters than the factory's "
                                   f"param_groups)")
        for main in self.hosted:
            # released as megatron made it (releasing_main_copies_as_made), else here; the master was made
            # from the model parameter, of which the copy is an fp32 clone — the same values
            local_tensor(main).untyped_storage().resize_(0)
        self._hosted_views: dict = {}  # main copy -> its master as megatron's checkpoint code sees it
        carried = {p: dict(s) for p, s in inner.state.items() if s}
        self.state = _StateView(self)
        for param, state in carried.items():
            self.state[param] = state

    def host_master(self, main: torch.Tensor) -> torch.Tensor:
        """The engine's host master in place of the released main copy ``main``, shaped as megatron's
        checkpoint code expects it (a DTensor laid out like ``main`` under HSDP; it shares the master's
        storage, so a checkpoint loaded into it lands in the master)."""
        view = self._hosted_views.get(main)
        if view is None:
            from torch.distributed.tensor import DTensor

            view = self.engine.masters[self.locals[main]]
            if isinstance(main, DTensor):
                view = DTensor.from_local(view, main.device_mesh, main.placements, run_check=False,
                                          shape=main.shape, stride=main.stride())
            self._hosted_views[main] = view
        return view

    def offloaded_share(self) -> float:
        """The share of this optimizer's parameter elements whose state and master live on the host."""
        return self.engine.offloaded_share()

    def state_bytes(self) -> dict:
        """The engine's accounting: bytes of optimizer state on the ``device`` and the ``host`` tier."""
        return self.engine.state_bytes()

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        hyperparameters_to(self.engine, self.param_groups)
        for param, local in self.locals.items():
            model = self.hosted.get(param, param)
            if local_tensor(model).data_ptr() != local.data_ptr():
                raise RuntimeError(f"--optimizer-cpu-offload: a parameter of shape {tuple(param.shape)} was moved to "
                                   f"other storage after the optimizer was built (its offloaded copy would no "
                                   f"longer reach it)")
            grad = None if param.grad is None else local_tensor(param.grad)
            if param in self.hosted:
                local.decoupled_grad = grad
            else:
                local.grad = grad
        # The masters take the parameters' current values first: megatron writes its fp32 main
        # parameters outside the optimizer (checkpoint load, reload_model_params, the distributed
        # optimizer's state loading), through ``.data``, which no version counter shows. An fp32
        # copy of an fp32 tensor, so the step is exactly megatron's. (A released main copy's master is
        # written where megatron would write the copy: the Float16OptimizerWithFloat16Params wraps.)
        for local, master in self.engine.masters.items():
            if local not in self._hosted_locals:
                master.copy_(local, non_blocking=True)
        self.engine.step()
        for local in self._hosted_locals:
            local.decoupled_grad = None  # no reference to the gradient past the step
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        self.engine.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """torch's format over megatron's parameters; the state tensors are the host ones (not copied)."""
        state_dict = super().state_dict()
        state_dict["state"] = {index: dict(state) for index, state in state_dict["state"].items()}
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format, matched to the live parameters by order (as torch does); state tensors are
        placed on their parameter's tier (host for offloaded ones), never staged on the device."""
        for param, saved in saved_state_by_param(self.param_groups, state_dict):
            self.state[param] = saved or {}


def saved_state_by_param(param_groups: list, state_dict: dict) -> list:
    """A torch-format ``state_dict`` matched to the live parameters by order, as torch matches it:
    (parameter, its saved state or None) pairs; each group takes its saved settings (lr, ...)."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups) or any(
            len(saved["params"]) != len(group["params"]) for group, saved in zip(param_groups, saved_groups)):
        raise ValueError("--optimizer-cpu-offload: the optimizer state was saved for other parameter groups")
    pairs = []
    for group, saved in zip(param_groups, saved_groups):
        group.update({k: v for k, v in saved.items() if k != "params"})
        pairs += [(param, state_dict["state"].get(index)) for param, index in zip(group["params"], saved["params"])]
    return pairs
