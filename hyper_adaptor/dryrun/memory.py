"""Each rank's device memory for a Megatron command line, by part, without building the model.

One function per part, each counting bytes on one rank (``shape`` is a ModelShape, ``args`` the checked
namespace). The parts and their assumptions are listed in docs/features/dry-run.md; in short:

* parameters, gradients, main_parameters, optimizer_state: the model state, from the per-rank parameter
  tensors (shape.py) and the wrappers that hold it: megatron's DDP contiguous buffers (padded with the
  distributed optimizer), its mixed-precision optimizer (fp32 main copies), Adam / Muon state, HSDP's
  levels, optimizer offload (what moves to the host is in ``host``);
* activations: what one transformer layer keeps for backward per micro-batch (:func:`layer_terms`, checked
  against torch's saved-tensor hooks on megatron's own layer), less what recompute drops and swap moves,
  times the layers on the rank and the micro-batches the schedule keeps in flight there;
* logits_and_loss, communication_buffers, transient: the last stage's logits, the buffers the collectives
  need beside the model state, and the largest temporary of a backward or of the optimizer step.

``peak`` = the model state + communication buffers + activations + logits_and_loss + transient: the
activations peak at the last forward before the first backward on the rank, when the model state of a
second (or later) step is all allocated (optimizer state exists from the first step on).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from hyper_adaptor.dryrun.layer_tensors import (  # noqa: F401  (SWAP_NAMES, Term: the activation side's names here too)
    SWAP_NAMES,
    Term,
    blockwise_cp,
    layer_terms,
    linear_grad_outputs,
    recomputed,
    routed_tokens,
    swapped_modules,
)
from hyper_adaptor.dryrun.shape import BYTES, ModelShape
from hyper_adaptor.features.base import asked

PARTS = ("parameters", "gradients", "main_parameters", "optimizer_state", "activations", "logits_and_loss",
         "communication_buffers", "transient")
FP32 = 4
ALIGN = 64  # megatron's distributed optimizer starts every parameter at a multiple of 64 elements


@dataclass
class RankMemory:
    rank: int
    parts: dict[str, int]
    host: dict[str, int] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)   # every rank with this prediction (rank is the first)

    @property
    def peak(self) -> int:
        return sum(self.parts.values())


@dataclass
class Prediction:
    ranks: list[RankMemory]      # one per rank
    shape: ModelShape

    def groups(self) -> list[RankMemory]:
        """Ranks with equal predictions together, in rank order (``ranks`` lists the members)."""
        seen: dict[tuple, RankMemory] = {}
        for r in self.ranks:
            key = (tuple(sorted(r.parts.items())), tuple(sorted(r.host.items())))
            if key in seen:
                seen[key].ranks.append(r.rank)
            else:
                seen[key] = RankMemory(r.rank, r.parts, r.host, [r.rank])
        return list(seen.values())


# -- the model state ------------------------------------------------------------------------------------------

def _hsdp(args) -> tuple[int, int]:
    """(HSDP level 0-3, shard group size); level 0 without --use-hsdp."""
    if not asked(args, "use_hsdp", False):
        return 0, 1
    level = int(str(args.hsdp_optimizer_level)[-1])
    size = args.hsdp_shard_size
    return level, (size if size and size > 0 else args.data_parallel_size * args.context_parallel_size)


def _dp_shards(shape: ModelShape, expert: bool) -> int:
    """The data-parallel group megatron's DDP and distributed optimizer use: DP x CP for the dense
    parameters, the expert data-parallel size for the experts."""
    return shape.edp if expert else shape.dp * shape.cp


def buffer_numel(shape: ModelShape, args, rank: int, expert: bool) -> int:
    """Elements of megatron's contiguous parameter/gradient buffer on ``rank`` (dense or expert buffer): the
    parameters' sum, or with the distributed optimizer each start aligned to 64 elements and each bucket's end
    to lcm(data-parallel size, 128). Buckets: one, or ``--ddp-bucket-size`` elements (default
    max(4e7, 1e6 x DP)) with --overlap-grad-reduce."""
    numels = [n for part, n in shape.tensors_on(rank) if (part == "experts") == expert]
    if not args.use_distributed_optimizer:
        return sum(numels)
    dp = _dp_shards(shape, expert)
    bucket = None
    if args.overlap_grad_reduce:
        bucket = args.ddp_bucket_size or max(40_000_000, 1_000_000 * dp)
    end_divisor = math.lcm(dp, 128)
    total = start = 0
    for n in reversed(numels):  # megatron fills the buffer in backward order
        total = -(-total // ALIGN) * ALIGN + n
        if bucket is not None and total - start >= bucket:
            total = start = -(-total // end_divisor) * end_divisor
    return -(-total // end_divisor) * end_divisor if numels else 0


def _dense_and_expert(shape, args, rank) -> list[tuple[int, int]]:
    """[(buffer elements, data-parallel shards)] for the dense and, with MoE, the expert buffer."""
    out = [(buffer_numel(shape, args, rank, False), _dp_shards(shape, False))]
    if shape.num_experts:
        out.append((buffer_numel(shape, args, rank, True), _dp_shards(shape, True)))
    return out


def parameters(shape: ModelShape, args, rank: int) -> int:
    """The model's parameters in their dtype (bf16 / fp16 with --bf16 / --fp16: megatron builds them in it).
    With the distributed optimizer they live in DDP's padded parameter buffer. HSDP level 3 keeps a 1/shard
    slice, and the root unit gathered through forward and backward (the layer in backward is in ``transient``,
    the next one's gather in ``communication_buffers``). Full recompute adds nothing here: a forward rerun
    inside backward starts no forward prefetch (parallel/hsdp/_state.py ``in_a_backward``), so no layer
    whose backward is done is gathered again, and the rebuilt layer stays gathered into its own backward,
    the layer ``transient`` counts."""
    level, shard = _hsdp(args)
    width = BYTES[shape.dtype]
    if level == 3:
        # the chunk's root unit (embeddings, final norm, output layer: all but the transformer layers) stays
        # gathered from its forward to its backward (patches/hsdp/data_parallel.py), so at the peak it is whole
        # beside its shard
        total = sum(n for _, n in shape.tensors_on(rank))
        root = total - sum(n for i in shape.layers_on(rank) for _, n in shape.layer_tensors(i))
        return total * width // shard + root * width
    return sum(n for n, _ in _dense_and_expert(shape, args, rank)) * width


def grad_bytes(shape: ModelShape, args) -> int:
    """Bytes of one gradient element in DDP's buffer: fp32 with --accumulate-allreduce-grads-in-fp32 (megatron
    sets it for bf16) or fp32 parameters, else the parameters' dtype."""
    if shape.dtype == "fp32" or args.accumulate_allreduce_grads_in_fp32:
        return FP32
    return BYTES[shape.dtype]


