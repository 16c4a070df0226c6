"""Optimizer offload: optimizer state and fp32 master weights in host memory, the step run on the host.

``OffloadOptimizer(params, torch.optim.Adam, offload_fraction=1.0, lr=...)`` wraps any
``torch.optim.Optimizer`` class. Each chosen parameter gets a host master copy (fp32, or the parameter's
dtype when that is wider), its gradient is copied to the host, the wrapped optimizer steps on the master
(so its state — Adam's moments — is created on the host and never on the device), and the updated master
is copied back into the parameter. Parameters that are not chosen are stepped on the device by a second
instance of the same optimizer class. Which parameters, in this order of precedence:

* a parameter group's ``"offload": True/False`` key;
* ``offload_fn(param, group) -> bool``;
* ``offload_fraction`` f in [0, 1]: parameters in order, while the offloaded element count is below f of
  the total (megatron's ``--optimizer-offload-fraction``; 1.0 offloads all, 0.0 none).

Parameters are plain tensors / ``nn.Parameter`` on any device (HSDP's local shards are): nothing here
assumes a device type. Hyper-parameters (``lr``, ``weight_decay``, ...) are read from this optimizer's
``param_groups`` at every step, so LR schedulers work on it as on any optimizer.

Half-precision parameters whose gradient arrives in fp32 beside them (megatron's precision-aware path:
bf16 parameter shards, fp32 ``decoupled_grad``): ``grad_attr="decoupled_grad"`` reads each gradient from
that attribute (``.grad`` where it is unset), and ``device_masters=True`` gives the device-stepped ones an
fp32 master on the device as well (the offloaded ones always have theirs on the host), so every step runs
in fp32 and the parameter receives the rounded result — the arithmetic of megatron's fp32 main parameters,
with the fp32 copies of the offloaded share on the host only.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from hyper_adaptor import platform


def _check_fraction(fraction) -> float:
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"OffloadOptimizer: offload_fraction must be a number in [0, 1] (the share of parameter "
                         f"elements whose optimizer state lives on the host); got {fraction!r}")
    return float(fraction)


def run_closure(closure):
    """torch's optimizer ``closure`` convention: the loss it returns, computed with grad enabled (None
    without a closure)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def choose_offloaded(param_groups: list, fraction: float, offload_fn=None) -> set:
    """The parameters an ``OffloadOptimizer`` over ``param_groups`` steps on the host (the rule in the
    module docstring: a group's ``"offload"`` key, else ``offload_fn``, else ``fraction`` of the elements
    in order). Public so a caller can learn the split before it builds the optimizer."""
    fraction = _check_fraction(fraction)
    chosen, total = set(), sum(p.numel() for g in param_groups for p in g["params"])
    budget, taken = fraction * total, 0
    for group in param_groups:
        for p in group["params"]:
            if "offload" in group:
                pick = bool(group["offload"])
            elif offload_fn is not None:
                pick = bool(offload_fn(p, group))
            else:
                pick = fraction >= 1.0 or taken < budget
                taken += p.numel() if pick else 0
            if pick:
                chosen.add(p)
    return chosen


class _StateByParameter(Mapping):
    """``optimizer.state[param]`` for the model's parameters: a device-stepped parameter's state from the
    device optimizer, an offloaded one's from the host optimizer (keyed there by its master)."""

    def __init__(self, owner: OffloadOptimizer) -> None:
        self.owner = owner

    def _inner(self, p):
        master = self.owner.masters.get(p)
        if master is not None:
            return self.owner.host_optimizer.state, master
        return (self.owner.device_optimizer.state if self.owner.device_optimizer is not None else {}), p

    def __getitem__(self, p):
        state, key = self._inner(p)
        if key not in state:
            raise KeyError(p)
        return state[key]

    def __iter__(self):
        for group in self.owner.param_groups:
            for p in group["params"]:
                state, key = self._inner(p)
                if key in state:
                    yield p

    def __len__(self) -> int:
        return sum(1 for _ in self)


