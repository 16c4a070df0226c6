"""``python -m hyper_adaptor dry-run <megatron flags> --world-size N [--device-memory GiB] [--device D]``.

One row per group of ranks with the same prediction, a column per part in MiB and the peak; for an MoE model a
note on the routing the activations assume (balanced, ``--moe-token-imbalance F``, or megatron's capacity) and,
dropless, what each +10 % of tokens on the busiest expert-parallel rank adds to its peak; then whether
the largest rank fits ``--device-memory`` and, if not, which part to cut and with which flags (exit status 1
when it does not fit, 2 on bad input). Then the predicted step time by part (``timing.py``) and the
calibration it rests on: this machine's, measured once and cached (the line before the measurement says so:
it takes about a minute on a small CPU), or, for an accelerator this machine lacks, nominal figures labelled
as assumed. ``--no-time`` leaves the time out and measures nothing.
"""

from __future__ import annotations

import copy
import sys

from hyper_adaptor.dryrun import calibrate
from hyper_adaptor.dryrun.layer_tensors import capacity, imbalance, routed_tokens
from hyper_adaptor.dryrun.memory import PARTS, Prediction, predict
from hyper_adaptor.dryrun.shape import parse
from hyper_adaptor.features.base import asked

MIB = 1024 * 1024
GIB = 1024 * MIB
SHORT = {"parameters": "params", "gradients": "grads", "main_parameters": "main", "optimizer_state": "optim",
         "activations": "activ", "logits_and_loss": "logits", "communication_buffers": "comm",
         "transient": "transient"}


