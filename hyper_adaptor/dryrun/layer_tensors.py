"""What one transformer layer keeps for backward, per micro-batch on one rank, as named tensors (:class:`Term`),
and what swap and recompute do to them: the activation side of :mod:`hyper_adaptor.dryrun.memory`, which
multiplies these by the micro-batches in flight. Checked against what megatron's own layer saves
(tests/unit/test_dryrun_memory.py, torch's saved-tensor hooks)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hyper_adaptor.dryrun.shape import BYTES, ModelShape
from hyper_adaptor.features.base import asked

FP32 = 4

@dataclass(frozen=True)
class Term:
    """One tensor a layer keeps for backward: ``module`` names the submodule that keeps it (the names swap and
    recompute use), ``nbytes`` its size for one micro-batch on one rank."""
    name: str
    module: str
    nbytes: int
    linear_input: bool = False   # kept for the weight gradient too (what a zero-bubble W step still needs)


def layer_terms(shape: ModelShape, args, moe: bool = False) -> list[Term]:
    """What megatron's local-spec TransformerLayer keeps for backward per micro-batch, on one rank.

    s = seq / CP, b = micro-batch, h = hidden, a = heads / TP, B = activation bytes (2 for bf16 / fp16),
    m = dropout-mask bytes (1 on cuda / npu: a bool mask; B on cpu, where torch's dropout keeps a scaled
    mask of the input's dtype). Full-width tensors (s x b x h) are divided by TP under sequence parallel.
    """
    s, b, h = shape.seq // shape.cp, shape.micro_batch, shape.hidden
    tp, d = shape.tp, shape.head_dim
    half = shape.dtype != "fp32"
    width = BYTES[shape.dtype]
    mask = 1 if asked(args, "device", "cpu") in ("cuda", "npu") else width
    full = s * b * h // (tp if shape.sp else 1)    # elements of one full-width tensor on this rank
    sb = s * b // (tp if shape.sp else 1)
    heads = shape.heads // tp
    terms = []

    def norm(module):
        if shape.normalization == "RMSNorm":  # torch's RMSNorm: the input in fp32 (a copy in bf16 / fp16), 1/rms,
            terms.append(Term("norm input (fp32)", module, full * FP32))  # normalized fp32
            terms.extend([Term("norm rstd", module, sb * FP32), Term("norm normalized (fp32)", module, full * FP32)])
        else:  # torch's layer_norm: its input, and mean and rstd in fp32
            terms.extend([Term("norm input", module, full * width), Term("norm mean, rstd", module, 2 * sb * FP32)])

    norm("attn_norm")
    terms.append(Term("qkv input", "qkv_linear", full * width, True))
    terms.extend(_attention_inputs(shape, args, s, b, width))
    if shape.cp > 1:
        # the adaptor's context-parallel attention (every algorithm) keeps the output and the log-sum-exp and
        # rebuilds the scores in backward (Ulysses: whole, on a / CP heads; the others a block at a time)
        terms.append(Term("attention output", "core_attn", s * b * heads * d * width))
        terms.append(Term("attention log-sum-exp", "core_attn", b * heads * s * FP32))
        if cp_algorithm(shape, args) == "allgather":
            # the all-gathered keys and values of the whole sequence: the backward reads the keys before each
            # query chunk from them (views keep the whole gathered tensor)
            kv = shape.kv_heads * shape.head_dim // tp
            terms.append(Term("gathered k, v", "core_attn", 2 * shape.seq * b * kv * width))
        return _after_attention(shape, args, terms, full, sb, width, mask, norm)
    scores = b * heads * s * shape.seq
    softmax_fp32 = half and getattr(args, "attention_softmax_in_fp32", False)
    terms.append(Term("softmax output", "core_attn", scores * (FP32 if softmax_fp32 else width)))
    if softmax_fp32:
        terms.append(Term("softmax output (cast)", "core_attn", scores * width))
    if args.attention_dropout > 0:
        terms.append(Term("attention dropout mask", "core_attn", scores * mask))
        terms.append(Term("attention dropout output", "core_attn", scores * width))
    return _after_attention(shape, args, terms, full, sb, width, mask, norm, moe)


def _attention_inputs(shape: ModelShape, args, s: int, b: int, width: int) -> list[Term]:
    """What the attention keeps of q, k and v. Without RoPE or query groups, linear_qkv's whole output (q, k
    and v are views of it). RoPE writes new q and k (megatron's rotation, or the adaptor's fused one, out of
    place) and each of its two calls keeps its cos and sin (s x rotary dims, the activations' dtype). Under GQA
    megatron copies q out of the grouped output and its local attention repeats k and v to one per query head,
    and keeps those copies. linear_qkv's output survives while a view of it is kept: q or v in plain multi-head
    attention, and whatever selective recompute's core_attn checkpoint takes as its inputs (q, k, v as they
    enter it; the repeats inside are rebuilt). Checked against torch's saved-tensor hooks on megatron's layer."""
    tp, d = shape.tp, shape.head_dim
    rope = shape.position_embedding == "rope"
    groups = shape.heads != shape.kv_heads and shape.cp == 1    # the adaptor's CP attention copies nothing
    checkpointed = args.recompute_granularity == "selective" and "core_attn" in (args.recompute_modules
                                                                               or ["core_attn"])
    views_kept = checkpointed or not groups
    per_head = s * b * d // tp * width
    terms = []
    if views_kept:
        terms.append(Term("q, k, v", "core_attn", (shape.heads + 2 * shape.kv_heads) * per_head))
    if rope:
        rotary = int(d * (asked(args, "rotary_percent", 1.0) or 1.0))
        terms.append(Term("q, k after rope", "core_attn", (shape.heads + (shape.kv_heads if views_kept else 0))
                          * per_head))
        terms.append(Term("rope cos, sin", "rope", 4 * s * rotary * width))
    if groups and not rope:
        terms.append(Term("q (copied from the groups)", "core_attn", shape.heads * per_head))
    if groups:
        terms.append(Term("k, v per query head", "core_attn", 2 * shape.heads * per_head))
    return terms


def _after_attention(shape, args, terms, full, sb, width, mask, norm, moe=False) -> list[Term]:
    """layer_terms from linear_proj on."""
    s, b, tp = shape.seq // shape.cp, shape.micro_batch, shape.tp
    terms.append(Term("proj input", "attn_proj", s * b * shape.heads * shape.head_dim // tp * width, True))
    if args.hidden_dropout > 0:
        terms.append(Term("attention residual dropout mask", "bda", full * mask))
    norm("mlp_norm")
    if moe:
        terms.extend(_moe_terms(shape, args, full, width))
    else:
        terms.append(Term("fc1 input", "mlp", full * width, True))
        terms.extend(_mlp_activation(s * b * (shape.ffn // tp), width, shape.swiglu, "mlp"))
    if args.hidden_dropout > 0:
        terms.append(Term("mlp residual dropout mask", "bda", full * mask))
    return terms


def blockwise_cp(shape: ModelShape, args) -> bool:
    """Context parallel by the adaptor's blockwise attention (every algorithm but Ulysses)."""
    return shape.cp > 1 and cp_algorithm(shape, args) != "ulysses"