class OffloadOptimizer(torch.optim.Optimizer):
    def __init__(self, params, optimizer_class=torch.optim.Adam, *, offload_fraction: float = 1.0,
                 offload_fn=None, pin_memory: bool | None = None, grad_attr: str = "grad",
                 device_masters: bool = False, **defaults) -> None:
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"OffloadOptimizer: optimizer_class must be a torch.optim.Optimizer subclass, got "
                            f"{optimizer_class!r}")
        fraction = _check_fraction(offload_fraction)
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self.grad_attr = grad_attr
        self.pin_memory = platform.pin_memory_available() if pin_memory is None else pin_memory
        for p in (p for g in self.param_groups for p in g["params"]):
            if type(p) not in (torch.Tensor, torch.nn.Parameter):
                raise TypeError(f"OffloadOptimizer: parameters must be plain tensors or nn.Parameter (pass a "
                                f"sharded parameter's local shard); got {type(p).__name__}")

        chosen = choose_offloaded(self.param_groups, fraction, offload_fn)
        self.masters: dict[torch.Tensor, torch.Tensor] = {}
        # fp32 masters of half-precision device-stepped parameters (``device_masters=True``), on their device
        self.device_masters: dict[torch.Tensor, torch.Tensor] = {}
        device_groups, host_groups = [], []
        self._group_links = []   # (this group, its device-optimizer group index, its host-optimizer group index)
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k not in ("params", "offload")}
            on_device = [self._device_master(p) if device_masters else p for p in group["params"] if p not in chosen]
            on_host = [self._master(p) for p in group["params"] if p in chosen]
            d = h = None
            if on_device:
                d = len(device_groups)
                device_groups.append({"params": on_device, **hyper})
            if on_host:
                h = len(host_groups)
                host_groups.append({"params": on_host, **hyper})
            self._group_links.append((group, d, h))
        self.device_optimizer = optimizer_class(device_groups) if device_groups else None
        self.host_optimizer = optimizer_class(host_groups) if host_groups else None
        # device-stepped parameters stepped as they are (no master), whose gradient ``grad_attr`` names
        self._stepped_as_they_are = [] if grad_attr == "grad" else [
            p for group in self.param_groups for p in group["params"]
            if p not in chosen and p not in self.device_masters]

    def _master(self, p: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(p.dtype, torch.float32)
        master = torch.empty(p.shape, dtype=dtype, device="cpu", pin_memory=self.pin_memory)
        master.copy_(p.detach())
        self.masters[p] = master
        return master

    def _device_master(self, p: torch.Tensor) -> torch.Tensor:
        if torch.promote_types(p.dtype, torch.float32) == p.dtype:
            return p  # fp32 or wider: stepped as it is
        master = p.detach().to(torch.float32, copy=True)
        self.device_masters[p] = master
        return master

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """``p``'s gradient: its ``grad_attr`` attribute where set, else ``.grad``."""
        if self.grad_attr != "grad":
            grad = getattr(p, self.grad_attr, None)
            if grad is not None:
                return grad
        return p.grad

    @property
    def state(self) -> Mapping:
        return _StateByParameter(self)

    @state.setter
    def state(self, value) -> None:
        # torch.optim.Optimizer.__init__ assigns an empty state; it lives in the two inner optimizers instead
        if value:
            raise ValueError("OffloadOptimizer.state is a view of the device and host optimizers' state")

    @property
    def offloaded_params(self) -> list[torch.Tensor]:
        return list(self.masters)

    def offloaded_share(self) -> float:
        """The share of the parameter elements whose state and master live on the host."""
        total = sum(p.numel() for group in self.param_groups for p in group["params"])
        return sum(p.numel() for p in self.masters) / total if total else 0.0

    def _sync_hyperparameters(self) -> None:
        for group, d, h in self._group_links:
            hyper = {k: v for k, v in group.items() if k not in ("params", "offload")}
            if d is not None:
                self.device_optimizer.param_groups[d].update(hyper)
            if h is not None:
                self.host_optimizer.param_groups[h].update(hyper)

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        self._sync_hyperparameters()
        for p, master in self.masters.items():
            grad = self.grad_of(p)
            if grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty(master.shape, dtype=master.dtype, device="cpu", pin_memory=self.pin_memory)
            master.grad.copy_(grad, non_blocking=True)
        for p, master in self.device_masters.items():
            grad = self.grad_of(p)
            master.grad = None if grad is None else grad.to(master.dtype)
        for p in self._stepped_as_they_are:  # the gradient beside them, where the device optimizer reads it
            grad = self.grad_of(p)
            if grad is not None and grad is not p.grad:
                p.grad = grad
        if self.masters and platform.copies_are_async(self._device_type()):
            platform.synchronize()  # the gradients are on the host before the host step reads them
        if self.device_optimizer is not None:
            self.device_optimizer.step()
        if self.host_optimizer is not None:
            self.host_optimizer.step()
        for p, master in self.masters.items():
            if master.grad is not None:
                p.copy_(master, non_blocking=True)
        for p, master in self.device_masters.items():
            if master.grad is not None:
                p.copy_(master)
        # A later host step writes the masters again only after the next step's synchronize above.
        return loss

    def _device_type(self) -> str:
        first = next(iter(self.masters))
        return first.device.type

    def refresh_masters(self) -> None:
        """Every master takes its parameter's current value (after the parameters were written outside
        the optimizer: a checkpoint's model weights, megatron's ``reload_model_params``)."""
        for p, master in (*self.masters.items(), *self.device_masters.items()):
            master.copy_(p.detach())

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=set_to_none)
        for master in (*self.masters.values(), *self.device_masters.values()):
            if set_to_none:
                master.grad = None
            elif master.grad is not None:
                master.grad.zero_()

    def state_bytes(self) -> dict:
        """Bytes of optimizer state per tier: ``device`` (state of device-stepped parameters), ``host``
        (state of offloaded ones + their master weights and gradient buffers)."""
        def state_of(opt):
            if opt is None:
                return 0
            return sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor) and v.dim() > 0)
        def masters_of(masters):  # master weights and the gradient buffers they own
            total = 0
            for p, m in masters.items():
                source = self.grad_of(p)
                own_grad = m.grad is not None and not (
                    source is not None and m.grad.untyped_storage().data_ptr() == source.untyped_storage().data_ptr())
                total += m.numel() * m.element_size() * (1 + own_grad)
            return total
        return {"device": state_of(self.device_optimizer) + masters_of(self.device_masters),
                "host": state_of(self.host_optimizer) + masters_of(self.masters)}

    def state_dict(self) -> dict:
        return {
            "device": None if self.device_optimizer is None else self.device_optimizer.state_dict(),
            "host": None if self.host_optimizer is None else self.host_optimizer.state_dict(),
            "masters": [m.clone() for m in self.masters.values()],
            "device_masters": [m.clone() for m in self.device_masters.values()],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if (state_dict.get("device") is None) != (self.device_optimizer is None) or \
                (state_dict.get("host") is None) != (self.host_optimizer is None) or \
                len(state_dict.get("masters", [])) != len(self.masters):
            raise ValueError("OffloadOptimizer.load_state_dict: the state was saved with another split of "
                             "parameters between device and host (offload_fraction / offload_fn / groups)")
        if self.device_optimizer is not None:
            self.device_optimizer.load_state_dict(state_dict["device"])
        if self.host_optimizer is not None:
            self.host_optimizer.load_state_dict(state_dict["host"])
            # torch moves loaded state to each parameter's device: the masters' is the host.
        for master, saved in zip(self.masters.values(), state_dict["masters"]):
            master.copy_(saved)
        for master, saved in zip(self.device_masters.values(), state_dict.get("device_masters", [])):
            master.copy_(saved)
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
