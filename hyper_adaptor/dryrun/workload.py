"""What one training step of a Megatron command line computes, per rank and micro-batch, before any machine
prices it: the model and layout as the cost model reads them (:class:`Dims`), each layer's matmuls and FLOPs, the
elementwise and loss traffic in bytes, and the local-spec GPT the calibration's real steps run
(:func:`plain_gpt`). :mod:`hyper_adaptor.dryrun.timing` turns these into seconds on a calibration;
:mod:`hyper_adaptor.dryrun.step_fit` compares them with measured steps."""

from __future__ import annotations

import dataclasses

from hyper_adaptor.dryrun.shape import BYTES, ModelShape

TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclasses.dataclass(frozen=True)
class Dims(ModelShape):
    """A :class:`ModelShape` (the one description of the model and its layout) with what only the cost model
    needs on top: the gradients' element size, and figures derived from the shape's fields."""

    grad_bytes: int = 4

    @property
    def elem(self) -> int:
        """Bytes of a parameter or activation element."""
        return BYTES[self.dtype]

    @property
    def matmul_dtype(self) -> str:
        """The dtype's name in the calibration's matmul tables."""
        return TORCH_DTYPES[self.dtype]

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: VPP, or the two arms of the V under ZBV."""
        return 2 if self.schedule == "zbv" else self.vpp

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and bool(self.moe_pattern[layer % len(self.moe_pattern)])

    @classmethod
    def from_shape(cls, shape: ModelShape, args=None) -> Dims:
        """``shape`` with the gradients' element size: fp32 unless the parameters are 16-bit and megatron
        reduces them as they are (HSDP: its --hsdp-reduce-dtype)."""
        fp32_grads = shape.dtype == "fp32" or bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False))
        if getattr(args, "use_hsdp", False) and getattr(args, "hsdp_reduce_dtype", None):
            fp32_grads = args.hsdp_reduce_dtype in ("fp32", "float32")
        fields = {f.name: getattr(shape, f.name) for f in dataclasses.fields(ModelShape)}
        return cls(**fields, grad_bytes=4 if fp32_grads else 2)


# ------------------------------------------------------------------------------------------ FLOPs, bytes
def layer_matmuls(d: Dims, moe: bool) -> dict[str, tuple[float, float, float, float]]:
    """The forward matmuls of one layer and micro-batch on one rank: name -> (m, k, n, count)."""
    t = d.micro_batch * d.seq / d.cp                  # tokens of this rank (CP splits the sequence)
    mm = {
        "qkv": (t, d.hidden, (d.q_dim + 2 * d.kv_dim) / d.tp, 1),
        # every query of this rank against the whole sequence's keys, then the values; heads split by TP
        "scores": (d.seq / d.cp, d.head_dim, d.seq, d.micro_batch * d.heads / d.tp),
        "values": (d.seq / d.cp, d.seq, d.head_dim, d.micro_batch * d.heads / d.tp),
        "proj": (t, d.q_dim / d.tp, d.hidden, 1),
    }
    up = 2 if d.swiglu else 1
    if not moe:
        mm["fc1"] = (t, d.hidden, up * d.ffn / d.tp, 1)
        mm["fc2"] = (t, d.ffn / d.tp, d.hidden, 1)
        return mm
    # routed rows land evenly on the experts: the expert group's tokens x top-k over its EP x ETP ranks;
    # this rank's share of the rows is t x k / TP (TP ranks hold the same tokens), each expert's FFN / ETP
    local_experts = d.num_experts / d.ep
    rows = t * d.topk * d.etp / d.tp / local_experts
    mm["router"] = (t, d.hidden, d.num_experts, 1)
    mm["expert_fc1"] = (rows, d.hidden, up * d.moe_ffn / d.etp, local_experts)
    mm["expert_fc2"] = (rows, d.moe_ffn / d.etp, d.hidden, local_experts)
    if d.shared_ffn:
        mm["shared_fc1"] = (t, d.hidden, up * d.shared_ffn / d.tp, 1)
        mm["shared_fc2"] = (t, d.shared_ffn / d.tp, d.hidden, 1)
    return mm


def logits_matmul(d: Dims) -> tuple[float, float, float, float]:
    return (d.micro_batch * d.seq / d.cp, d.hidden, d.vocab / d.tp, 1)


def flops(mm: dict) -> dict[str, float]:
    return {name: 2.0 * m * k * n * c for name, (m, k, n, c) in mm.items()}


def layer_flops(d: Dims, moe: bool = False) -> float:
    """Forward FLOPs of one layer and micro-batch on one rank (backward: twice as many)."""
    return sum(flops(layer_matmuls(d, moe)).values())


def elementwise_bytes(d: Dims, moe: bool) -> float:
    """Forward memory traffic of one layer's elementwise work on one rank: two norms (read + write), two
    dropout-and-residual adds (about five passes each), the activation over the FFN width, rotary on Q and K,
    and the attention probabilities' scale, mask, softmax and dropout (about seven passes)."""
    t = d.micro_batch * d.seq / d.cp
    rows = t / d.tp if d.sp else t
    act = (d.topk * d.moe_ffn / d.tp + d.shared_ffn / d.tp) if moe else d.ffn / d.tp
    probs = d.micro_batch * d.heads / d.tp * (d.seq / d.cp) * d.seq
    return d.elem * (14 * rows * d.hidden + 3 * t * act + 4 * t * (d.q_dim + d.kv_dim) / d.tp + 7 * probs)


