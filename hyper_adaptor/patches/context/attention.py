"""Level 2 — megatron's local ``DotProductAttention`` under context parallel.

Two wraps on the one class megatron's local spec (GPT, MoE) builds for core attention:

- ``__init__``: megatron asserts ``context_parallel_size == 1`` there ("only supported by
  TEDotProductAttention"); the original runs with a copy of the config that says 1 — nothing else in
  that constructor reads the CP size — and the module then holds the real config again, and notes which
  algorithm megatron handed this layer (``cp_comm_type``, per layer in megatron).
- ``forward``: with CP > 1 the layer's q/k/v (this rank's load-balanced sequence chunks, as megatron's
  ``get_batch_on_this_cp_rank`` cut the batch) go to ``context_parallel_attention``, with the layer's
  attention dropout when training (its base seed drawn where megatron draws that dropout's randomness);
  with CP == 1 the call is megatron's (or level 1's flash attention, which this wrap sits above).

The groups are megatron's: its CP group, and for the hybrid algorithm its hierarchical CP groups (built
from ``--hierarchical-context-parallel-sizes U CP/U``: the first level is U consecutive CP ranks — the
Ulysses group — the second the strided ranks — the ring), so nothing here creates a process group. A
module built with its own ``pg_collection`` (megatron-core library users) runs on that collection's ``cp``
(and ``hcp``) groups instead.

Without a command line (a ``TransformerConfig`` with CP > 1 built by a library user) the feature is applied
by level 0's wrap below this one (``library.py``).
"""

from __future__ import annotations

import copy
import functools
import inspect

from hyper_adaptor.patch_manager import Patch
from hyper_adaptor.patches.fused.attention import effective_scale, unsupported_call

FEATURE = "context_parallel"
CLASS = "megatron.core.transformer.dot_product_attention.DotProductAttention"
# The context-parallel algorithms and their names: megatron's --cp-comm-type value (TransformerEngine's
# names; megatron hands it to each layer's core attention) and MindSpeed's --context-parallel-algo name.
ALGORITHMS = {
    "ring": {"comm_type": "p2p", "mindspeed": "megatron_cp_algo"},
    "ulysses": {"comm_type": "a2a", "mindspeed": "ulysses_cp_algo"},
    "hybrid": {"comm_type": "a2a+p2p", "mindspeed": "hybrid_cp_algo"},
    "allgather": {"comm_type": "allgather", "mindspeed": None},
}
DEFAULT_ALGORITHM = "ring"  # megatron's default --cp-comm-type (p2p), and a layer handed none
# --cp-comm-type value -> algorithm; "all_gather" is TransformerEngine's spelling of allgather
COMM_TYPE_ALGO = {**{a["comm_type"]: name for name, a in ALGORITHMS.items()}, "all_gather": "allgather",
                  None: DEFAULT_ALGORITHM}


class ContextParallelUnsupported(RuntimeError):
    """A call this context-parallel attention does not serve (said instead of a wrong answer)."""


def _wrap_init(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if getattr(config, "context_parallel_size", 1) == 1:
            return original(self, config, *args, **kwargs)
        single = copy.copy(config)
        single.context_parallel_size = 1
        original(self, single, *args, **kwargs)
        self.config = config
        bound = signature.bind(self, config, *args, **kwargs)
        comm_type = bound.arguments.get("cp_comm_type")
        if not isinstance(comm_type, (str, type(None))) or comm_type not in COMM_TYPE_ALGO:
            # named both ways: megatron.training's flag, and the config field a library user sets
            raise ContextParallelUnsupported(
                f"cp_comm_type {comm_type!r} (TransformerConfig.cp_comm_type, --cp-comm-type) is not a "
                f"context-parallel algorithm hyper_adaptor serves on the local spec; choose from "
                f"{', '.join(k for k in COMM_TYPE_ALGO if k)}")
        self.hyper_cp_algo = COMM_TYPE_ALGO[comm_type]

    return __init__


def _groups(module):
    from hyper_adaptor.parallel.context import CPGroups

    from megatron.core import parallel_state

    groups = getattr(module, "hyper_cp_groups", None)
    if groups is not None:
        return groups
    # a library user may hand each layer its own groups (megatron's pg_collection), as TE's attention takes them
    collection = getattr(module, "pg_collection", None)
    cp = getattr(collection, "cp", None) or parallel_state.get_context_parallel_group()
    if module.hyper_cp_algo == "hybrid":
        hierarchical = (getattr(collection, "hcp", None)
                        or parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False))
        if not hierarchical or len(hierarchical) != 2:
            raise ContextParallelUnsupported(
                "the hybrid context-parallel algorithm (cp_comm_type 'a2a+p2p') runs on megatron's hierarchical "
                "CP groups: pass --ulysses-degree-in-cp K (or --hierarchical-context-parallel-sizes K CP/K); "
                "without a command line, initialize_model_parallel(hierarchical_context_parallel_sizes=[K, CP/K]) "
                "or a pg_collection with hcp")
        ulysses, ring = hierarchical
        groups = CPGroups(cp=cp, ulysses=ulysses, ring=ring, ulysses_degree=ulysses.size())
    else:
        degree = cp.size() if module.hyper_cp_algo == "ulysses" else 1
        groups = CPGroups(cp=cp, ulysses=None, ring=None, ulysses_degree=degree)
    module.hyper_cp_groups = groups
    return groups


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if self.config.context_parallel_size == 1:
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params)
        from hyper_adaptor.parallel.context import context_parallel_attention, draw_seed

        from megatron.core.transformer.enums import AttnMaskType

        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        reason = unsupported_call(self, mask_type, attention_bias, packed_seq_params,
                                  (AttnMaskType.causal, AttnMaskType.no_mask))
        if reason is not None:
            raise ContextParallelUnsupported(
                f"--context-parallel-size {self.config.context_parallel_size} ({self.hyper_cp_algo}): "
                f"{reason} is not served by hyper_adaptor's context-parallel attention")
        p = self.attention_dropout.p if self.training else 0.0
        seed = None
        if p > 0.0:
            # the engine's masks follow one base seed per call; megatron draws attention dropout from the
            # model-parallel RNG stream unless sequence parallel, so the seed comes from the same stream
            from megatron.core import tensor_parallel

            if self.config.sequence_parallel:
                seed = draw_seed(query.device)
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    seed = draw_seed(query.device)
        out = context_parallel_attention(
            query, key, value, groups=_groups(self), algo=self.hyper_cp_algo,
            causal=mask_type == AttnMaskType.causal, load_balanced=True, scale=effective_scale(self),
            dropout_p=p, dropout_seed=seed,
        )
        return out.reshape(out.shape[0], out.shape[1], -1)

    return forward


def patches(args) -> list[Patch]:
    return [
        # above level 0's wrap that accepts MLA's head sizes (it passes them through)
        Patch(f"{CLASS}.__init__", _wrap_init, "wrap", FEATURE, after=("compat",)),
        # above level 1's flash-attention wrap: with CP > 1 this one answers, with CP == 1 it passes on
        Patch(f"{CLASS}.forward", _wrap_forward, "wrap", FEATURE, after=("flash_attn",)),
    ]
