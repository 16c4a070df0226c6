"""Megatron's ``--optimizer-cpu-offload`` (and ``--optimizer-offload-fraction``) served by the
optimizer-offload engine (``hyper_adaptor.memory.OffloadOptimizer``) on every device.

What megatron-core 0.19.2 does: ``_get_megatron_optimizer_based_on_param_groups`` builds a
``HybridDeviceOptimizer`` (CUDA streams and events, ``torch.cuda`` calls) in place of its torch Adam,
and ``validate_args`` requires ``--use-precision-aware-optimizer``, which in turn requires the
distributed optimizer and TransformerEngine's FusedAdam (its code path is how the hybrid optimizer
gets bf16 parameter shards and ``decoupled_grad``). So the flag serves neither a CPU / NPU run, nor
megatron's plain mixed-precision optimizer, nor ``--use-hsdp``.

The seam, one wrap of that factory (:func:`serve_optimizer_cpu_offload`): with the flag, megatron
builds exactly what it builds without it (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` or
``DistributedOptimizer`` around a torch Adam/SGD, over DDP buffers or over HSDP's DTensor shards —
HSDP builds no optimizer of its own: megatron's ``get_megatron_optimizer`` runs on the HSDP-wrapped
chunks, so this one seam serves ``--use-hsdp`` too), and only the torch optimizer inside the wrapper
(``wrapper.optimizer``) is swapped for :class:`OffloadedTorchOptimizer`. Everything megatron does
around the step — gradient unscaling, clipping, the distributed optimizer's shard bookkeeping and
all-gather, checkpoints — runs unchanged on the same parameters (the bf16 optimizer's fp32 main copies:
next paragraph but one).
Why not a replacement ``HybridDeviceOptimizer`` for every case: megatron reaches it only through the
precision-aware paths of the distributed optimizer (bf16 shards, ``decoupled_grad``), so it could not
serve ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` or HSDP.

Megatron's bf16 / fp16 optimizer (``Float16OptimizerWithFloat16Params``, also HSDP's in half precision)
keeps an fp32 main copy beside each half-precision parameter. The engine's host master of an offloaded
parameter is that copy's equal, so the copy is *released* as megatron makes it (its device storage
freed, so the copies never exist all at once; the tensor stays, shapes and gradient intact, for
megatron's unscaling, clipping and norms) and the engine steps the model parameter itself, its gradient
the copy's. What megatron does with a copy's data is served by small wraps: the model<->main copies skip released pairs (``without_hosted_pairs``; the engine writes those
parameters), ``reload_model_params`` refreshes the masters, ``state_dict`` / ``load_state_dict`` see the
masters in the copies' place (so checkpoints save and load the host tensors), and the parameter's
``main_param`` (megatron.training's ``--log-params-norm``) is the master, brought to the device for the
norm. Replacing megatron's wrapper instead would fork its loss scaling, clipping and checkpoint code.

Where megatron does reach it — ``--use-distributed-optimizer --use-precision-aware-optimizer`` with
``--bf16`` / ``--fp16`` — it is replaced (the second patch), by :class:`OffloadedHybridOptimizer`, and the
factory runs as megatron wrote it: the distributed optimizer then creates no fp32 main shards on the
device (its optimizer holds the fp32 masters: ours keeps the offloaded share's on the host), hands the
optimizer the half-precision parameter shards and their fp32 gradients as ``decoupled_grad``, and leaves
copying the update back to the optimizer. So of the 4 bytes per element of fp32 main weights a
half-precision run keeps beside its parameters, the offloaded share stays on the host only.

:class:`OffloadedTorchOptimizer` is what megatron's wrappers see of a torch optimizer: the same
``param_groups`` (megatron's parameters: fp32 main copies or their shards, DTensor shards under
HSDP), ``state`` keyed by them, ``state_dict`` / ``load_state_dict`` in torch's format. The step is
``OffloadOptimizer``'s: the chosen parameters' state and fp32 master weights live on the host, the
step runs there and the result is copied back. ``state`` is a live view of the engine's two tiers, so
megatron's checkpoint code reads and writes the host tensors in place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
from collections.abc import MutableMapping

import torch

from hyper_adaptor.memory.optimizer_offload import OffloadOptimizer, choose_offloaded, run_closure
from hyper_adaptor.notice import notice
from hyper_adaptor.patch_manager import Patch

FEATURE = "memory"
FACTORY = "megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups"
HYBRID = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer.HybridDeviceOptimizer"
FLOAT16 = "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params"
PARAM_DATA = "megatron.training.utils.common_utils._get_param_data"  # what --log-params-norm reads of a parameter
# called by megatron's bf16 / fp16 optimizer right after it makes each fp32 main copy
PARAM_METADATA = "megatron.core.optimizer.optimizer.copy_optimizer_param_metadata"


def patches(args) -> list[Patch]:
    """The seams: megatron's optimizer factory, its CPU-offload optimizer class where the factory and
    the distributed optimizer name it, the four places where megatron's bf16 / fp16 optimizer touches
    the data of the fp32 main copies the offload releases, where megatron.training reads a main copy for
    ``--log-params-norm``, and where megatron has just made a copy (see the module docstring)."""
    return [Patch(FACTORY, serve_optimizer_cpu_offload, "wrap", FEATURE),
            Patch(HYBRID, OffloadedHybridOptimizer, "replace", FEATURE),
            Patch(f"{FLOAT16}._get_model_and_main_params_data_float16", without_hosted_pairs, "wrap", FEATURE),
            Patch(f"{FLOAT16}._copy_model_params_to_main_params", refreshing_hosted_masters, "wrap", FEATURE),
            Patch(f"{FLOAT16}.state_dict", state_dict_with_host_masters, "wrap", FEATURE),
            # HSDP's wrap (inner) turns the saved copies into DTensors laid out like the live ones
            Patch(f"{FLOAT16}.load_state_dict", loading_into_host_masters, "wrap", FEATURE, after=("hsdp",)),
            Patch(PARAM_DATA, main_copy_on_the_parameters_device, "wrap", FEATURE),
            Patch(PARAM_METADATA, releasing_main_copies_as_made, "wrap", FEATURE)]


# -- the seam ------------------------------------------------------------------------------------------
def serve_optimizer_cpu_offload(original):
    """Wrap of ``_get_megatron_optimizer_based_on_param_groups``: with ``config.optimizer_cpu_offload``
    megatron builds its ordinary optimizer for the config (the flag lowered in a copy of the config),
    and the torch optimizer inside the wrapper is swapped for :class:`OffloadedTorchOptimizer`."""

    @functools.wraps(original)
    def _get_megatron_optimizer_based_on_param_groups(*args, **kwargs):
        config = kwargs["config"] if "config" in kwargs else args[0]
        if not getattr(config, "optimizer_cpu_offload", False):
            return original(*args, **kwargs)
        if kwargs.get("skip_megatron_wrapping", False):
            raise ValueError("--optimizer-cpu-offload: skip_megatron_wrapping=True (layer-wise / emerging "
                             "optimizers) is not served")
        if getattr(config, "use_precision_aware_optimizer", False):
            # megatron's own path: its distributed optimizer over its CPU-offload optimizer class, which
            # the second patch made OffloadedHybridOptimizer
            optimizer = original(*args, **kwargs)
            inner = getattr(optimizer, "optimizer", None)
            if isinstance(inner, OffloadedHybridOptimizer):
                notice(f"--optimizer-cpu-offload --use-precision-aware-optimizer: megatron's "
                       f"{type(optimizer).__name__} steps through hyper_adaptor's OffloadOptimizer "
                       f"({inner.offloaded_share():.0%} of rank 0's elements with state and fp32 masters on "
                       f"the host; no fp32 main copies beside the parameters)")
            return optimizer
        plain = dataclasses.replace(config, optimizer_cpu_offload=False)
        if "config" in kwargs:
            kwargs["config"] = plain
        else:
            args = (plain, *args[1:])
        with _releasing(_copies_to_release(original, args, kwargs, config)):
            optimizer = original(*args, **kwargs)
        inner = getattr(optimizer, "optimizer", None)
        if inner is not None:
            mains = _main_copies(optimizer)
            served = OffloadedTorchOptimizer(
                inner, host_optimizer_class(inner, config), offload_fraction=config.optimizer_offload_fraction,
                pin_memory=None if getattr(config, "pin_cpu_params", True) else False, model_params=mains)
            optimizer.optimizer = served
            for main, model in served.hosted.items():
                # megatron.training's --log-params-norm reads a parameter's ``main_param``: the host master
                # (brought to the parameter's device for the norm: :func:`main_copy_on_the_parameters_device`)
                if getattr(model, "main_param", None) is main:
                    model.main_param = served.host_master(main)
            hosted = (f"; the fp32 main copies of {sum(m.numel() for m in served.hosted):,} elements live on the "
                      f"host only" if served.hosted else "")
            notice(f"--optimizer-cpu-offload: megatron's {type(optimizer).__name__} steps through "
                   f"hyper_adaptor's OffloadOptimizer ({served.offloaded_share():.0%} of rank 0's elements "
                   f"with state on the host{hosted})")
        return optimizer

    return _get_megatron_optimizer_based_on_param_groups


# model parameters whose fp32 main copies megatron's bf16 / fp16 optimizer is making right now, to be
# released as each is made (set only while the offload seam builds that optimizer)
_RELEASE: set | None = None


@contextlib.contextmanager
def _releasing(params: set):
    global _RELEASE
    _RELEASE = params
    try:
        yield
    finally:
        _RELEASE = None


def _copies_to_release(factory, args: tuple, kwargs: dict, config) -> set:
    """The model parameters of the offloaded share, where megatron will build its bf16 / fp16 optimizer
    (half precision, no distributed optimizer): the engine's split of the factory's ``param_groups`` —
    the same parameters in the same order as the optimizer it builds (:class:`OffloadedTorchOptimizer`
    makes the same choice over their main copies)."""
    if not (getattr(config, "bf16", False) or getattr(config, "fp16", False)) \
            or getattr(config, "use_distributed_optimizer", False):
        return set()
    groups = inspect.signature(factory).bind(*args, **kwargs).arguments.get("param_groups") or []
    return choose_offloaded([{"params": list(g["params"])} for g in groups], config.optimizer_offload_fraction)


def releasing_main_copies_as_made(original):
    """Wrap of megatron's ``copy_optimizer_param_metadata``, which its bf16 / fp16 optimizer calls right
    after making each fp32 main copy: a copy of the offloaded share is released there and then, so the
    copies never exist all at once (the engine's host master, made from the model parameter the copy was
    just cloned from, holds the same values). Outside the offload seam's build it only calls megatron's."""

    @functools.wraps(original)
    def copy_optimizer_param_metadata(destination, source, *args, **kwargs):
        result = original(destination, source, *args, **kwargs)
        if _RELEASE and source in _RELEASE and destination.dtype == torch.float32 and source.dtype != torch.float32:
            _source(destination).untyped_storage().resize_(0)
        return result

    return copy_optimizer_param_metadata


def _main_copies(optimizer) -> dict:
    """``{fp32 main copy: its half-precision model parameter}`` of megatron's bf16 / fp16 optimizer
    (``Float16OptimizerWithFloat16Params``; empty for the others)."""
    mains = {}
    for models, copies in zip(getattr(optimizer, "float16_groups", ()), getattr(optimizer, "fp32_from_float16_groups", ())):
        mains.update(zip(copies, models))
    return mains


def _hosted(optimizer) -> dict:
    inner = getattr(optimizer, "optimizer", None)
    return inner.hosted if isinstance(inner, OffloadedTorchOptimizer) else {}


def _with_host_masters(optimizer, groups: list) -> list:
    """``fp32_from_float16_groups``-shaped lists with each released main copy replaced by its host master."""
    inner, hosted = optimizer.optimizer, _hosted(optimizer)
    return [[inner.host_master(main) if main in hosted else main for main in group] for group in groups]


def without_hosted_pairs(original):
    """Wrap of ``_get_model_and_main_params_data_float16`` — the pairs megatron copies between model
    parameters and fp32 main copies, both ways — without the pairs whose copy was released: the engine
    writes those model parameters from the host masters in its step, and the masters from the model
    parameters in :func:`refreshing_hosted_masters`."""

    @functools.wraps(original)
    def _get_model_and_main_params_data_float16(self, *args, **kwargs):
        model_data, main_data = original(self, *args, **kwargs)
        hosted = _hosted(self)
        if not hosted:
            return model_data, main_data
        keep = [main not in hosted for group in self.fp32_from_float16_groups for main in group]
        return ([d for d, k in zip(model_data, keep) if k]), ([d for d, k in zip(main_data, keep) if k])

    return _get_model_and_main_params_data_float16


def refreshing_hosted_masters(original):
    """Wrap of ``_copy_model_params_to_main_params`` (megatron's ``reload_model_params``): the host
    masters of released copies take their model parameters' values too."""

    @functools.wraps(original)
    def _copy_model_params_to_main_params(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _hosted(self):
            self.optimizer.refresh_hosted_masters()
        return result

    return _copy_model_params_to_main_params


def state_dict_with_host_masters(original):
    """Wrap of the bf16 / fp16 optimizer's ``state_dict`` (which its ``sharded_state_dict`` calls): the
    saved fp32 main copies are the host masters where the copies were released — a checkpoint saves
    them from, and loads them into, the host."""

    @functools.wraps(original)
    def state_dict(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if _hosted(self) and "fp32_from_fp16_params" in result:
            result["fp32_from_fp16_params"] = _with_host_masters(self, result["fp32_from_fp16_params"])
        return result

    return state_dict


def loading_into_host_masters(original):
    """Wrap of the bf16 / fp16 optimizer's ``load_state_dict``: megatron copies the saved fp32 main
    copies into ``fp32_from_float16_groups``; for the call, those lists name the host masters in place
    of the released copies."""

    @functools.wraps(original)
    def load_state_dict(self, *args, **kwargs):
        if not _hosted(self):
            return original(self, *args, **kwargs)
        live = self.fp32_from_float16_groups
        self.fp32_from_float16_groups = _with_host_masters(self, live)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.fp32_from_float16_groups = live

    return load_state_dict


def main_copy_on_the_parameters_device(original):
    """Wrap of megatron.training's ``_get_param_data`` (the tensor ``--log-params-norm`` takes of a
    parameter: its fp32 ``main_param`` where it has one): a main copy that lives on the host (the engine's
    master of a released copy) is copied to the parameter's device for the norm — the same transient
    megatron's own norm takes of a parameter without a main copy (``param.data.float()``), and the norm
    megatron logs without the offload."""

    @functools.wraps(original)
    def _get_param_data(param, *args, **kwargs):
        data, is_sharded = original(param, *args, **kwargs)
        if isinstance(data, torch.Tensor) and data.device != param.device:
            data = data.to(param.device)
        return data, is_sharded

    return _get_param_data


def host_optimizer_class(inner: torch.optim.Optimizer, config) -> type:
    """The torch optimizer class that steps both tiers: megatron's own when it is torch's (so the
    offloaded step is the same arithmetic as megatron's without offload), else torch's equivalent of
    TransformerEngine's / apex's fused ones (which run only on their accelerator)."""
    cls = type(inner)
    if cls.__module__.startswith("torch.optim"):
        return cls
    if config.optimizer == "sgd":
        return torch.optim.SGD
    return torch.optim.AdamW if config.decoupled_weight_decay else torch.optim.Adam


_NOT_HYPERPARAMETERS = ("params", "offload")
# HybridDeviceOptimizer's own arguments (in every group, as megatron's class puts them) and the apex / TE
# style Adam arguments megatron's factory passes it: none of them is a torch optimizer's hyper-parameter
_HYBRID_ONLY = ("offload_fraction", "cpu_optimizer_cls", "gpu_optimizer_cls", "param_update_in_fp32", "pin_cpu_grads",
                "pin_cpu_params", "overlap_cpu_optimizer_d2h_h2d", "bias_correction", "fused")


def _hyper(group: dict) -> dict:
    """A megatron parameter group's hyper-parameters, for the engine's torch optimizers."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPERPARAMETERS and k not in _HYBRID_ONLY}


def _hyperparameters_to(engine: OffloadOptimizer, groups: list) -> None:
    """megatron's scheduler writes lr / weight_decay into its groups: into the engine's before a step."""
    for group, engine_group in zip(groups, engine.param_groups):
        engine_group.update(_hyper(group))


def _source(param: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``param``'s values: a DTensor's local shard (HSDP), else itself."""
    from torch.distributed.tensor import DTensor

    return param._local_tensor if isinstance(param, DTensor) else param


def _alias(param: torch.Tensor) -> torch.Tensor:
    """What the engine steps for ``param``: a detached alias of the same storage. The distributed
    optimizer's shards are views of the parameters with autograd history, which a torch optimizer
    refuses at construction (megatron assigns them to ``param_groups`` afterwards); the alias is a
    leaf, and a write into it is a write into the parameter."""
    return _source(param).detach()


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

    def __init__(self, owner: "OffloadedTorchOptimizer"):
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
            [{**_hyper(group), "params": [self.locals[p] for p in group["params"]]} for group in self.param_groups],
            optimizer_class, offload_fn=lambda q, _group: q in offloaded, pin_memory=pin_memory,
            grad_attr="decoupled_grad" if self.hosted else "grad")
        for main in model_params or {}:
            if main not in self.hosted and _source(main).untyped_storage().nbytes() == 0:
                raise RuntimeError(f"--optimizer-cpu-offload: the fp32 main copy of a parameter of shape "
                                   f"{tuple(main.shape)} was released as made, but the engine steps it on the "
                                   f"device (megatron's optimizer holds other parameters than the factory's "
                                   f"param_groups)")
        for main in self.hosted:
            # released as megatron made it (releasing_main_copies_as_made), else here; the master was made
            # from the model parameter, of which the copy is an fp32 clone — the same values
            _source(main).untyped_storage().resize_(0)
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

    def refresh_hosted_masters(self) -> None:
        """The host masters of released main copies take their model parameters' values (what megatron's
        ``_copy_model_params_to_main_params`` does for the main copies it still has)."""
        for main, model in self.hosted.items():
            self.engine.masters[self.locals[main]].copy_(_source(model))

    def offloaded_share(self) -> float:
        """The share of this optimizer's parameter elements whose state and master live on the host."""
        return self.engine.offloaded_share()

    def state_bytes(self) -> dict:
        """The engine's accounting: bytes of optimizer state on the ``device`` and the ``host`` tier."""
        return self.engine.state_bytes()

    @torch.no_grad()
    def step(self, closure=None):
        loss = run_closure(closure)
        _hyperparameters_to(self.engine, self.param_groups)
        for param, local in self.locals.items():
            model = self.hosted.get(param, param)
            if _source(model).data_ptr() != local.data_ptr():
                raise RuntimeError(f"--optimizer-cpu-offload: a parameter of shape {tuple(param.shape)} was moved to "
                                   f"other storage after the optimizer was built (its offloaded copy would no "
                                   f"longer reach it)")
            grad = None if param.grad is None else _source(param.grad)
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
        for param, saved in _saved_state_by_param(self.param_groups, state_dict):
            self.state[param] = saved or {}


def _saved_state_by_param(param_groups: list, state_dict: dict) -> list:
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


# -- megatron's precision-aware path ---------------------------------------------------------------------
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
                [{**_hyper(group), "params": list(group["params"])} for group in self.param_groups],
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
        _hyperparameters_to(engine, self.param_groups)
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
        for param, saved in _saved_state_by_param(self.param_groups, state_dict):
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
