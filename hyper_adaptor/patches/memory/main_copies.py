"""Megatron's bf16 / fp16 optimizer (``Float16OptimizerWithFloat16Params``, also HSDP's in half
precision) under ``--optimizer-cpu-offload``: its fp32 main copies of the offloaded share released.

The optimizer keeps an fp32 main copy beside each half-precision parameter. The engine's host master of an
offloaded parameter is that copy's equal, so the copy is *released* as megatron makes it (its device
storage freed, so the copies never exist all at once; the tensor stays, shapes and gradient intact, for
megatron's unscaling, clipping and norms) and the engine steps the model parameter itself, its gradient
the copy's (:class:`OffloadedTorchOptimizer` with ``model_params``). What megatron does with a copy's data
is served by small wraps: the copies are released as made (:func:`releasing_main_copies_as_made`), the
model<->main copies skip released pairs (:func:`without_hosted_pairs`; the engine writes those
parameters), ``reload_model_params`` refreshes the masters, ``state_dict`` / ``load_state_dict`` see the
masters in the copies' place (so checkpoints save and load the host tensors), and each parameter's
``main_param`` (megatron.training's ``--log-params-norm``) is its master, brought to the device for the
norm. Replacing megatron's wrapper instead would fork its loss scaling, clipping and checkpoint code.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from hyper_adaptor.memory.optimizer_offload import choose_offloaded
from hyper_adaptor.patches.memory.torch_optimizer import OffloadedTorchOptimizer, local_tensor

# model parameters whose fp32 main copies megatron's bf16 / fp16 optimizer is making right now, to be
# released as each is made (set only while the offload seam builds that optimizer)
_RELEASE: set | None = None


@contextlib.contextmanager
def releasing(params: set):
    global _RELEASE
    _RELEASE = params
    try:
        yield
    finally:
        _RELEASE = None


def copies_to_release(config, param_groups: list) -> set:
    """The model parameters of the offloaded share, where megatron will build its bf16 / fp16 optimizer
    (half precision, no distributed optimizer): the engine's split of the factory's ``param_groups`` —
    the same parameters in the same order as the optimizer it builds (:class:`OffloadedTorchOptimizer`
    makes the same choice over their main copies, and refuses a released copy it would not host)."""
    if not (getattr(config, "bf16", False) or getattr(config, "fp16", False)) \
            or getattr(config, "use_distributed_optimizer", False):
        return set()
    return choose_offloaded([{"params": list(g["params"])} for g in param_groups or []],
                            config.optimizer_offload_fraction)


def releasing_main_copies_as_made(original):
    """Wrap of megatron's ``copy_optimizer_param_metadata``, which its bf16 / fp16 optimizer calls right
    after making each fp32 main copy: a copy of the offloaded share is released there and then, so the
    copies never exist all at once (the engine's host master, made from the model parameter the copy was
    just cloned from, holds the same values). Outside the offload seam's build it only calls megatron's."""

    @functools.wraps(original)
    def copy_optimizer_param_metadata(destination, source, *args, **kwargs):
        result = original(destination, source, *args, **kwargs)
        if _RELEASE and source in _RELEASE and destination.dtype == torch.float32 and source.dtype != torch.float32:
            local_tensor(destination).untyped_storage().resize_(0)
        return result

    return copy_optimizer_param_metadata


def main_copies(optimizer) -> dict:
    """``{fp32 main copy: its half-precision model parameter}`` of megatron's bf16 / fp16 optimizer
    (``Float16OptimizerWithFloat16Params``; empty for the others)."""
    mains = {}
    groups = zip(getattr(optimizer, "float16_groups", ()), getattr(optimizer, "fp32_from_float16_groups", ()))
    for models, copies in groups:
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
            self.optimizer.engine.refresh_masters()  # a released copy's master from its model parameter
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


def point_main_params_at_masters(served: OffloadedTorchOptimizer) -> None:
    """megatron.training's ``--log-params-norm`` reads a parameter's ``main_param``: for a released copy,
    its host master (brought to the parameter's device for the norm: :func:`main_copy_on_the_parameters_device`)."""
    for main, model in served.hosted.items():
        if getattr(model, "main_param", None) is main:
            model.main_param = served.host_master(main)
