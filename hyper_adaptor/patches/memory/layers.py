"""Level 2 — activation swap and recompute on megatron's transformer layers, served by hyper_adaptor.memory.

The seam is ``TransformerBlock.__init__``: once megatron has built a block's layers (any spec, any
pipeline stage or virtual chunk), the wrap wraps the chosen submodules of each layer in place with the
engine's ``swap_wrapper`` / ``checkpoint_wrapper`` (instance attributes: parameter names, state dicts and
checkpoints are unchanged). Nothing of megatron's forward is copied.

A :class:`MemoryPlan` says what to do; the features ``swap`` and ``recompute`` build theirs from the flags
(each registers its own wrap of the constructor, on different submodules):

* ``swap``: names of what to swap in every layer (``SWAP_TARGETS``: ``--swap-modules`` names, megatron's
  ``--offload-modules`` names, ``layer`` for a whole layer), the saved activations moved to the host after
  the module's forward and prefetched back ``prefetch`` groups ahead in backward;
* ``swap_first_layers``: megatron's ``--cpu-offloading-num-layers N``: the first N layers of each block,
  whole (megatron's TE context counts the layers of its block the same way);
* ``recompute_activation``: MindSpeed's ``--recompute-activation-function``: the MLP runs under a
  selective checkpoint whose policy saves the outputs of the matrix products and recomputes everything
  else — the activation function's output (the largest tensor of the MLP) is rebuilt from the saved fc1
  output in backward instead of being kept.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from hyper_adaptor.patch_manager import Patch

FEATURE = "swap"
BLOCK_INIT = "megatron.core.transformer.transformer_block.TransformerBlock.__init__"

# name -> attribute path in a megatron TransformerLayer (several paths: each one wrapped)
SWAP_TARGETS = {
    # --swap-modules names (megatron's --recompute-modules style)
    "layer": ("",),
    "self_attn": ("self_attention",),
    "core_attn": ("self_attention.core_attention",),
    "mlp": ("mlp",),
    "layernorm": ("input_layernorm", "pre_mlp_layernorm"),
    # megatron's --offload-modules names (fine-grained activation offloading)
    "attn_norm": ("input_layernorm",),
    "qkv_linear": ("self_attention.linear_qkv",),
    "attn_proj": ("self_attention.linear_proj",),
    "mlp_norm": ("pre_mlp_layernorm",),
    "expert_fc1": ("mlp.experts",),
}
SWAP_MODULES = ("layer", "self_attn", "core_attn", "mlp", "layernorm")
OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1")

# ops whose outputs --recompute-activation-function keeps (everything else in the MLP is recomputed)
_SAVED_OPS = ("mm", "addmm", "bmm", "matmul", "linear", "_grouped_mm")


@dataclass
class MemoryPlan:
    swap: tuple[str, ...] = ()
    swap_first_layers: int = 0
    prefetch: int = 1
    min_bytes: int = 1 << 20
    recompute_activation: bool = False
    manager: object = field(default=None, repr=False)

    def swap_manager(self):
        if self.manager is None:
            from hyper_adaptor.memory import SwapManager

            self.manager = SwapManager(min_bytes=self.min_bytes, prefetch=self.prefetch)
        return self.manager

    @property
    def swaps(self) -> bool:
        return bool(self.swap or self.swap_first_layers)


def _submodule(layer, path: str):
    module = layer
    for part in filter(None, path.split(".")):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _is_identity(module) -> bool:  # megatron's placeholders where a spec has no such module
    return type(module).__name__ in ("IdentityOp", "IdentityFuncOp")


def _saving_matmuls(ctx, op, *args, **kwargs):
    from hyper_adaptor.memory import CheckpointPolicy

    name = getattr(getattr(op, "overloadpacket", op), "__name__", str(op))
    return CheckpointPolicy.MUST_SAVE if name in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_to_layer(layer, local_index: int, plan: MemoryPlan) -> None:
    """Wrap ``layer``'s submodules per ``plan``."""
    from hyper_adaptor.memory import checkpoint_wrapper, swap_wrapper

    if plan.recompute_activation and _submodule(layer, "mlp") is not None:
        checkpoint_wrapper(layer.mlp, _saving_matmuls, tag=f"layer{layer.layer_number}.mlp.recompute")
    names = ("layer",) if local_index < plan.swap_first_layers else plan.swap
    for name in names:
        for path in SWAP_TARGETS[name]:
            module = _submodule(layer, path)
            if module is None or _is_identity(module):
                continue
            swap_wrapper(module, manager=plan.swap_manager(), tag=f"layer{layer.layer_number}.{path or 'layer'}")


def _block_init(plan: MemoryPlan):
    def wrap(original_init):
        @functools.wraps(original_init)
        def __init__(self, *args, **kwargs):
            original_init(self, *args, **kwargs)
            for i, layer in enumerate(self.layers):
                apply_to_layer(layer, i, plan)

        return __init__

    wrap.plan = plan  # the plan is bound here, not kept anywhere else (plan_of reads it back)
    return wrap


def patches(plan: MemoryPlan, feature: str = FEATURE, after: tuple[str, ...] = ()) -> list[Patch]:
    if not (plan.swaps or plan.recompute_activation):
        return []
    return [Patch(BLOCK_INIT, _block_init(plan), "wrap", feature, after=after)]


def plan_of(patches_: list[Patch]) -> MemoryPlan | None:
    """The plan bound into the block-constructor wrap among ``patches_`` (its swap manager counts what moved)."""
    return next((p.replacement.plan for p in patches_ if p.target == BLOCK_INIT), None)


__all__ = ["MemoryPlan", "OFFLOAD_MODULES", "SWAP_MODULES", "SWAP_TARGETS", "apply_to_layer", "patches", "plan_of"]
