"""Megatron's precision-aware CPU-offload path (``--use-distributed-optimizer
--use-precision-aware-optimizer`` with ``--bf16`` / ``--fp16``), its ``HybridDeviceOptimizer`` replaced by
:class:`OffloadedHybridOptimizer` (the ``HYBRID`` patch of ``optimizer.py``).

Megatron's factory builds that class and its distributed optimizer hands it the half-precision parameter
shards and their fp32 gradients as ``decoupled_grad``; the distributed optimizer then creates no fp32 main
shards on the device (its optimizer holds the fp32 masters: ours keeps the offloaded share's on the host)
and leaves copying the update back to the optimizer. So of the 4 bytes per element of fp32 main weights a
half-precision run keeps beside its parameters, the offloaded share stays on the host only.
"""

from __future__ import annotations

import torch

from hyper_adaptor.memory.optimizer_offload import OffloadOptimizer, run_closure
from hyper_adaptor.patches.memory.torch_optimizer import hyperparameters, hyperparameters_to, saved_state_by_param


class OffloadedHybridOptimizer(torch.optim.Optimizer):
    """What megatron's distributed optimizer sees of its ``HybridDeviceOptimizer`` (the CUDA-stream
    optimizer of ``--optimizer-cpu-offload``), stepped by ``OffloadOptimizer`` on any device.

    Megatron's interface, as its distributed optimizer uses it: built with the factory's arguments (all
    kept in ``defaults``: the distributed optimizer builds a second one from them over its shards);
    parameters are the half-precision (or fp32) shards, gradients their fp32 ``decoupled_grad``;
    ``step`` writes the updated shards; ``state[param]`` holds the optimizer state tensors and
    ``"master_param"`` (the fp32 master) — megatron's checkpoint code reads them and writes them (into
    the engine's tensors: :class:`_WriteThrough`), and calls ``_sync_hdo_state_to_sub_optimizers`` on
    some load paths; ``dummy_step`` creates state before a checkpoint is
    loaded into it; ``update_fp32_param_by_new_param`` re-reads the masters from the parameters;
    ``sub_optimizers`` are the torch optimizers (megatron reads their step count).

    The engine is built at first use: megatron constructs this class once over the whole model and
    throws it away when its distributed optimizer builds the one over its shards.
    """

    def __init__(self, params, offload_fraction=0.5, cpu_optimizer_cls=None, gpu_optimizer_cls=None,
                 param_update_in_fp32: bool = False, pin_cpu_grads: bool = True, pin_cpu_params: bool = True,
                 overlap_cpu_optimizer_d2h_h2d: bool = True, **kwargs):
        defaults = dict(offload_fraction=offload_fraction, cpu_optimizer_cls=cpu_optimizer_cls,
                        gpu_optimizer_cls=gpu_optimizer_cls, param_update_in_fp32=param_update_in_fp32,
                        pin_cpu_grads=pin_cpu_grads, pin_cpu_params=pin_cpu_params,
                        overlap_cpu_optimizer_d2h_h2d=overlap_cpu_optimizer_d2h_h2d, **kwargs)
        super().__init__(params, defaults)
        self.engine: OffloadOptimizer | None = None
        self._state_shown = False  # ``state`` holds every parameter's engine state (after a first step)

    def _optimizer_class(self) -> type:
        cls = self.defaults.get("cpu_optimizer_cls")
        if (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)
                and cls.__module__.startswith("torch.optim")):
            return cls
        return torch.optim.AdamW  # (megatron's factory passes torch's AdamW / SGD)

    def _engine(self) -> OffloadOptimizer:
        if self.engine is None:
            pin = None if self.defaults.get("pin_cpu_params", True) else False
            self.engine = OffloadOptimizer(
                [{**hyperparameters(group), "params": list(group["params"])} for group in self.param_groups],
                self._optimizer_class(), offload_fraction=self.defaults["offload_fraction"], pin_memory=pin,
                grad_attr="decoupled_grad", device_masters=True)
        return self.engine

    # -- what megatron calls -------------------------------------------------------------------------
    @property
    def sub_optimizers(self) -> list:
        engine = self._engine()
        return [o for o in (engine.host_optimizer, engine.device_optimizer) if o is not None]

    def offloaded_share(self) -> float:
        return self._engine().offloaded_share()

    def state_bytes(self) -> dict:
        return self._engine().state_bytes()

    def _master(self, param: torch.Tensor) -> torch.Tensor:
        engine = self._engine()
        return engine.masters.get(param, engine.device_masters.get(param, param))

    def _tier(self, param: torch.Tensor):
        engine = self._engine()
        master = engine.masters.get(param)
        if master is not None:
            return engine.host_optimizer, master
        return engine.device_optimizer, engine.device_masters.get(param, param)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        engine = self._engine()
        hyperparameters_to(engine, self.param_groups)
        engine.step()
        if not self._state_shown:  # torch's optimizers update their state tensors in place from now on
            self._sync_sub_optimizers_state_to_hdo()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                grad = getattr(p, "decoupled_grad", None)
                if grad is not None:
                    if set_to_none:
                        p.decoupled_grad = None
                    else:
                        grad.zero_()
        if self.engine is not None:
            self.engine.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def dummy_step(self) -> None:
        """State for every parameter as before a first step (zeros, step 0) and nothing else changed: a
        step at learning rate 0 with zero gradients creates it, then it is zeroed. Megatron calls this
        before loading a checkpoint into an optimizer that has not stepped."""
        for optimizer in self.sub_optimizers:
            if any(optimizer.state.values()):
                continue
            lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = 0.0
                for q in group["params"]:
                    q.grad = torch.zeros_like(q)
            optimizer.step()
            for group, lr in zip(optimizer.param_groups, lrs):
                group["lr"] = lr
                for q in group["params"]:
                    q.grad = None
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        value.zero_()
        self._sync_sub_optimizers_state_to_hdo()

    def update_fp32_param_by_new_param(self) -> None:
        """The masters take the parameters' values (megatron's ``reload_model_params``)."""
        self._engine().refresh_masters()

    def _sync_sub_optimizers_state_to_hdo(self) -> None:
        """``state[param]``: the engine's state tensors themselves (not copies) and the fp32 master, in a
        dict that writes what megatron sets into them (:class:`_WriteThrough`)."""
        shown = True
        for group in self.param_groups:
            for p in group["params"]:
                optimizer, key = self._tier(p)
                inner = optimizer.state.get(key)
                if inner:
                    self.state[p] = _WriteThrough(self, p, {**inner, "master_param": self._master(p)})
                else:
                    shown = False
        self._state_shown = shown

    def _sync_hdo_state_to_sub_optimizers(self) -> None:
        """Entries megatron put into ``state`` as whole dicts go into the engine's tensors (single
        tensors set into an entry already did, on the way in); then ``state`` shows the engine's."""
        for p, values in list(self.state.items()):
            for k, v in list(values.items()):
                self._write(p, k, v)
        self._sync_sub_optimizers_state_to_hdo()

    def _write(self, p: torch.Tensor, k: str, v):
        """Put ``v`` as state ``k`` of ``p`` into the engine (copied into the engine's tensor of that
        name, on its tier, where there is one); returns what the entry now holds."""
        if k == "master_param":
            target = self._master(p)
            if v is not target:
                target.copy_(v)
            return target
        optimizer, key = self._tier(p)
        inner = optimizer.state.setdefault(key, {})
        current = inner.get(k)
        if not isinstance(v, torch.Tensor):
            inner[k] = v
        elif isinstance(current, torch.Tensor) and current.shape == v.shape:
            if v is not current:
                current.copy_(v)
        else:
            inner[k] = v.detach().to(key.device if k != "step" else v.device, copy=True)
        return inner[k]

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format, matched to the parameters by order (as torch does); tensors go into the engine
        on their tier (fp32, host for the offloaded share) rather than cast to the parameter's dtype."""
        for param, saved in saved_state_by_param(self.param_groups, state_dict):
            if saved is not None:
                self.state[param] = dict(saved)
        self._sync_hdo_state_to_sub_optimizers()


class _WriteThrough(dict):
    """``OffloadedHybridOptimizer.state[param]``: the engine's own tensors. A tensor megatron sets into it
    (a checkpoint's, by its distributed optimizer's load paths, some of which never call
    ``_sync_hdo_state_to_sub_optimizers``) is copied into the engine's tensor, which stays the entry —
    so nothing has to be compared or synced at each step."""

    def __init__(self, owner: OffloadedHybridOptimizer, param: torch.Tensor, entries: dict):
        super().__init__(entries)
        self.owner, self.param = owner, param

    def __setitem__(self, key, value):
        super().__setitem__(key, self.owner._write(self.param, key, value))