def gradients(shape: ModelShape, args, rank: int) -> int:
    """megatron DDP's contiguous gradient buffer (``main_grad``), allocated when the model is wrapped and kept
    for the whole run; HSDP level 1 keeps whole gradients, levels 2 and 3 a 1/shard slice (whole and unreduced
    while micro-batches accumulate)."""
    level, shard = _hsdp(args)
    if level:
        count = sum(n for _, n in shape.tensors_on(rank))
        if level >= 2 and shape.num_micro_batches > 1:
            # megatron's no_sync keeps every micro-batch's backward but the last one's local (patches/hsdp): the
            # full parameters' gradients accumulate unreduced, in their dtype, and are reduced to the shards only
            # during the last backward; its start (the peak) holds them whole and no shard yet
            return count * BYTES[shape.dtype]
        width = BYTES[asked(args, "hsdp_reduce_dtype", None) or shape.dtype] \
            if asked(args, "hsdp_reduce_dtype", None) in BYTES else grad_bytes(shape, args)
        return count * width // (shard if level >= 2 else 1)
    return sum(n for n, _ in _dense_and_expert(shape, args, rank)) * grad_bytes(shape, args)


def _offload_fraction(args) -> float:
    return args.optimizer_offload_fraction if asked(args, "optimizer_cpu_offload", False) else 0.0