def cp_algorithm(shape: ModelShape, args) -> str:
    """The context-parallel algorithm the adaptor runs ("" without CP)."""
    if shape.cp == 1:
        return ""
    from hyper_adaptor.features import FEATURES

    feature = next(f for f in FEATURES if f.name == "context_parallel")
    return feature.algorithm(args)


def _mlp_activation(columns: int, width: int, swiglu: bool, module: str) -> list[Term]:
    """fc1's output and the activation's (fc2's input). megatron's unfused swiglu also keeps both halves and
    silu's output: 5 x (tokens x ffn) against gelu's 2."""
    if swiglu:
        return [Term("fc1 output", module, 2 * columns * width), Term("swiglu halves, silu", "moe_act"
                if module == "experts" else module, 2 * columns * width),
                Term("fc2 input", module, columns * width, True)]
    return [Term("fc1 output", module, columns * width), Term("fc2 input", module, columns * width, True)]


def capacity(shape: ModelShape, args) -> int | None:
    """megatron's expert capacity under --moe-expert-capacity-factor F: the tokens one expert takes from one
    source rank's s x b, ceil(s x b x topk / num_experts x F) (moe_utils.get_capacity), never more than
    s x b; None when dropless."""
    factor = asked(args, "moe_expert_capacity_factor", None)
    if factor is None or not shape.num_experts:
        return None
    tokens = shape.seq // shape.cp * shape.micro_batch
    return min(math.ceil(tokens * shape.topk / shape.num_experts * factor), tokens)