def _ranks(ranks: list[int]) -> str:
    """'rank 3', 'ranks 0-3', 'ranks 0,2,5'."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ",".join(map(str, ranks))


def table(prediction: Prediction) -> list[str]:
    groups = prediction.groups()
    header = ["ranks"] + [SHORT[p] for p in PARTS] + ["peak", "host"]
    rows = []
    for g in groups:
        rows.append([_ranks(g.ranks)] + [f"{g.parts[p] / MIB:.1f}" for p in PARTS]
                    + [f"{g.peak / MIB:.1f}", f"{sum(g.host.values()) / MIB:.1f}"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return [line(header)] + [line(r) for r in rows]


def advice(part: str, args) -> list[str]:
    """Flags that cut ``part``, the ones already given left out."""
    shape_tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    options = {
        "activations": [("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                         args.recompute_granularity == "full"),
                        ("--recompute-granularity selective", args.recompute_granularity is not None),
                        ("--swap-attention", asked(args, "swap_attention", False)),
                        ("--sequence-parallel", args.sequence_parallel or shape_tp == 1),
                        (f"--tensor-model-parallel-size {shape_tp * 2}", False),
                        ("a smaller --micro-batch-size", args.micro_batch_size == 1)],
        "optimizer_state": [("--use-distributed-optimizer", args.use_distributed_optimizer
                             or asked(args, "use_hsdp", False)),
                            ("--optimizer-cpu-offload", asked(args, "optimizer_cpu_offload", False)),
                            (f"--pipeline-model-parallel-size {pp * 2}", False)],
        "main_parameters": [("--use-distributed-optimizer", args.use_distributed_optimizer
                             or asked(args, "use_hsdp", False)),
                            ("--optimizer-cpu-offload", asked(args, "optimizer_cpu_offload", False))],
        "gradients": [("--use-hsdp --hsdp-optimizer-level level2", asked(args, "use_hsdp", False)),
                      (f"--pipeline-model-parallel-size {pp * 2}", False),
                      (f"--tensor-model-parallel-size {shape_tp * 2}", False)],
        "parameters": [("--use-hsdp --hsdp-optimizer-level level3",
                        asked(args, "hsdp_optimizer_level", "") == "level3"),
                       (f"--tensor-model-parallel-size {shape_tp * 2}", False),
                       (f"--pipeline-model-parallel-size {pp * 2}", False)],
        "logits_and_loss": [(f"--tensor-model-parallel-size {shape_tp * 2}", False),
                            ("a smaller --micro-batch-size", args.micro_batch_size == 1)],
        "communication_buffers": [("a smaller --hsdp-bucket-size-kb / --ddp-bucket-size", False)],
        "transient": [("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
                       args.recompute_granularity == "full"),
                      (f"--tensor-model-parallel-size {shape_tp * 2}", False)],
    }
    return [flag for flag, given in options[part] if not given]


def moe_routing(prediction: Prediction, args) -> list[str]:
    """What the MoE activations assume about routing, as notes: dropless MoE, the tokens each expert-parallel
    rank's experts get a micro-batch (balanced, or --moe-token-imbalance F x that) and what each +10 % of them
    on the busiest rank adds to its peak; under --moe-expert-capacity-factor the cap (exact when padded)."""
    shape = prediction.shape
    if not shape.num_experts or not any(shape.moe_pattern):
        return []
    tokens = routed_tokens(shape, args)
    s, b = shape.seq // shape.cp, shape.micro_batch
    factor = imbalance(args)
    cap = capacity(shape, args)
    if cap is not None:
        padded = asked(args, "moe_pad_expert_input_to_capacity", False)
        given = asked(args, "moe_token_imbalance", None) is not None
        how = ("exactly that, padded" if padded else f"{factor:g} x balanced routing's {s * b * shape.topk} below "
               "the cap (--moe-token-imbalance)" if given else "the cap: the busiest rank's bound, balanced routing "
               f"gives {s * b * shape.topk}")
        return [f"note: MoE tokens capped by --moe-expert-capacity-factor {args.moe_expert_capacity_factor:g} at "
                f"{cap} per expert from each rank: each expert-parallel rank's experts are predicted to get {tokens} "
                f"tokens per micro-batch and MoE layer ({how})"]
    worst = max(prediction.ranks, key=lambda r: r.peak)
    more_tokens = copy.copy(args)
    more_tokens.moe_token_imbalance = factor * 1.1
    more = predict(more_tokens).ranks[worst.rank].peak - worst.peak
    said = ("balanced routing assumed" if factor == 1 else f"--moe-token-imbalance {factor:g}: {factor:g} x "
            f"balanced routing's {s * b * shape.topk}")
    return [f"note: dropless MoE, {said}: each expert-parallel rank's experts get {tokens} tokens per micro-batch "
            f"and MoE layer; each +10 % on the busiest rank adds {more / MIB:.1f} MiB to its peak "
            f"(--moe-token-imbalance F predicts F x; megatron's --moe-expert-capacity-factor caps it)"]


def verdict(prediction: Prediction, args) -> list[str]:
    worst = max(prediction.ranks, key=lambda r: r.peak)
    if args.device_memory is None:
        return [f"largest peak: {worst.peak / GIB:.3f} GiB on rank {worst.rank} (pass --device-memory GiB to check "
                f"a device)"]
    limit = args.device_memory * GIB
    if worst.peak <= limit:
        return [f"fits in {args.device_memory:g} GiB: largest peak {worst.peak / GIB:.3f} GiB on rank {worst.rank}"]
    part = max(PARTS, key=lambda p: worst.parts[p])
    cut = advice(part, args)[:3] or ["more devices or a smaller model"]
    return [f"does not fit in {args.device_memory:g} GiB: rank {worst.rank} needs {worst.peak / GIB:.3f} GiB; "
            f"largest part is {part} ({worst.parts[part] / GIB:.3f} GiB), cut it with {' or '.join(cut)}"]


# ------------------------------------------------------------------------------------------- step time
def calibration(device: str, out) -> calibrate.Calibration:
    """This machine's calibration of ``device``: the cache, or measured now after a line saying so; nominal
    figures for an accelerator this machine does not have (labelled assumed by :func:`source`)."""
    if calibrate.load(device) is None and calibrate.available(device):
        print(f"calibrating this machine's {device} once (about a minute; --no-time skips it), "
              f"cached in {calibrate.cache_path(device)}", file=out, flush=True)
    return calibrate.get(device, allow_nominal=True)


def source(cal: calibrate.Calibration) -> str:
    """Where the figures come from, said plainly: measured here (when, where cached) or assumed."""
    if cal.machine.startswith("nominal"):
        return (f"calibration: ASSUMED, not measured: this machine has no {cal.device} device, so the time rests on "
                f"nominal figures of a typical one (NOMINAL in hyper_adaptor/dryrun/calibrate.py), a rough "
                f"estimate until `python -m hyper_adaptor.dryrun.calibrate --device {cal.device}` runs on such a "
                f"machine")
    text = (f"calibration: measured on this machine ({cal.machine}) at {cal.created or 'an unrecorded time'}, "
            f"cached in {calibrate.cache_path(cal.device)} (python -m hyper_adaptor.dryrun.calibrate "
            f"--recalibrate measures again)")
    if cal.collective_source != "measured":
        text += f"; collectives {cal.collective_source}"
    return text


def time_table(step) -> list[str]:
    """The parts of the step in ms, one column each, and their total."""
    from hyper_adaptor.dryrun.timing import PARTS as TIME_PARTS

    header = [*TIME_PARTS, "total"]
    row = [f"{step.parts[p] * 1e3:.2f}" for p in TIME_PARTS] + [f"{step.total * 1e3:.2f}"]
    widths = [max(len(h), len(c)) for h, c in zip(header, row)]
    return ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in (header, row)]


def step_time(args, shape, out) -> list[str]:
    """The step-time lines of the report; a calibration or a layout the model cannot price is said in one line
    (the memory above stands)."""
    from hyper_adaptor.dryrun.timing import TimingError, predict_time

    try:
        cal = calibration(args.device, out)
        step = predict_time(args, cal, shape)
    except (calibrate.CalibrationError, TimingError, RuntimeError, OSError) as error:
        return [f"step time: not predicted ({error}); --no-time leaves it out"]
    lines = [f"step time (ms; predicted for the slowest pipeline rank, {step.micro_batches} micro-batches):"]
    lines += ["  " + line for line in time_table(step)]
    lines.append(f"bubble: {step.bubble_fraction:.1%} of the pipeline's time ({step.schedule})" if shape.pp > 1
                 else "bubble: none (one pipeline stage)")
    lines += [f"note: {note}" for note in step.notes]
    lines.append(source(cal))
    return lines


def main(flags: list[str], out=None) -> int:
    out = out or sys.stdout
    if any(f in ("-h", "--help") for f in flags):
        print("usage: python -m hyper_adaptor dry-run [megatron and hyper_adaptor flags] --world-size N "
              "[--device-memory GiB] [--device npu|cuda|cpu] [--no-time] [--moe-token-imbalance F]\n\nPredicts each "
              "rank's peak device memory by part (MiB) without building the model, and the step time by part from "
              "this machine's calibration (measured once, then cached; --no-time: memory only, nothing measured); "
              "docs/features/dry-run.md says what each part counts.", file=out)
        return 0
    args = parse(flags)
    prediction = predict(args)
    shape = prediction.shape
    layout = f"TP {shape.tp} x PP {shape.pp}" + (f" (x{shape.vpp} chunks)" if shape.vpp > 1 else "") + \
        f" x CP {shape.cp} x DP {shape.dp}" + (f", EP {shape.ep} (ETP {shape.etp})" if shape.num_experts else "")
    schedule = shape.schedule or ("megatron's 1F1B" if shape.vpp == 1 else "megatron's interleaved 1F1B")
    print(f"dry-run of {shape.world} ranks on {args.device}: {layout}; {shape.dtype}; "
          f"{shape.num_micro_batches} micro-batches of {shape.micro_batch} x {shape.seq} tokens"
          + (f"; {schedule}" if shape.pp > 1 else ""), file=out)
    print("memory per rank (MiB; host = swapped activations and offloaded optimizer state):", file=out)
    for line in table(prediction):
        print("  " + line, file=out)
    for line in moe_routing(prediction, args):
        print(line, file=out)
    for line in verdict(prediction, args):
        print(line, file=out)
    if not args.no_time:
        for line in step_time(args, shape, out):
            print(line, file=out)
    fits = args.device_memory is None or max(r.peak for r in prediction.ranks) <= args.device_memory * GIB
    return 0 if fits else 1
