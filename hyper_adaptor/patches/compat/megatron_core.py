"""Level-0 patches on megatron.core: the few seams where it assumes a CUDA build.

Each patch wraps the smallest seam; none copies a megatron function.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging

import torch

from hyper_adaptor.patch_manager import Patch

FEATURE = "compat"
RNG_MODULE = "megatron.core.tensor_parallel.random"


# --- RNG ---------------------------------------------------------------------------------------
def set_device_rng_state_on_host(new_state, device=-1, graph_safe=False):
    """megatron's ``_set_cuda_rng_state`` on a CPU build queues the change through
    ``torch.cuda._lazy_call``, which never runs: the TP RNG tracker would never fork. The emulated
    device generator is the host default generator, so set that one, now."""
    torch.set_rng_state(new_state)


class _HostForkNotice(logging.Filter):
    """The tracker warns when the CPU RNG moves inside a fork; with the host generator *being* the
    device generator that is the point of forking, so that one warning is dropped."""

    def filter(self, record):
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_HOST_FORK_FILTER = _HostForkNotice()


def install_rng_log_filter():
    logging.getLogger(RNG_MODULE).addFilter(_HOST_FORK_FILTER)


# --- type-name checks ------------------------------------------------------------------------
_LEGACY_TYPE_NAME = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
_type_view_depth = 0


@contextlib.contextmanager
def device_type_names():
    """While active, ``tensor.type()`` (no argument) names host float tensors as their CUDA
    type: megatron's optimizers and grad clipping sort parameters by comparing that string with
    'torch.cuda.FloatTensor' and friends. Only the functions wrapped by :func:`_with_device_type_names`
    run under it, so nothing else sees the changed answer."""
    global _type_view_depth
    original = torch.Tensor.__dict__.get("type")
    inherited_type = torch._C.TensorBase.type
    if _type_view_depth == 0:

        def type_(self, dtype=None, non_blocking=False, **kwargs):
            if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _LEGACY_TYPE_NAME:
                return _LEGACY_TYPE_NAME[self.dtype]
            return inherited_type(self, dtype, non_blocking, **kwargs) if dtype is not None else inherited_type(self)

        torch.Tensor.type = type_
    _type_view_depth += 1
    try:
        yield
    finally:
        _type_view_depth -= 1
        if _type_view_depth == 0:
            if original is None:
                del torch.Tensor.type
            else:
                torch.Tensor.type = original


def _with_device_type_names(original):
    @functools.wraps(original)
    def under_device_type_names(*args, **kwargs):
        with device_type_names():
            return original(*args, **kwargs)

    return under_device_type_names


TYPE_CHECKING_FUNCTIONS = (
    "megatron.core.optimizer.optimizer.Float16OptimizerWithFloat16Params.__init__",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.__init__",
    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._build_model_and_main_param_groups",
    "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32",
)


# --- sequence parallel with the local (torch) norm -------------------------------------------
def _norm_with_sequence_parallel(original_new):
    """megatron's WrappedTorchNorm refuses ``sequence_parallel``. The norm itself is the same under
    sequence parallelism; what changes is that its weight and bias see only a slice of the sequence,
    so their gradients must be all-reduced over the TP group — which megatron's
    finalize_model_grads does for every parameter marked ``sequence_parallel``."""

    @functools.wraps(original_new)
    def build(cls, config, *args, **kwargs):
        if not getattr(config, "sequence_parallel", False):
            return original_new(cls, config, *args, **kwargs)
        local_config = copy.copy(config)
        local_config.sequence_parallel = False
        return mark_sequence_parallel(original_new(cls, local_config, *args, **kwargs), config)

    return build


def mark_sequence_parallel(norm, config):
    """Under sequence parallelism each TP rank's norm sees a slice of the sequence; parameters marked
    ``sequence_parallel`` get their gradients all-reduced over TP by megatron's finalize_model_grads."""
    if getattr(config, "sequence_parallel", False):
        for param in norm.parameters():
            param.sequence_parallel = True
    return norm


# --- interleaved pipeline with PP=2 and batched P2P ------------------------------------------
def _refuse_pp2_batched_interleaving(original):
    """With an interleaved (VPP) schedule, PP=2 and ``batch_p2p_comm=True``, the two ranks post
    several sends and receives to each other in one batch and later microbatches receive the wrong
    activations — silently wrong gradients. megatron.training refuses it in its argument checks;
    megatron.core does not, so library users reach it. Refuse it here, loudly."""

    @functools.wraps(original)
    def checked(*args, **kwargs):
        from megatron.core import parallel_state
        from megatron.core.utils import get_model_config

        model = kwargs.get("model")
        config = get_model_config(model[0] if isinstance(model, list) else model)
        communicator = kwargs.get("p2p_communicator")
        if communicator is not None:
            pp_size = communicator.pp_group.size()
        else:
            pp_size = parallel_state.get_pipeline_model_parallel_world_size()
        if pp_size == 2 and config.batch_p2p_comm:
            raise ValueError(
                "interleaved pipeline schedule (virtual pipeline size > 1) with pipeline parallel size 2 "
                "and batch_p2p_comm=True gives wrong activations for later microbatches; set "
                "batch_p2p_comm=False (megatron.training: --overlap-p2p-communication) or use PP > 2"
            )
        return original(*args, **kwargs)

    return checked


def patches(device_type: str) -> list[Patch]:
    """Level-0 megatron.core patches for ``device_type``."""
    result = [
        Patch(
            "megatron.core.pipeline_parallel.schedules.forward_backward_pipelining_with_interleaving",
            _refuse_pp2_batched_interleaving,
            "wrap",
            FEATURE,
        ),
        Patch(
            "megatron.core.transformer.torch_norm.WrappedTorchNorm.__new__",
            _norm_with_sequence_parallel,
            "wrap",
            FEATURE,
        ),
    ]
    if device_type == "cpu":
        result.append(Patch(f"{RNG_MODULE}._set_cuda_rng_state", set_device_rng_state_on_host, "replace", FEATURE))
        result += [Patch(t, _with_device_type_names, "wrap", FEATURE) for t in TYPE_CHECKING_FUNCTIONS]
    return result
