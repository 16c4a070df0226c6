"""What bench/context_parallel.py derives from its ranks' figures: the communication theory, the longest
sequence search, the merged rows, the targets and the table."""

from __future__ import annotations

import math
import statistics

from hyper_adaptor.testing.measure import machine_line, mib, target_lines

WORLD = 4
HYBRID_ULYSSES = 2  # hybrid at CP 4 = 2 (Ulysses) x 2 (ring)
ELEMENT = 4  # fp32
MAX_PROBES = 20
TARGETS = {"attention_memory": 1.1, "comm": 0.05, "longest": 3.5, "ring_vs_ulysses_cp2": 0.10}


def kv_heads_for(ng: int, degree: int) -> int:
    """ng repeated as Ulysses does: each kv head degree / gcd(ng, degree) times."""
    return ng * (degree // math.gcd(ng, degree))


def theory(algo: str, n: int, seq: int, dims: dict) -> dict:
    """Bytes this rank sends per layer, forward and backward (see the module doc); ``formula`` in words."""
    s, b, nh, ng, hn = seq // n, dims["batch"], dims["heads"], dims["kv_heads"], dims["head_dim"]
    if n == 1 or algo == "attention":
        return {"forward": 0, "backward": 0, "minimum": 0, "formula": "0"}
    q = s * b * nh * hn * ELEMENT
    if algo == "ulysses":
        kv = s * b * kv_heads_for(ng, n) * hn * ELEMENT
        each = (n - 1) * (2 * q + 2 * kv) / n
        return {"forward": each, "backward": each, "minimum": 2 * each, "formula": "2(N-1)/N(2Q+2K)"}
    if algo == "allgather":
        kv = s * b * ng * hn * ELEMENT
        return {"forward": 2 * (n - 1) * kv, "backward": 2 * (n - 1) * kv, "minimum": 4 * (n - 1) * kv,
                "formula": "4(N-1)K"}
    if algo == "ring":
        u, g = 1, n
        ulysses_each, kv = 0.0, s * b * ng * hn * ELEMENT
    else:  # hybrid
        u, g = HYBRID_ULYSSES, n // HYBRID_ULYSSES
        kv = s * b * kv_heads_for(ng, u) * hn * ELEMENT  # the head slice of U x s rows: the same bytes
        ulysses_each = (u - 1) * (2 * q + 2 * kv) / u
    kv_fp32 = kv * 4 // ELEMENT  # the travelling dK/dV accumulators are fp32
    forward = ulysses_each + (g - 1) * 2 * kv
    backward = ulysses_each + (g - 1) * 2 * kv + g * 2 * kv_fp32
    minimum = forward + backward - 2 * kv_fp32
    formula = "2(N-1)K + 2(N-1)K + 2N K32" if algo == "ring" else "2(U-1)/U(2Q+2K) + 2(G-1)K + 2(G-1)K + 2G K32"
    return {"forward": forward, "backward": backward, "minimum": minimum, "formula": formula}


def longest_sequence(memory_at, budget: int, first_guess: int, granule: int) -> dict:
    """The longest multiple of ``granule`` whose ``memory_at(seq)`` (bytes) is <= ``budget``: gallop from
    ``first_guess`` (steps of one granule, doubling) until the answer is bracketed, then bisect."""
    probes = {}

    def fits(seq):
        if seq not in probes:
            if len(probes) >= MAX_PROBES:
                raise RuntimeError(f"longest sequence: no answer after {MAX_PROBES} probes {probes}")
            probes[seq] = memory_at(seq)
        return probes[seq] <= budget

    guess = max(granule, first_guess // granule * granule)
    step = granule
    if fits(guess):
        lo, hi = guess, guess + step
        while fits(hi):
            lo, step = hi, step * 2
            hi = lo + step
    else:
        hi, lo = guess, guess - step
        while lo >= granule and not fits(lo):
            hi, step = lo, step * 2
            lo = hi - step
        if lo < granule:
            if not fits(granule):
                return {"seq": 0, "bytes": None, "probes": probes}
            lo = granule
    while hi - lo > granule:
        mid = (lo + hi) // 2 // granule * granule
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return {"seq": lo, "bytes": probes[lo], "probes": probes}


def linear_guess(points: dict, budget: int) -> int:
    """Where the line through the two longest of {seq: bytes} reaches the budget (memory is affine in
    the sequence once activations outweigh the weight gradients, which the short ones may not)."""
    (x0, y0), (x1, y1) = sorted(points.items())[-2:] if len(points) > 1 else ((0, 0), *points.items())
    slope = (y1 - y0) / (x1 - x0)
    return int(x1 + (budget - y1) / slope) if slope > 0 else x1


def merge(results: list, dims: dict) -> tuple[list, list]:
    """Rows with per-rank figures combined (memory and communication: the maximum over the ranks)."""
    rows = []
    for i, row in enumerate(results[0]["rows"]):
        per_rank = [res["rows"][i] for res in results]
        n, seq, name = row["cp"], row["seq"], row["algorithm"]
        comm = [sum(r["comm"].get(p, {"bytes": 0})["bytes"] for p in ("forward", "backward")) for r in per_rank]
        t = theory(name, n, seq, dims)
        out = {
            "seq": seq, "cp": n, "dp": WORLD // n, "algorithm": name,
            "step_ms_median": statistics.median(row["step_s"]) * 1000 if row["step_s"] else None,
            "step_ms_all": [x * 1000 for x in row["step_s"]],
            "layer_peak_bytes": max(r["layer_peak"] for r in per_rank),
            "layer_peak_bytes_per_rank": [r["layer_peak"] for r in per_rank],
            "layer_peak_profiler_bytes": max(r["layer_peak_profiler"] for r in per_rank),
            "layer_activation_bytes": max(r["layer_activation_peak"] for r in per_rank),
            "layer_peak_by_op_rank0": row["layer_peak_by_op"],
            "attention_peak_by_op_rank0": row["attention_peak_by_op"],
            "attention_bytes": max(r["attention_inputs"] + r["attention_peak"] for r in per_rank),
            "attention_inputs_bytes": max(r["attention_inputs"] for r in per_rank),
            "attention_peak_bytes": max(r["attention_peak"] for r in per_rank),
            "attention_after_forward_bytes": max(r["attention_inputs"] + r["attention_after_forward"]
                                                 for r in per_rank),
            "attention_peak_profiler_bytes": max(r["attention_peak_profiler"] for r in per_rank),
            "static_bytes": max(r["static"] for r in per_rank),
            "comm_bytes": max(comm), "comm_bytes_per_rank": comm,
            "comm_forward_bytes": max(r["comm"].get("forward", {"bytes": 0})["bytes"] for r in per_rank),
            "comm_backward_bytes": max(r["comm"].get("backward", {"bytes": 0})["bytes"] for r in per_rank),
            "comm_ops_rank0": row["comm"],
            "ring_stats_bytes_sent": [r["ring_stats_bytes_sent"] for r in per_rank],
            "comm_theory_forward_bytes": t["forward"], "comm_theory_backward_bytes": t["backward"],
            "comm_theory_bytes": t["forward"] + t["backward"], "comm_minimum_bytes": t["minimum"],
            "comm_formula": t["formula"],
            "parity_max_rel_err": (max(max(r["parity"].values()) for r in per_rank) if "parity" in row else None),
        }
        theory_total = out["comm_theory_bytes"]
        out["comm_vs_theory"] = (out["comm_bytes"] / theory_total) if theory_total else None
        rows.append(out)
    # ratios against CP 1 (memory) and Ulysses at the same CP (time)
    for out in rows:
        base = next(r for r in rows if r["seq"] == out["seq"] and r["cp"] == 1)
        for key in ("layer_peak", "layer_activation", "attention", "attention_after_forward"):
            out[f"{key}_vs_cp1_over_cp"] = out[f"{key}_bytes"] / (base[f"{key}_bytes"] / out["cp"])
        ulysses = next((r for r in rows if r["seq"] == out["seq"] and r["cp"] == out["cp"]
                        and r["algorithm"] == "ulysses"), None)
        out["step_vs_ulysses"] = (out["step_ms_median"] / ulysses["step_ms_median"]
                                  if ulysses and out["step_ms_median"] and ulysses["step_ms_median"] else None)
        out["world_tokens_per_s"] = (out["dp"] * out["seq"] / (out["step_ms_median"] / 1000)
                                     if out["step_ms_median"] else None)
    longest = results[0]["longest"]
    cp1 = next((x["seq"] for x in longest if x["cp"] == 1), None)
    for x in longest:
        x["vs_cp1"] = x["seq"] / cp1 if cp1 else None
    return rows, longest


def targets(rows: list, longest: list) -> list[dict]:
    """Each target, checked where it applies (memory at the longest swept sequence)."""
    out = []
    top = max(r["seq"] for r in rows)
    for key, what in (("attention", "core attention memory (alone)"), ("layer_activation", "layer activations")):
        for r in rows:
            if r["cp"] > 1 and r["seq"] == top:
                ratio = r[f"{key}_vs_cp1_over_cp"]
                out.append({"target": f"{what} <= {TARGETS['attention_memory']} x CP1/CP",
                            "where": f"seq {top} CP {r['cp']} {r['algorithm']}", "value": ratio,
                            "met": ratio <= TARGETS["attention_memory"]})
    for r in rows:
        if r["comm_vs_theory"] is not None:
            out.append({"target": f"communication within {TARGETS['comm']:.0%} of theory",
                        "where": f"seq {r['seq']} CP {r['cp']} {r['algorithm']}", "value": r["comm_vs_theory"],
                        "met": abs(r["comm_vs_theory"] - 1) <= TARGETS["comm"]})
    for x in longest:
        if x["cp"] > 1:
            out.append({"target": f"longest sequence at CP {x['cp']} >= {TARGETS['longest']} x CP 1's",
                        "where": x["algorithm"], "value": x["vs_cp1"],
                        "met": x["vs_cp1"] is not None and x["vs_cp1"] >= TARGETS["longest"]})
    for r in rows:
        if r["cp"] == 2 and r["algorithm"] == "ring" and r["step_vs_ulysses"] is not None:
            out.append({"target": f"load-balanced ring within {TARGETS['ring_vs_ulysses_cp2']:.0%} of Ulysses "
                                  "step time at CP 2",
                        "where": f"seq {r['seq']}", "value": r["step_vs_ulysses"],
                        "met": r["step_vs_ulysses"] <= 1 + TARGETS["ring_vs_ulysses_cp2"]})
    return out


def _f(x, spec) -> str:
    return "-" if x is None else format(x, spec)


def _top(by_op: dict, k: int = 4) -> str:
    return ", ".join(f"{op.removeprefix('aten.')} {mib(b)}" for op, b in list(by_op.items())[:k])


def table(result: dict) -> str:
    head = ("seq", "CP x DP", "algorithm", "step ms", "x Ulysses", "world tok/s", "layer peak MiB (x CP1/CP)",
            "layer activations MiB (x CP1/CP)", "attention MiB (x CP1/CP)", "comm MiB fwd + bwd",
            "theory MiB (formula)", "x theory", "RingStats MiB", "parity")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        ring = r["ring_stats_bytes_sent"][0]
        lines.append("| " + " | ".join((
            str(r["seq"]), f"{r['cp']} x {r['dp']}", r["algorithm"], _f(r["step_ms_median"], ".0f"),
            _f(r["step_vs_ulysses"], ".2f"), _f(r["world_tokens_per_s"], ",.0f"),
            f"{mib(r['layer_peak_bytes'])} ({r['layer_peak_vs_cp1_over_cp']:.2f})",
            f"{mib(r['layer_activation_bytes'])} ({r['layer_activation_vs_cp1_over_cp']:.2f})",
            f"{mib(r['attention_bytes'])} ({r['attention_vs_cp1_over_cp']:.2f})",
            f"{mib(r['comm_forward_bytes'])} + {mib(r['comm_backward_bytes'])}",
            f"{mib(r['comm_theory_bytes'])} ({r['comm_formula']})", _f(r["comm_vs_theory"], ".3f"),
            mib(ring), _f(r["parity_max_rel_err"], ".1e"),
        )) + " |")
    d = result["layer"]
    profiler_gap = max(abs(r["layer_peak_profiler_bytes"] - r["layer_peak_bytes"]) for r in result["rows"])
    cp1_gap = max(abs(r["layer_peak_profiler_bytes"] - r["layer_peak_bytes"]) for r in result["rows"] if r["cp"] == 1)
    notes = [
        "",
        f"Layer: hidden {d['hidden']}, {d['heads']} query heads, {d['kv_heads']} kv heads, head dim {d['head_dim']}, "
        f"ffn {d['ffn']}, batch {d['batch']}, fp32, causal, load-balanced layout; {result['world']} ranks "
        f"(CP x DP), one thread each; hybrid = {HYBRID_ULYSSES} (Ulysses) x "
        f"{result['world'] // HYBRID_ULYSSES} (ring).",
        "step ms: median over the interleaved rounds of the slowest rank's forward + backward; world tok/s: "
        "tokens of all DP groups per second; x Ulysses: step time over Ulysses' at the same CP.",
        "Memory per rank, max over ranks, from the storage tracker (bytes of the storages operators create, "
        "from creation to free): layer peak = peak over the layer's forward + backward; layer activations = "
        "the peak of the same running total without the weight gradients; attention = q, k, v and the "
        "output gradient of this rank's shard + the peak over the core attention's forward + backward "
        "alone; (x CP1/CP) = figure / (CP 1's figure / CP), target <= 1.1.",
        f"Cross-check, the profiler's allocator events over the same layer steps: largest difference "
        f"{mib(profiler_gap)} MiB ({mib(cp1_gap)} at CP 1; at CP > 1 the profiler misses frees run in "
        "gloo's threads).",
        "comm per rank per layer (bytes sent, bandwidth-optimal schedule of each collective). Q = s b np hn 4 B "
        "(local q), K = s b ng hn 4 B (local k, = v; ng repeated to a multiple of the Ulysses degree if "
        "needed), K32 = the fp32 dK/dV accumulator (= K in fp32), s = S/N, N = CP; U x G = hybrid's "
        "Ulysses x ring (2 x 2).",
        "parity: max relative error of z, dx and the CP-summed weight gradients vs one process on the whole "
        "sequence (first sequence length only).",
        "",
        f"Core attention at seq {max(result['seqs'])}: inputs + what forward leaves alive (saved for backward, "
        "and the output), and what the peak holds (rank 0, MiB by creating operator):",
    ]
    for r in result["rows"]:
        if r["seq"] == max(result["seqs"]):
            notes.append(f"  CP {r['cp']} {r['algorithm']}: after forward {mib(r['attention_after_forward_bytes'])} "
                         f"(x CP1/CP {r['attention_after_forward_vs_cp1_over_cp']:.2f}); at the peak: inputs "
                         f"{mib(r['attention_inputs_bytes'])} + {_top(r['attention_peak_by_op_rank0'])}")
    if result["longest"]:
        notes += ["", f"Longest sequence within {mib(result['budget_bytes'])} MiB per process (parameters + x + dz "
                  f"+ layer peak, max over ranks; steps of {result['granule']} tokens):", "",
                  "| CP | algorithm | longest seq | MiB there | x CP 1 | probes (seq: MiB) | s |",
                  "|---|---|---|---|---|---|---|"]
        for x in result["longest"]:
            probes = ", ".join(f"{s}: {mib(b)}" for s, b in sorted(x["probes"].items()))
            notes.append(f"| {x['cp']} | {x['algorithm']} | {x['seq']} | {mib(x['bytes'])} | "
                         f"{_f(x['vs_cp1'], '.2f')} | {probes} | {x['seconds']:.0f} |")
    notes += ["", "Targets, each checked where it applies (value, then met or NOT):"]
    notes += target_lines(result["targets"], ".3f")
    notes += ["", machine_line(result)]
    return "\n".join(lines + notes)


