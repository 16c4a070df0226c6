"""Megatron's ``--optimizer-cpu-offload`` (and ``--optimizer-offload-fraction``) served by the
optimizer-offload engine (``hyper_adaptor.memory.OffloadOptimizer``) on every device: the patches.

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
(``wrapper.optimizer``) is swapped for ``OffloadedTorchOptimizer`` (``torch_optimizer.py``). Everything
megatron does around the step — gradient unscaling, clipping, the distributed optimizer's shard
bookkeeping and all-gather, checkpoints — runs unchanged on the same parameters; the bf16 / fp16
optimizer's fp32 main copies of the offloaded share are released (``main_copies.py``, whose wraps are
the ``FLOAT16``, ``PARAM_DATA`` and ``PARAM_METADATA`` patches).
Why not a replacement ``HybridDeviceOptimizer`` for every case: megatron reaches it only through the
precision-aware paths of the distributed optimizer (bf16 shards, ``decoupled_grad``), so it could not
serve ``FP32Optimizer``, ``Float16OptimizerWithFloat16Params`` or HSDP. Where megatron does reach it —
``--use-distributed-optimizer --use-precision-aware-optimizer`` with ``--bf16`` / ``--fp16`` — it is
replaced (the ``HYBRID`` patch) by ``OffloadedHybridOptimizer`` (``hybrid_optimizer.py``), and the factory
runs as megatron wrote it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import torch

from hyper_adaptor.notice import notice
from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.memory.hybrid_optimizer import OffloadedHybridOptimizer
from hyper_adaptor.patches.memory.main_copies import (
    copies_to_release,
    loading_into_host_masters,
    main_copies,
    main_copy_on_the_parameters_device,
    point_main_params_at_masters,
    refreshing_hosted_masters,
    releasing,
    releasing_main_copies_as_made,
    state_dict_with_host_masters,
    without_hosted_pairs,
)
from hyper_adaptor.patches.memory.torch_optimizer import OffloadedTorchOptimizer

FEATURE = "optimizer_offload"
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
    signature = inspect.signature(original)

    @functools.wraps(original)
    def _get_megatron_optimizer_based_on_param_groups(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        config = call.arguments["config"]
        if not getattr(config, "optimizer_cpu_offload", False):
            return original(*args, **kwargs)
        if call.arguments.get("skip_megatron_wrapping", False):
            raise ValueError("--optimizer-cpu-offload: skip_megatron_wrapping=True (layer-wise / emerging "
                             "optimizers) is not served")
        if getattr(config, "use_precision_aware_optimizer", False):
            # megatron's own path: its distributed optimizer over its CPU-offload optimizer class, which
            # the HYBRID patch made OffloadedHybridOptimizer
            optimizer = original(*args, **kwargs)
            inner = getattr(optimizer, "optimizer", None)
            if isinstance(inner, OffloadedHybridOptimizer):
                notice(f"--optimizer-cpu-offload --use-precision-aware-optimizer: megatron's "
                       f"{type(optimizer).__name__} steps through hyper_adaptor's OffloadOptimizer "
                       f"({inner.offloaded_share():.0%} of rank 0's elements with state and fp32 masters on "
                       f"the host; no fp32 main copies beside the parameters)")
            return optimizer
        call.arguments["config"] = dataclasses.replace(config, optimizer_cpu_offload=False)
        with releasing(copies_to_release(config, call.arguments.get("param_groups"))):
            optimizer = original(*call.args, **call.kwargs)
        inner = getattr(optimizer, "optimizer", None)
        if inner is not None:
            served = OffloadedTorchOptimizer(
                inner, host_optimizer_class(inner, config), offload_fraction=config.optimizer_offload_fraction,
                pin_memory=None if getattr(config, "pin_cpu_params", True) else False,
                model_params=main_copies(optimizer))
            optimizer.optimizer = served
            point_main_params_at_masters(served)
            hosted = (f"; the fp32 main copies of {sum(m.numel() for m in served.hosted):,} elements live on the "
                      f"host only" if served.hosted else "")
            notice(f"--optimizer-cpu-offload: megatron's {type(optimizer).__name__} steps through "
                   f"hyper_adaptor's OffloadOptimizer ({served.offloaded_share():.0%} of rank 0's elements "
                   f"with state on the host{hosted})")
        return optimizer

    return _get_megatron_optimizer_based_on_param_groups


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