def raw_matmul_time(cal, d: Dims, mm: dict) -> float:
    """Seconds of the matmuls ``mm`` ({name: (m, k, n, count)}) at the calibration's micro-benchmark rates."""
    return sum(cal.matmul_time(m, k, n, d.matmul_dtype, c) for m, k, n, c in mm.values())


def loss_bytes(d: Dims) -> float:
    """The loss's traffic per micro-batch each way: softmax over the vocabulary shard, read and written a few
    times (fp32)."""
    return 6 * d.micro_batch * d.seq / d.cp * d.vocab / d.tp * 4


def plain_gpt(hidden: int, heads: int, seq: int, layers: int, micro_batch: int, vocab: int) -> Dims:
    """The Dims of megatron-core's local-spec GPT on one rank, fp32 (the calibration's steps): LayerNorm,
    GELU MLP of 4 x hidden, learned positions, biases, tied embeddings."""
    return Dims(hidden=hidden, ffn=4 * hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
                layers=layers, seq=seq, micro_batch=micro_batch, global_batch=micro_batch, vocab=vocab,
                swiglu=False, normalization="LayerNorm", untied=False, position_embedding="learned_absolute",
                max_positions=seq, bias=True, qkv_bias=True, qk_layernorm=False, num_experts=0, topk=0, moe_ffn=0,
                shared_ffn=0, shared_gate=False, moe_pattern=(0,) * layers, grouped_gemm=False, dtype="fp32")


def unscaled_work(cal, d: Dims, layers: int, micro: int) -> tuple[float, float]:
    """(matmul seconds, elementwise seconds) of a one-stage step of ``layers`` dense layers and ``micro``
    micro-batches at the micro-benchmarks' rates: forward, input and weight gradients (3 x the forward
    matmuls, the logits' included), 3 x a layer's forward elementwise passes, the loss each way and the
    embedding's weight gradient — what ``timing``'s stage cost sums before its scales."""
    matmul = 3 * micro * (layers * raw_matmul_time(cal, d, layer_matmuls(d, False))
                          + raw_matmul_time(cal, d, {"logits": logits_matmul(d)}))
    embedding = 2 * d.micro_batch * d.seq * d.hidden * d.elem
    elementwise = micro * (3 * layers * elementwise_bytes(d, False) + 2 * loss_bytes(d) + embedding) \
        / cal.memory_bytes_per_s
    return matmul, elementwise


__all__ = ["TORCH_DTYPES", "Dims", "layer_matmuls", "logits_matmul", "flops", "layer_flops", "elementwise_bytes",
           "loss_bytes", "raw_matmul_time", "plain_gpt", "unscaled_work"]