def routed_tokens(shape: ModelShape, args) -> int:
    """Tokens this rank's experts get per micro-batch and MoE layer (rows of the dispatched input; a token
    routed to two local experts counts twice). Dropless: balanced routing, s x b x topk (s x b x topk /
    num_experts per expert from each of the EP ranks, num_experts / EP experts here), times
    --moe-token-imbalance F (the busiest rank's share over the balanced one; 1 by default), never more than
    every token of the EP group to every local expert it may pick. Under --moe-expert-capacity-factor: the
    capacity per expert and source rank, the bound on the busiest rank (exact with
    --moe-pad-expert-input-to-capacity), or F x balanced below it when --moe-token-imbalance is given."""
    s, b = shape.seq // shape.cp, shape.micro_batch
    local = shape.num_experts // shape.ep
    most = s * b * shape.ep * min(shape.topk, local)
    tokens = min(math.ceil(s * b * shape.topk * imbalance(args)), most)
    cap = capacity(shape, args)
    if cap is None:
        return tokens
    capped = cap * local * shape.ep
    if asked(args, "moe_pad_expert_input_to_capacity", False):
        return capped
    return min(capped, most) if asked(args, "moe_token_imbalance", None) is None else min(tokens, capped)


def imbalance(args) -> float:
    """--moe-token-imbalance, 1 (balanced) when not given."""
    return float(asked(args, "moe_token_imbalance", None) or 1.0)


def _aux_loss(args) -> bool:
    """megatron's router computes its aux-loss scores (a load-balancing type with a coefficient > 0)."""
    kinds = asked(args, "moe_router_load_balancing_type", "aux_loss")
    coeffs = asked(args, "moe_aux_loss_coeff", 0.0)
    kinds = kinds if isinstance(kinds, list) else [kinds]
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(kinds)
    return any(k in ("aux_loss", "seq_aux_loss", "global_aux_loss") and (c or 0) > 0 for k, c in zip(kinds, coeffs))


