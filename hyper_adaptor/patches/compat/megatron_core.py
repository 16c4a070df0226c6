"""Level-0 patches on megatron.core: the few seams where it assumes a CUDA build.

Each patch wraps the smallest seam; none copies a megatron function.
"""

from __future__ import annotations

import copy
import functools
import logging

import torch

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.compat.arguments import have_transformer_engine

FEATURE = "compat"
RNG_MODULE = "megatron.core.tensor_parallel.random"


# --- RNG ---------------------------------------------------------------------------------------
def set_device_rng_state_on_host(new_state, device=-1, graph_safe=False):
    """megatron's ``_set_cuda_rng_state`` on a CPU build queues the change through
    ``torch.cuda._lazy_call``, which never runs: the TP RNG tracker would never fork. The emulated
    device generator is the host default generator, so set that one, now."""
    torch.set_rng_state(new_state)


HOST_FORK_WARNING = "CPU RNG state changed within GPU RNG context"


class _LoggerWithoutHostForkWarning(logging.LoggerAdapter):
    """megatron's RNG module logs through its module logger; this adapter drops the one warning above
    and passes the rest on. (A Patch on the module's ``logging`` name, not a filter added to the
    process-wide logger, so that describe lists it and undo removes it.)"""

    def log(self, level, msg, *args, **kwargs):
        if HOST_FORK_WARNING not in str(msg):
            self.logger.log(level, msg, *args, **kwargs)


class _LoggingWithoutHostForkWarning:
    """Stands for the ``logging`` module inside megatron's RNG module, which calls
    ``logging.getLogger(__name__).warning(...)`` at the fork's exit."""

    def __init__(self, real):
        self._real = real

    def getLogger(self, name=None):
        logger = self._real.getLogger(name)
        return _LoggerWithoutHostForkWarning(logger, {}) if name == RNG_MODULE else logger

    def __getattr__(self, name):
        return getattr(self._real, name)


# --- type-name checks ------------------------------------------------------------------------
def _with_device_type_names(original):
    from hyper_adaptor.patches.compat.torch_cpu import device_type_names

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


# --- YaRN RoPE (multi-latent attention) -------------------------------------------------------------
YARN_INIT = "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding.YarnRotaryEmbedding.__init__"


def _yarn_on_host(original_init):
    """YarnRotaryEmbedding (MLA's default RoPE) builds its frequencies under
    ``with torch.device(torch.cuda.current_device())`` unless ``use_cpu_initialization``; the
    emulated current device is index 0, and ``torch.device(0)`` means the accelerator, which a CPU
    process does not have ("Cannot access accelerator device"). MLASelfAttention never passes the
    flag, so every MLA layer failed to build on CPU — megatron's local spec as well as the TE spec.
    On the host, CPU initialisation is the only initialisation: the wrap sets it."""
    import inspect

    signature = inspect.signature(original_init)

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["use_cpu_initialization"] = True
        return original_init(*bound.args, **bound.kwargs)

    return init


# --- multi-latent attention on the local core attention ------------------------------------------
DOT_PRODUCT_INIT = "megatron.core.transformer.dot_product_attention.DotProductAttention.__init__"


def _head_sizes_of_mla(original_init):
    """MLASelfAttention builds its core attention with ``k_channels`` (query/key head size: the
    no-RoPE part plus the RoPE part) and ``v_channels`` (value head size), which only
    TEDotProductAttention accepts: megatron's local DotProductAttention raises TypeError, so MLA ran
    nowhere without TransformerEngine (local spec and TE spec alike, on every device). Its forward is
    already head-size agnostic (scores from q·k, context from p·v, MLA passes its own softmax scale)
    except the final view to ``heads x kv_channels``: the wrap takes the two sizes off the call and
    sets the per-partition context width to heads x ``v_channels``."""

    @functools.wraps(original_init)
    def init(self, *args, k_channels=None, v_channels=None, **kwargs):
        original_init(self, *args, **kwargs)
        if k_channels is not None:
            self.hidden_size_per_attention_head = k_channels
        if v_channels is not None:
            self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return init


# --- selective recompute without TE ----------------------------------------------------------------
CHECKPOINT_WITHOUT_OUTPUT_INIT = f"{RNG_MODULE}.CheckpointWithoutOutput.__init__"


def _no_fp8_without_te(original_init):
    """``CheckpointWithoutOutput(fp8=False)`` stores ``fp8 is not None`` — True for its default False — so
    its forward always asks TransformerEngine's ``FP8GlobalStateManager``, a name that does not exist
    without TE (NameError). It is what megatron's selective recompute of ``layernorm`` (and ``moe_act``,
    ``mla_up_proj``) runs, so ``--recompute-modules layernorm`` failed on every device without TE. Without
    TE there is no fp8: the wrap sets the flag False after megatron's own init."""

    @functools.wraps(original_init)
    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self.fp8 = False

    return init


CHECKPOINT = f"{RNG_MODULE}.checkpoint"


def _leaves_outside_checkpoint(original_checkpoint):
    """megatron's recompute ``checkpoint`` (a custom autograd Function) returns what the checkpointed
    function returned. A module built with ``skip_bias_add`` returns its bias *Parameter* as the second
    output (the MLP's ``(output, bias)``); returned from the Function's forward, the leaf parameter gets
    the Function as its ``grad_fn``, so each step's graph stays reachable from the parameter and the next
    backward walks all of them again: selective ``--recompute-modules mlp`` with biases (megatron's default
    ``--add-bias-linear``) grew memory without bound until the process was killed. The wrap hands leaf
    tensors that require grad back outside the Function (recorded in forward, None inside), so they keep
    their ordinary accumulation; everything else is megatron's checkpoint unchanged."""

    @functools.wraps(original_checkpoint)
    def checkpoint(function, distribute_saved_activations, *args, **kwargs):
        leaves = {}

        def without_leaves(*inner_args, **inner_kwargs):
            outputs = function(*inner_args, **inner_kwargs)
            if not isinstance(outputs, tuple):
                return outputs
            kept = []
            for i, out in enumerate(outputs):
                if isinstance(out, torch.Tensor) and out.is_leaf and out.requires_grad:
                    leaves[i] = out
                    kept.append(None)
                else:
                    kept.append(out)
            return tuple(kept)

        outputs = original_checkpoint(without_leaves, distribute_saved_activations, *args, **kwargs)
        if not leaves:
            return outputs
        return tuple(leaves.get(i, out) for i, out in enumerate(outputs))

    return checkpoint


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
        Patch(DOT_PRODUCT_INIT, _head_sizes_of_mla, "wrap", FEATURE),
        Patch(CHECKPOINT, _leaves_outside_checkpoint, "wrap", FEATURE),
    ]
    if not have_transformer_engine():
        result.append(Patch(CHECKPOINT_WITHOUT_OUTPUT_INIT, _no_fp8_without_te, "wrap", FEATURE))
    if device_type == "cpu":
        result.append(Patch(f"{RNG_MODULE}._set_cuda_rng_state", set_device_rng_state_on_host, "replace", FEATURE))
        result.append(Patch(f"{RNG_MODULE}.logging", _LoggingWithoutHostForkWarning, "wrap", FEATURE, rebind_in=()))
        result += [Patch(t, _with_device_type_names, "wrap", FEATURE) for t in TYPE_CHECKING_FUNCTIONS]
        result.append(Patch(YARN_INIT, _yarn_on_host, "wrap", FEATURE, rebind_in=()))
    return result