def _state_elements(shape, args, rank) -> int:
    """Elements the optimizer updates on ``rank``: every parameter, or this rank's shard of the buffers
    (distributed optimizer: buffer / DP shards; HSDP: parameters / shard size)."""
    level, shard = _hsdp(args)
    if level:
        return -(-sum(n for _, n in shape.tensors_on(rank)) // shard)
    if args.use_distributed_optimizer:
        return sum(n // dp for n, dp in _dense_and_expert(shape, args, rank))
    return sum(n for _, n in shape.tensors_on(rank))


def main_parameters(shape: ModelShape, args, rank: int) -> int:
    """fp32 master copies the mixed-precision optimizer keeps beside bf16 / fp16 parameters (megatron's
    Float16OptimizerWithFloat16Params; the distributed optimizer and HSDP keep only this rank's shard). None
    for fp32 parameters, nor with --use-precision-aware-optimizer. The offloaded fraction is on the host."""
    if shape.dtype == "fp32" or asked(args, "use_precision_aware_optimizer", False):
        return 0
    if args.use_distributed_optimizer and not _hsdp(args)[0]:
        # megatron's distributed optimizer keeps its fp32 main shards on the device whatever is offloaded: the
        # offload engine steps them from host masters (patches/memory/optimizer.py releases only the bf16 / fp16
        # optimizer's copies)
        return _state_elements(shape, args, rank) * FP32
    return round(_state_elements(shape, args, rank) * FP32 * (1 - _offload_fraction(args)))


def _muon_elements(shape, rank) -> int:
    """Parameters Muon updates: the 2-D weights of the transformer layers (not embeddings, output, norms)."""
    return sum(n for part, n in shape.tensors_on(rank) if part in ("attention", "mlp", "experts", "shared_experts")
               and n >= shape.hidden * 2)


def optimizer_state(shape: ModelShape, args, rank: int) -> int:
    """Adam: exp_avg and exp_avg_sq (fp32 unless --exp-avg-dtype / --exp-avg-sq-dtype) per element the rank
    updates; Muon: one momentum for the matrices it updates, Adam's two for the rest. Sharded as
    main_parameters; the offloaded fraction is on the host."""
    return round(_full_optimizer_state(shape, args, rank) * (1 - _offload_fraction(args)))


def _full_optimizer_state(shape, args, rank) -> int:
    elements = _state_elements(shape, args, rank)
    avg = BYTES.get(asked(args, "exp_avg_dtype", "fp32"), FP32)
    avg_sq = BYTES.get(asked(args, "exp_avg_sq_dtype", "fp32"), FP32)
    if args.optimizer == "muon":
        total = sum(n for _, n in shape.tensors_on(rank))
        muon = elements * _muon_elements(shape, rank) // max(total, 1)
        state = muon * FP32 + (elements - muon) * (avg + avg_sq)
    elif args.optimizer == "sgd":
        state = elements * FP32 if args.sgd_momentum else 0
    else:
        state = elements * (avg + avg_sq)
    return state


def host_memory(shape: ModelShape, args, rank: int, activations_host: int) -> dict[str, int]:
    """Host bytes: the offloaded optimizer state, fp32 masters (the host engine keeps an fp32 master of
    every offloaded element) and their fp32 gradients, the host step's temporaries, and the activations swapped
    out."""
    host = {}
    fraction = _offload_fraction(args)
    if fraction:
        host["optimizer_state"] = round(_full_optimizer_state(shape, args, rank) * fraction)
        host["main_parameters"] = round(_state_elements(shape, args, rank) * FP32 * fraction)
        # each host master's fp32 gradient (the device gradient is copied into it), and the host optimizer's
        # per-tensor temporaries (torch's Adam on the CPU: two of the largest tensor)
        host["gradients"] = host["main_parameters"]
        host["transient"] = 2 * max((n for _, n in shape.tensors_on(rank)), default=0) * FP32
    if activations_host:
        host["activations"] = activations_host
    return host


def communication_buffers(shape: ModelShape, args, rank: int) -> int:
    """Buffers the collectives hold beside the model state: HSDP's gather and reduce buckets (two of
    --hsdp-bucket-size-kb; on a CPU at levels 1 and 2 the pool's blocks of a collective fused over every unit);
    the pipeline's received activation and gradient (s x b x h each); the sequence-
    parallel all-gather buffer megatron keeps (s x b x h). megatron DDP reduces inside its gradient buffer."""
    width = BYTES[shape.dtype]
    sbh = shape.seq // shape.cp * shape.micro_batch * shape.hidden * width
    total = 0
    level, shard = _hsdp(args)
    if level:
        bucket_kb = asked(args, "hsdp_bucket_size_kb", 0) or 0
        largest = max((sum(n for _, n in shape.layer_tensors(i)) for i in shape.layers_on(rank)), default=0)
        bucket = min(int(bucket_kb * 1024), largest * width) if bucket_kb > 0 else largest * width
        if asked(args, "device", "cpu") == "cpu" and level < 3:
            # on a CPU, HSDP's buffer pool (parallel/hsdp/_pool.py) keeps the two largest blocks a step took, and
            # levels 1 and 2 take one for a collective fused over every unit, of up to --hsdp-bucket-size-kb: level
            # 1's reduction at the end of backward (and gloo's receive of S - 1 of its S chunks), level 2's
            # gather of the updated parameters before the first forward (and one layer's reduction)
            tensors = [n for _, n in shape.tensors_on(rank)]
            fused = sum(tensors) * width
            if bucket_kb == 0:
                fused = max(tensors, default=0) * width
            elif bucket_kb > 0:
                fused = min(fused, int(bucket_kb * 1024))
            total += fused + (fused * (shard - 1) // shard if level == 1 else bucket)
        else:
            total += 2 * bucket  # a bucket holds at most one layer's parameters (buckets do not span modules)
    if shape.pp > 1:
        total += 2 * sbh
    if shape.sp and shape.tp > 1:
        total += sbh
    return total


# -- activations ----------------------------------------------------------------------------------------------

def inflight(shape: ModelShape, args, rank: int) -> tuple[list[int], int]:
    """(micro-batches in flight per model chunk of ``rank`` at its peak, those kept until the weight gradient
    beyond them). megatron's own schedules: PP 1 runs one micro-batch at a time; 1F1B keeps PP - r; its
    interleaved schedule keeps min(2 (PP - r - 1) + (VPP - 1) PP + 1, V x m) chunk-forwards, spread over the
    chunks. The adaptor's --pipeline-schedule: the simulator's peak count (timeline.inflight_peaks)."""
    m = shape.num_micro_batches
    r = shape.rank_coords(rank)["pp"]
    chunks = len(shape.chunks_on(rank))
    if shape.pp == 1:
        return [1] * chunks, 0
    if shape.schedule:
        from hyper_adaptor.parallel.pipeline import schedules

        c = None if shape.schedule in ("gpipe", "1f1b", "zbh1") else (2 if shape.schedule == "zbv" else shape.vpp)
        lists = _steady_lists(shape.schedule, shape.pp, schedules.steady_micro(shape.schedule, shape.pp, m), c)
        kept_bytes = pending_bytes = 0  # one micro-batch through all the rank's chunks, kept / waiting for W
        for index in shape.layers_on(rank):
            dev, _, wgrad = _layer_bytes(shape, args, index, 0)
            kept_bytes, pending_bytes = kept_bytes + dev, pending_bytes + wgrad
        total, extra = _at_backward_peak(lists[r], kept_bytes // chunks, pending_bytes // chunks)
    elif chunks == 1:
        return [min(shape.pp - r, m)], 0
    else:
        total, extra = min(2 * (shape.pp - r - 1) + (chunks - 1) * shape.pp + 1, chunks * m), 0
    per = [total // chunks + (1 if i < total % chunks else 0) for i in range(chunks)]
    return per, extra


@functools.lru_cache(maxsize=256)
def _steady_lists(name: str, pp: int, micro: int, chunks: int | None):
    """The schedule's per-rank lists at a count with the same in-flight peaks (the engine's ``steady_micro``),
    cached: a planner asks for the same ones for every candidate of a layout."""
    from hyper_adaptor.parallel.pipeline import schedules

    return schedules.build(name, pp, micro, chunks)[1]


def _at_backward_peak(steps, kept_bytes: int, pending_bytes: int) -> tuple[int, int]:
    """(micro-batch chunks whose forward is kept, those whose input gradient is done but weight gradient is not)
    as a backward (B or I) step begins, at the step where kept x ``kept_bytes`` + pending x ``pending_bytes`` is
    highest. A forward's activations live until its B / I step; a zero-bubble W step's operands until the W step."""
    from hyper_adaptor.parallel.pipeline.actions import MetaStepType as T

    kept = pending = 0
    best, most = (0, 0), -1
    for step in steps:
        for half in step.halves():
            t = half.step_type
            if t in (T.BWD, T.BWD_INPUT) and kept * kept_bytes + pending * pending_bytes > most:
                best, most = (kept, pending), kept * kept_bytes + pending * pending_bytes
            kept += 1 if t is T.FWD else -1 if t in (T.BWD, T.BWD_INPUT) else 0
            pending += 1 if t is T.BWD_INPUT else -1 if t is T.BWD_WEIGHT else 0
    return best


def _split_weight(shape: ModelShape) -> bool:
    """The rank's linear layers defer their weight gradients to W steps (the adaptor's zero-bubble schedules)."""
    return shape.schedule in ("zbh1", "zbv") and shape.pp > 1


def _layer_bytes(shape, args, index, position) -> tuple[int, int, int]:
    """(device bytes, host bytes, weight-gradient bytes) one micro-batch of global layer ``index`` keeps."""
    terms = recomputed(args, layer_terms(shape, args, bool(shape.moe_pattern[index])))
    swapped = swapped_modules(args, position)
    least = asked(args, "min_offloaded_tensor_size", 1024 * 1024) or 0
    device = host = 0
    for t in terms:
        if t.module in swapped and t.nbytes >= least:
            host += t.nbytes
        else:
            device += t.nbytes
    # a W step's operands: each linear layer's input and output gradient
    wgrad = sum(t.nbytes for t in terms if t.linear_input)
    if _split_weight(shape):
        wgrad += sum(linear_grad_outputs(shape, bool(shape.moe_pattern[index]), args).values())
    return device, host, wgrad


def activations(shape: ModelShape, args, rank: int) -> tuple[int, int]:
    """(device, host) bytes of the activations kept for backward at the rank's peak: per chunk, each layer's
    bytes x the micro-batches in flight; full recompute keeps only the checkpointed layers' inputs (uniform:
    one per --recompute-num-layers group; block: the first --recompute-num-layers layers of each chunk) and
    one group's activations rebuilt during its backward (under a zero-bubble schedule also the rebuilt linear
    inputs and output gradients the W steps wait for: the waiting micro-batches' and, as the chunk's first group
    is rebuilt, its later layers'); selective recompute adds what one layer's
    --recompute-modules rebuild during its backward; the adaptor's schedules (--pipeline-schedule) keep each
    micro-batch's stage output until its backward. Swapped tensors count on the host."""
    per_chunk, extra = inflight(shape, args, rank)
    width = BYTES[shape.dtype]
    layer_input = shape.seq // shape.cp * shape.micro_batch * shape.hidden * width // (shape.tp if shape.sp else 1)
    device = host = rebuilt = swapped_back = 0
    full = args.recompute_granularity == "full"
    group = args.recompute_num_layers or 1
    chunks = shape.chunks_on(rank)
    split = _split_weight(shape)
    for number, (chunk, count) in enumerate(zip(chunks, per_chunk, strict=True)):
        queued = 0  # this chunk's checkpointed layers' deferred weight-gradient operands, current micro-batch
        if shape.schedule and shape.pp > 1 and not (shape.is_last_stage(rank) and number == len(chunks) - 1):
            # the adaptor's pipeline engine frees (megatron's pseudo-free) a stage's sent output only when that
            # micro-batch's backward begins, not once sent as megatron's own schedules do
            device += count * layer_input
        for position, index in enumerate(chunk):
            dev, hst, wgrad = _layer_bytes(shape, args, index, position)
            checkpointed = full and (args.recompute_method != "block" or position < group)
            if checkpointed:
                unit = group if args.recompute_method != "block" else 1
                if args.recompute_method != "block":
                    device += count * layer_input * (position % group == 0)
                else:
                    device += count * layer_input
                if split:
                    # a zero-bubble W step needs the linear inputs the recompute rebuilt and the output gradients:
                    # the weight-gradient queue holds them past the layer's backward, for every micro-batch
                    # waiting for its W step and for the layers of this micro-batch already through their I step
                    device += extra * wgrad
                    if position >= unit:
                        queued += wgrad
                rebuilt = max(rebuilt, dev * unit + queued)
                continue
            device += count * dev + extra * wgrad
            host += count * hst
            swapped_back = max(swapped_back, hst)
            if args.recompute_granularity == "selective":  # what one layer's backward rebuilds first
                kept = sum(t.nbytes for t in recomputed(args, layer_terms(shape, args, bool(shape.moe_pattern[index]))))
                rebuilt = max(rebuilt, sum(t.nbytes for t in layer_terms(shape, args, bool(shape.moe_pattern[index])))
                              - kept)
    if shape.is_first_stage(rank) and args.hidden_dropout > 0:
        mask = 1 if asked(args, "device", "cpu") in ("cuda", "npu") else width
        device += per_chunk[0] * layer_input // width * mask  # the embedding's dropout
    if host:
        # on the device at the peak (the first backward): the layer whose forward just ended, not yet swapped
        # out, the one in backward and the --swap-prefetch-layers loaded ahead of it
        layers = len(shape.layers_on(rank))
        device += swapped_back * min(layers, 2 + (asked(args, "swap_prefetch_layers", 1) or 0))
    return device + rebuilt, host


def logits_and_loss(shape: ModelShape, args, rank: int) -> int:
    """On the stage with the loss: the final norm's output (s x b x h, kept by the output layer), megatron's
    cross entropy's fp32 logits (s x b x vocab / TP, kept for backward and turned into their gradient in
    place), and the output layer's own logits in the parameters' dtype while they are cast; per micro-batch
    in flight there (GPipe keeps every micro-batch's, the other schedules one). Zero-bubble schedules: each
    micro-batch whose output layer's weight gradient waits for its W step keeps that layer's input and output
    gradient (s x b x vocab / TP; in fp32 the cross entropy's softmax storage itself)."""
    if not shape.is_last_stage(rank):
        return 0
    width = BYTES[shape.dtype]
    s, b = shape.seq // shape.cp, shape.micro_batch
    logits = s * b * shape.vocab // shape.tp
    per = logits * FP32 + (logits * width if width != FP32 else 0) + s * b * shape.hidden * width
    kept = shape.num_micro_batches if shape.schedule == "gpipe" else 1
    waiting = inflight(shape, args, rank)[1] if _split_weight(shape) else 0
    return per * kept + waiting * (logits + s * b * shape.hidden) * width


def transient(shape: ModelShape, args, rank: int, activations_and_logits: int) -> int:
    """The largest temporary: inside a layer's backward (softmax's backward makes the scores' gradient while the
    probabilities' gradient is alive, or fc1's output gradient twice; plus the layer input's and output's
    gradients; under a zero-bubble schedule the output gradients of the layer's projection and MLP, kept for
    its W step while the attention's backward runs), HSDP level 3's gathered layer, or the
    optimizer step's temporaries (cpu: per tensor, twice the largest; cuda / npu: torch's foreach Adam, one
    fp32 tensor per updated element) beyond the activations then freed."""
    width = BYTES[shape.dtype]
    s, b = shape.seq // shape.cp, shape.micro_batch
    scores = b * shape.heads // shape.tp * s * (s if blockwise_cp(shape, args) else shape.seq) * width
    fc1 = s * b * shape.ffn // shape.tp * (2 if shape.swiglu else 1) * width
    if shape.num_experts:
        fc1 = max(fc1, routed_tokens(shape, args) * shape.moe_ffn // shape.etp * (2 if shape.swiglu else 1) * width)
    backward = 2 * max(scores, fc1) + 2 * s * b * shape.hidden * width
    if _split_weight(shape) and shape.layers_on(rank):
        backward += max(sum(g for name, g in linear_grad_outputs(shape, bool(shape.moe_pattern[i]), args).items()
                            if name != "qkv") for i in shape.layers_on(rank))
    level, _ = _hsdp(args)
    if level == 3 and shape.layers_on(rank):
        backward += max(sum(n for _, n in shape.layer_tensors(i)) for i in shape.layers_on(rank)) * width
    tensors = [n for _, n in shape.tensors_on(rank)]
    if asked(args, "device", "cpu") == "cpu":
        step = 2 * max(tensors, default=0) * FP32
    else:
        step = _state_elements(shape, args, rank) * FP32
    return max(backward, step - activations_and_logits)


def predict(args) -> Prediction:
    """Each rank's device memory by part (PARTS), and its host memory, for a namespace from ``parse``."""
    shape = ModelShape.from_args(args)
    ranks = []
    cache = {}
    for rank in range(shape.world):
        c = shape.rank_coords(rank)
        key = (c["pp"], c["ep"])  # TP / CP / DP ranks hold the same sizes; PP and EP change them
        if key not in cache:
            device_act, host_act = activations(shape, args, rank)
            logits = logits_and_loss(shape, args, rank)
            parts = {
                "parameters": parameters(shape, args, rank),
                "gradients": gradients(shape, args, rank),
                "main_parameters": main_parameters(shape, args, rank),
                "optimizer_state": optimizer_state(shape, args, rank),
                "activations": device_act,
                "logits_and_loss": logits,
                "communication_buffers": communication_buffers(shape, args, rank),
                "transient": transient(shape, args, rank, device_act + logits),
            }
            cache[key] = (parts, host_memory(shape, args, rank, host_act))
        parts, host = cache[key]
        ranks.append(RankMemory(rank, dict(parts), dict(host), [rank]))
    return Prediction(ranks, shape)