def _moe_terms(shape: ModelShape, args, full: int, width: int) -> list[Term]:
    """An MoE layer's MLP part: the router's input and its routing tensors (top-k indices int64 and
    probabilities fp32 per token, the experts' bool routing map and fp32 probabilities, the permutation's int64
    indices; with an aux loss its own scores and indices), the dispatched tokens, and
    for them fc1's output, the activation's and the activation scaled by the routing probability (with those
    probabilities). The dispatched tokens are :func:`routed_tokens` (balanced routing unless said otherwise)."""
    s, b = shape.seq // shape.cp, shape.micro_batch
    tokens = routed_tokens(shape, args)
    routing = s * b * shape.topk * (8 + FP32) + s * b * shape.num_experts * (1 + FP32) + s * b * shape.topk * 8
    if _aux_loss(args):
        # its softmax scores and top-k indices per token, the tokens per expert (int64) and the loss
        routing += s * b * (shape.num_experts * FP32 + shape.topk * 8) + shape.num_experts * 8 + FP32
    # the pre-MLP norm's output: the router's input, and the shared experts' (one storage)
    terms = [Term("router input", "moe", full * width, True), Term("routing", "moe", routing),
             Term("permuted tokens", "experts", tokens * shape.hidden * width, True)]
    columns = tokens * (shape.moe_ffn // shape.etp)
    terms.extend(_mlp_activation(columns, width, shape.swiglu, "experts"))
    terms.append(Term("activation x probability", "moe_act", columns * width + tokens * FP32))
    if shape.shared_ffn:
        terms.extend(_mlp_activation(s * b * shape.shared_ffn // shape.tp, width, shape.swiglu, "shared_experts"))
    return terms


SWAP_NAMES = {  # the adaptor's --swap-modules and megatron's --offload-modules -> layer_terms modules
    "layer": {"attn_norm", "qkv_linear", "rope", "core_attn", "attn_proj", "bda", "mlp_norm", "mlp", "moe",
              "experts", "moe_act", "shared_experts"},
    "self_attn": {"qkv_linear", "rope", "core_attn", "attn_proj"}, "core_attn": {"core_attn"},
    "mlp": {"mlp", "moe", "experts", "moe_act", "shared_experts"}, "layernorm": {"attn_norm", "mlp_norm"},
    "attn_norm": {"attn_norm"}, "qkv_linear": {"qkv_linear"}, "attn_proj": {"attn_proj"},
    "mlp_norm": {"mlp_norm"}, "expert_fc1": {"experts"},
}


def swapped_modules(args, layer_in_chunk: int) -> set[str]:
    """The layer_terms modules whose saved tensors go to the host for a layer (its index in its chunk)."""
    names = set(asked(args, "swap_modules", None) or ())
    if asked(args, "swap_attention", False):
        names.add("self_attn")
    if asked(args, "fine_grained_activation_offloading", False):
        names.update(asked(args, "offload_modules", None) or ())
    if layer_in_chunk < (asked(args, "cpu_offloading_num_layers", 0) or 0):
        names.add("layer")
    return set().union(*(SWAP_NAMES.get(n, set()) for n in names)) if names else set()


# what selective recompute's core_attn checkpoint keeps: its inputs
ATTENTION_INPUTS = ("q, k, v", "q, k after rope", "q (copied from the groups)")


def recomputed(args, terms: list[Term]) -> list[Term]:
    """Selective recompute (--recompute-granularity selective --recompute-modules, megatron's default
    core_attn): what stays. core_attn keeps q, k, v (its checkpoint's inputs); mlp keeps its input; layernorm
    keeps the norm's input and drops its output; moe_act drops the activation's extra tensors."""
    if args.recompute_granularity != "selective":
        return terms
    modules = set(args.recompute_modules or ["core_attn"])

    def dropped(t: Term) -> bool:
        return (("core_attn" in modules and t.module == "core_attn" and t.name not in ATTENTION_INPUTS)
                or ("mlp" in modules and t.module == "mlp" and t.name != "fc1 input")
                or ("moe" in modules and t.module in ("moe", "experts", "moe_act") and t.name != "router input")
                or ("moe_act" in modules and t.module == "moe_act")
                or ("layernorm" in modules and t.name in ("qkv input", "fc1 input", "norm mean, rstd", "norm rstd",
                                                          "norm normalized (fp32)")))

    return [t for t in terms if not dropped(t)]


def linear_grad_outputs(shape: ModelShape, moe: bool = False, args=None) -> dict[str, int]:
    """Bytes of the output gradient of each linear layer of one layer, one micro-batch, on one rank: what a
    zero-bubble schedule's W step keeps beside the layer's input (patches/pipeline/wgrad.py). Column-parallel
    layers (qkv, fc1) have s x b x columns / TP; row-parallel ones (proj, fc2) the whole s x b x h, before
    sequence parallel's reduce-scatter. MoE: the routed tokens through the experts' fc1 and fc2."""
    s, b, h, tp = shape.seq // shape.cp, shape.micro_batch, shape.hidden, shape.tp
    width = BYTES[shape.dtype]
    out = {"qkv": s * b * (shape.heads + 2 * shape.kv_heads) * shape.head_dim // tp * width,
           "proj": s * b * h * width}
    glu = 2 if shape.swiglu else 1
    if moe:
        tokens = routed_tokens(shape, args)
        out["fc1"] = tokens * shape.moe_ffn // shape.etp * glu * width
        out["fc2"] = tokens * h * width
        if shape.shared_ffn:
            out["fc1"] += s * b * shape.shared_ffn // tp * glu * width
            out["fc2"] += s * b * h * width
    else:
        out["fc1"] = s * b * shape.ffn // tp * glu * width
        out["fc2"] = s * b * h * width
    return out
