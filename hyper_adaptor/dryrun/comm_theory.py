"""The communication volume of each engine, as the benches' theory columns state it, for the step-time model.

The benches (bench/_tp_contenders.py, bench/_cp_analysis.py, bench/expert_parallel.py, bench/_tp_contenders.py
and bench/_hsdp_contenders.py) are not part of the installed package and import torch and their contenders:
their formulas are restated here in the dry-run's terms (a :class:`hyper_adaptor.dryrun.workload.Dims`: the
run's :class:`hyper_adaptor.dryrun.shape.ModelShape` with its element sizes), with the number of collectives
each makes; tests/unit/test_dryrun_timing.py checks each
against the bench's own function. Bytes are "sent": what one rank sends (an all-reduce of N bytes over t ranks
sends 2 (t - 1) / t N).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hyper_adaptor.dryrun.workload import Dims


class TimingError(ValueError):
    """A layout the step-time model cannot price (the message names the flag)."""


def tp_sent_bytes(d: Dims, layers: int, first: bool, last: bool) -> dict:
    """Bytes one rank sends for TP in one micro-batch over ``layers`` layers of a stage, forward and backward,
    with the collectives made: bench/_tp_contenders.py ``theory_tp_bytes`` (megatron's vocab-parallel loss: no
    gathered logits) plus ``theory_megatron_sp_regather_bytes`` under sequence parallel."""
    out = {"forward": 0.0, "backward": 0.0, "calls_forward": 0, "calls_backward": 0}
    if d.tp == 1:
        return out
    activation = d.elem * d.micro_batch * (d.seq / d.cp) * d.hidden
    reduction = 2 * (d.tp - 1) * activation / d.tp
    per = 2 if d.sp else 1                      # an all-reduce, or a reduce-scatter and an all-gather
    # per layer two reductions each way (attention's and the MLP's); the embedding's forward and the output
    # layer's backward reduction at the ends
    out["forward"] = (2 * layers + int(first)) * reduction
    out["backward"] = (2 * layers + int(last)) * reduction
    out["calls_forward"] = per * (2 * layers + int(first)) + 3 * int(last)  # + the loss's [b, s] reductions
    out["calls_backward"] = per * (2 * layers + int(last))
    if d.sp:
        out["backward"] += (2 * layers + int(last)) * (d.tp - 1) * activation / d.tp
        out["calls_backward"] += 2 * layers + int(last)
    return out


def cp_sent_bytes(algo: str, d: Dims, ulysses_degree: int = 2) -> dict:
    """Bytes one rank sends per layer and micro-batch for CP ``algo`` (bench/_cp_analysis.py ``theory``, at
    this run's element size; the ring's travelling dK / dV accumulators stay fp32), with the calls made."""
    n = d.cp
    s, b, nh, ng, hn = d.seq / n, d.micro_batch, d.heads / d.tp, max(d.kv_heads / d.tp, 1), d.head_dim
    zero = {"forward": 0.0, "backward": 0.0, "calls_forward": 0, "calls_backward": 0}
    if n == 1:
        return zero
    q = s * b * nh * hn * d.elem
    if algo == "ulysses":
        kv = s * b * _kv_heads_for(ng, n) * hn * d.elem
        each = (n - 1) * (2 * q + 2 * kv) / n
        return {"forward": each, "backward": each, "calls_forward": 4, "calls_backward": 4}
    if algo == "allgather":
        kv = s * b * ng * hn * d.elem
        return {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv, "calls_forward": 2, "calls_backward": 2}
    if algo == "ring":
        u, g, ulysses_each = 1, n, 0.0
        kv = s * b * ng * hn * d.elem
    elif algo == "hybrid":
        u, g = ulysses_degree, n // ulysses_degree
        kv = s * b * _kv_heads_for(ng, u) * hn * d.elem
        ulysses_each = (u - 1) * (2 * q + 2 * kv) / u
    else:
        raise TimingError(f"--context-parallel-algo: no communication model for {algo!r}")
    kv_fp32 = kv * 4 / d.elem
    a2a = 4 if u > 1 else 0
    return {"forward": ulysses_each + (g - 1) * 2 * kv,
            "backward": ulysses_each + (g - 1) * 2 * kv + g * 2 * kv_fp32,
            "calls_forward": a2a + (g - 1), "calls_backward": a2a + 2 * g}


def _kv_heads_for(ng: float, degree: int) -> float:
    """KV heads a Ulysses rank holds before its split: ng repeated degree / gcd(ng, degree) times."""
    ng_int = max(int(round(ng)), 1)
    return ng_int * (degree // math.gcd(ng_int, degree))


def ep_sent_bytes(d: Dims, dispatcher: str) -> tuple[float, int]:
    """(bytes one rank sends per MoE layer and micro-batch, forward and backward, collectives). all-to-all
    (megatron's alltoall dispatcher and hyper_adaptor's engine): bench/expert_parallel.py
    ``engine_theory_bytes`` with evenly routed rows; megatron's allgather dispatcher gathers the tokens of the
    expert group and reduce-scatters them back."""
    if d.ep == 1:
        return 0.0, 0
    t = d.micro_batch * d.seq / d.cp
    if dispatcher == "allgather":
        tokens = t * d.ep * d.etp / d.tp
        return 4 * (d.ep - 1) / d.ep * tokens * d.hidden * d.elem, 4
    rows = t * d.topk * d.etp / d.tp * (d.ep - 1) / d.ep    # sent = received, in expectation
    return 2 * (2 * rows) * d.hidden * d.elem + d.num_experts * 8 * (d.ep - 1) / d.ep, 5


def dp_sent_bytes(mode: str, params: float, n: int, grad_bytes: int, param_bytes: int) -> float:
    """Bytes one rank sends per step to reduce ``params`` gradients over ``n`` data-parallel ranks
    (bench/_tp_contenders.py ``theory_dp_bytes``, at the run's element sizes): DDP all-reduces (2Ψ); the
    distributed optimizer and HSDP reduce-scatter gradients and all-gather parameters (Ψ each; level 3
    gathers parameters twice: 3Ψ, bench/_hsdp_contenders.py ``theory_comm_bytes``)."""
    if n <= 1:
        return 0.0
    share = (n - 1) / n
    if mode == "ddp":
        return 2 * params * grad_bytes * share
    if mode == "hsdp-level3":
        return params * (grad_bytes + 2 * param_bytes) * share
    return params * (grad_bytes + param_bytes) * share
