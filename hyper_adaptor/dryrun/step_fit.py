"""The calibration's real steps against the cost model: how much slower a megatron-core training step's matmuls,
elementwise work and in-step collectives run on this machine than the micro-benchmarks say. The calibration
(:mod:`hyper_adaptor.dryrun.calibrate`) times the steps (:mod:`hyper_adaptor.dryrun.calibrate_worlds`); these
fits turn them into the scales :mod:`hyper_adaptor.dryrun.timing` applies (calibration ``framework``)."""

from __future__ import annotations

import dataclasses
import types

from hyper_adaptor.dryrun.timing import predict_time
from hyper_adaptor.dryrun.workload import plain_gpt, unscaled_work


def fit_compute_scales(cal, steps: list[dict]) -> dict[str, float]:
    """How much slower a training step's matmuls and elementwise work run on this machine than the calibration's
    micro-benchmarks say (which time each matmul alone, operands hot in cache, and count only the elementwise
    passes a layer needs, not the copies, mask fills and zeroing the framework adds: docs/features/dry-run.md,
    "Step time"). ``steps``: one-rank megatron-core GPT steps of two shapes (calibrate_worlds.COMPUTE_SHAPES,
    each dict its shape and measured ``seconds``); per step, measured - the calibrated fixed costs = a x the
    model's matmul seconds + b x its elementwise seconds, solved for (a, b). {} (no scaling) when the two do
    not determine them or give a factor outside [0.5, 20]."""
    fixed = cal.framework
    rows = []
    for step in steps:
        d = plain_gpt(step["hidden"], step["heads"], step["seq"], step["layers"], step["micro_batch"],
                      step["vocab"])
        micro, layers = step["micro"], step["layers"]
        matmul, elem = unscaled_work(cal, d, layers, micro)
        rest = step["seconds"] - (fixed.get("layer_s", 0.0) * layers * micro
                                  + fixed.get("micro_batch_s", 0.0) * micro + fixed.get("step_s", 0.0))
        rows.append((matmul, elem, rest))
    if len(rows) != 2:
        return {}
    (a1, b1, y1), (a2, b2, y2) = rows
    det = a1 * b2 - a2 * b1
    if abs(det) < 1e-12 * max(a1 * b2, a2 * b1, 1e-30):
        return {}
    a, b = (y1 * b2 - y2 * b1) / det, (a1 * y2 - a2 * y1) / det
    if not (0.5 <= a <= 20 and 0.5 <= b <= 20):
        return {}
    return {"matmul_scale": a, "elementwise_scale": b}


def fit_comm_scale(cal, step: dict) -> dict[str, float]:
    """How much longer the collectives inside a training step take than the calibration's idle 2-rank
    micro-benchmark says (a partner still computing, the transport's threads beside the compute): from a 2-rank
    tensor-parallel step (calibrate_worlds.COMM_SHAPE, sequence parallel), measured - everything but the TP
    collectives (the model's, with the compute scales already fitted) = scale x the model's TP collectives.
    {} when it gives a factor outside [0.5, 20]."""
    tp = step.get("tp", 2)
    d = dataclasses.replace(plain_gpt(step["hidden"], step["heads"], step["seq"], step["layers"],
                                      step["micro_batch"], step["vocab"]),
                            tp=tp, sp=True, world=tp, global_batch=step["micro_batch"] * step["micro"])
    predicted = predict_time(types.SimpleNamespace(), cal, d)
    comm = predicted.parts["tp_comm"]
    if comm <= 0:
        return {}
    scale = (step["seconds"] - (predicted.total - comm)) / comm
    return {"comm_scale": scale} if 0.5 <= scale <= 20 else {}


__all__ = ["fit_compute_scales", "fit_comm_scale"]
