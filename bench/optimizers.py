"""Muon against AdamW: optimizer step time, Newton-Schulz balance across owner ranks, optimizer-state bytes per
parameter, and megatron's GPT trained with each on the embedded corpus.

Run from the repository root (docs/features/optimizers.md says what each figure is and why)::

    python bench/optimizers.py                   # hidden 1024 / 2048 / 4096, 300 training iterations per optimizer
    python bench/optimizers.py --quick           # hidden 1024 only, 10 training iterations (smoke run)
    python bench/optimizers.py --skip-training   # the first three sections only

Sections:

1. ``hyper_adaptor.optim.Muon`` vs ``torch.optim.AdamW``: ``step()`` time on one transformer layer's hidden
   matrices (QKV [3h, h], proj [h, h], fc1 [4h, h], fc2 [h, 4h]), fp32, this process's CPU threads.
2. Newton-Schulz flops per rank (max / mean) when each matrix's Newton-Schulz runs on one owner rank:
   ``assign_owners`` on ``ns_flops``, ``round_robin_owners``, and the same greedy on element counts.
3. Optimizer-state bytes per parameter from the state tensors after one real step, fp32 and with bf16
   parameters + fp32 master weights + fp32 gradients.
4. ``examples/pretrain_gpt.py`` (the demo's GPT, one process) with ``--optimizer adam`` and ``--optimizer muon``
   (bench/_optimizer_training.py):
   logged loss at equal iterations and at equal wall time.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `python bench/optimizers.py` puts bench/ first, not the root
    sys.path.insert(0, str(REPO_ROOT))

from bench._optimizer_training import training_section, training_table  # noqa: E402
from hyper_adaptor.optim import (  # noqa: E402
    Muon,
    assign_owners,
    get_hyper_optimizer,
    load_imbalance,
    ns_flops,
    round_robin_owners,
)
from hyper_adaptor.testing.measure import machine, machine_line, nbytes, report, target_lines  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "optimizers-cpu.json"
BALANCE_TARGET = 1.15
WORLD_SIZES = (2, 4, 8, 16, 64)

# ------------------------------------------------------------------------------------ 1. step time
# hidden -> (warm-up steps, timed Muon steps); one Muon step at 4096 is ~1.7e13 flops (minutes on two cores),
# so it gets one timed step and no warm-up. AdamW takes a step before every Muon step and after the last one
# (at least five in all), so that load from other work on the machine falls on both alike.
STEP_PLAN = {1024: (1, 5), 2048: (1, 2), 4096: (0, 1)}
QUICK_STEP_PLAN = {1024: (1, 3)}


def layer_shapes(h: int) -> list[tuple[int, int]]:
    """One transformer layer's hidden matrices (QKV, output projection, MLP in and out), [out, in]."""
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)]


def _timed(optimizer) -> float:
    start = time.perf_counter()
    optimizer.step()
    return time.perf_counter() - start


def step_time_rows(plan: dict) -> list[dict]:
    rows = []
    for h, (warmup, steps) in plan.items():
        gen = torch.Generator().manual_seed(h)
        params = [nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in layer_shapes(h)]
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        muon_opt = Muon(params, lr=0.02, weight_decay=0.1)
        adamw_opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)
        for _ in range(max(warmup, 1)):  # AdamW's first step allocates its moments: never timed
            adamw_opt.step()
        for _ in range(warmup):
            muon_opt.step()
        muon, adamw = [], [_timed(adamw_opt)]
        for _ in range(steps):
            muon.append(_timed(muon_opt))
            adamw.append(_timed(adamw_opt))
        while len(adamw) < 5:
            adamw.append(_timed(adamw_opt))
        flops = sum(ns_flops(p.shape) for p in params)
        muon_ms, adamw_ms = 1e3 * statistics.median(muon), 1e3 * statistics.median(adamw)
        rows.append({"hidden": h, "shapes": [list(p.shape) for p in params],
                     "params": sum(p.numel() for p in params), "muon_warmup": warmup, "muon_steps": steps,
                     "adamw_steps": len(adamw), "muon_ms": muon_ms, "adamw_ms": adamw_ms,
                     "muon_ms_all": [1e3 * t for t in muon], "adamw_ms_all": [1e3 * t for t in adamw],
                     "ratio": muon_ms / adamw_ms, "ratio_of_fastest": min(muon) / min(adamw), "ns_gflop": flops / 1e9,
                     "ns_gflops_per_s": flops / 1e9 / (muon_ms / 1e3), "load_average_1min": os.getloadavg()[0]})
        print(f"  step time h={h}: Muon {muon_ms:.1f} ms ({steps} timed), AdamW {adamw_ms:.1f} ms", flush=True)
        del params, muon_opt, adamw_opt
    return rows


# ----------------------------------------------------------------------------- 2. Newton-Schulz balance
def _dense_layer(h: int, ffn: int, heads: int, groups: int, swiglu: bool) -> list[tuple]:
    """(name, shape, row blocks) of one dense layer; QKV is orthogonalised per head (one block per head)."""
    head_dim = h // heads
    return [("qkv", ((heads + 2 * groups) * head_dim, h), heads + 2 * groups), ("proj", (h, h), 1),
            ("fc1", ((2 if swiglu else 1) * ffn, h), 1), ("fc2", (h, ffn), 1)]


def _moe_layer(h: int, heads: int, experts: int, expert_ffn: int, shared_ffn: int) -> list[tuple]:
    mats = _dense_layer(h, 0, heads, heads, True)[:2]
    for e in range(experts):
        mats += [(f"expert{e}.fc1", (2 * expert_ffn, h), 1), (f"expert{e}.fc2", (h, expert_ffn), 1)]
    return mats + [("shared.fc1", (2 * shared_ffn, h), 1), ("shared.fc2", (h, shared_ffn), 1)]


MODELS = {
    "dense 7B-like: h 4096, ffn 11008 SwiGLU, 32 layers, GQA 32/8": [
        m for _ in range(32) for m in _dense_layer(4096, 11008, 32, 8, True)],
    "dense 1.3B-like: h 2048, ffn 8192 GELU, 24 layers, MHA 16": [
        m for _ in range(24) for m in _dense_layer(2048, 8192, 16, 16, False)],
    "MoE: h 2048, 16 layers, 64 experts x ffn 1408 + shared 2816 (SwiGLU)": [
        m for _ in range(16) for m in _moe_layer(2048, 16, 64, 1408, 2816)],
    "few big: 2 layers of a 70B-like model (h 8192, ffn 28672, GQA 64/8)": [
        m for _ in range(2) for m in _dense_layer(8192, 28672, 64, 8, True)],
    "the demo's GPT: h 128, ffn 512 SwiGLU, 4 layers, MHA 4": [
        m for _ in range(4) for m in _dense_layer(128, 512, 4, 4, True)],
}


def matrix_cost(shape, blocks: int) -> float:
    """Newton-Schulz flops of one matrix as Muon runs it: each of ``blocks`` row blocks on its own."""
    return blocks * ns_flops((shape[0] // blocks, shape[1]))


def numel_owners(numels, n_ranks: int) -> list[int]:
    """The greedy of ``assign_owners`` on element counts: what a memory-balanced layout would pick."""
    return assign_owners(numels, n_ranks)


def balance_rows() -> list[dict]:
    rows = []
    for model, mats in MODELS.items():
        costs = [matrix_cost(shape, blocks) for _, shape, blocks in mats]
        numels = [shape[0] * shape[1] for _, shape, _ in mats]
        for n in WORLD_SIZES:
            mean = sum(costs) / n
            rows.append({
                "model": model, "matrices": len(mats), "world": n,
                "balanced": load_imbalance(costs, assign_owners(costs, n), n),
                "round_robin": load_imbalance(costs, round_robin_owners(len(costs), n), n),
                "by_numel": load_imbalance(costs, numel_owners(numels, n), n),
                # no assignment of whole matrices can do better than its largest matrix alone on a rank
                "lower_bound": max(1.0, max(costs) / mean),
            })
    return rows


# ------------------------------------------------------------------------------ 3. state bytes/param
class TinyGPT(nn.Module):
    """Enough of a GPT for the optimizer split: embedding, attention and MLP matrices, norms, output layer."""

    def __init__(self, vocab: int = 512, h: int = 256, layers: int = 2):
        super().__init__()
        self.embedding = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.ModuleDict({
                "norm1": nn.LayerNorm(h), "linear_qkv": nn.Linear(h, 3 * h, bias=False),
                "linear_proj": nn.Linear(h, h, bias=False), "norm2": nn.LayerNorm(h),
                "linear_fc1": nn.Linear(h, 4 * h), "linear_fc2": nn.Linear(4 * h, h)}))
        self.final_norm = nn.LayerNorm(h)
        self.output_layer = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        for layer in self.layers:
            q, k, v = layer["linear_qkv"](layer["norm1"](x)).chunk(3, dim=-1)
            x = x + layer["linear_proj"](torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))
            x = x + layer["linear_fc2"](torch.nn.functional.gelu(layer["linear_fc1"](layer["norm2"](x))))
        return self.output_layer(self.final_norm(x))


# (name, optimizer, master weights, formula in bytes per parameter: params + masters + grads + state)
STATE_VARIANTS = (
    ("AdamW, fp32", "adamw", False, "4 + 0 + 4 + 8 = 16"),
    ("Muon, fp32", "muon", False, "4 + 0 + 4 + 4 = 12"),
    ("AdamW, bf16 + fp32 masters", "adamw", True, "2 + 4 + 4 + 8 = 18"),
    ("Muon, bf16 + fp32 masters", "muon", True, "2 + 4 + 4 + 4 = 14"),
)


def _state_bytes(optimizer, params) -> int:
    state = optimizer.state
    return sum(nbytes(v) for p in params for v in state.get(p, {}).values())


def state_rows() -> list[dict]:
    rows = []
    for name, kind, masters, formula in STATE_VARIANTS:
        torch.manual_seed(0)
        master = TinyGPT()
        # bf16 model + fp32 master copy, the fp32 gradient on the master (megatron's main_grad); fp32: one model
        model = copy.deepcopy(master).to(torch.bfloat16) if masters else master
        optimizer = get_hyper_optimizer(master, lr=1e-3, weight_decay=0.1, optimizer=kind, num_heads=4)
        tokens = torch.randint(0, 512, (2, 64))
        logits = model(tokens)
        torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
        if masters:
            for p, m in zip(model.parameters(), master.parameters(), strict=True):
                m.grad, p.grad = p.grad.float(), None
        optimizer.step()
        muon_ids = {id(p) for opt in getattr(optimizer, "optimizers", [optimizer]) if isinstance(opt, Muon)
                    for g in opt.param_groups for p in g["params"]}
        matrices = [p for p in master.parameters() if id(p) in muon_ids] or [
            p for n, p in master.named_parameters() if p.dim() == 2 and "embedding" not in n and "output" not in n]
        pairs = list(zip(model.parameters(), master.parameters(), strict=True))
        for scope, chosen in (("hidden matrices", [(p, m) for p, m in pairs if any(m is x for x in matrices)]),
                              ("whole model", pairs)):
            count = sum(m.numel() for _, m in chosen)
            parts = {"params": sum(nbytes(p) for p, _ in chosen) / count,
                     "masters": sum(nbytes(m) for _, m in chosen) / count if masters else 0.0,
                     "grads": sum(nbytes(m.grad) for _, m in chosen) / count,
                     "state": _state_bytes(optimizer, [m for _, m in chosen]) / count}
            rows.append({"variant": name, "scope": scope, "param_count": count, **parts,
                         "total": sum(parts.values()), "formula": formula if scope == "hidden matrices" else ""})
    return rows


# ------------------------------------------------------------------------------------------ report
def run(args) -> dict:
    load_before, start = os.getloadavg()[0], time.time()
    print("1. optimizer step time", flush=True)
    steps = step_time_rows(QUICK_STEP_PLAN if args.quick else STEP_PLAN)
    print("2. Newton-Schulz balance", flush=True)
    balance = balance_rows()
    print("3. optimizer state bytes per parameter", flush=True)
    states = state_rows()
    training = None
    if not args.skip_training:
        print("4. megatron GPT training, Muon vs AdamW", flush=True)
        training = training_section(args.train_iters or (10 if args.quick else 300), args.timeout)
    targets = [{"target": f"Newton-Schulz flops per rank max/mean <= {BALANCE_TARGET} (balanced owners)",
                "where": f"{r['model'].split(':')[0]} @ {r['world']}" + (
                    f" (no assignment below {r['lower_bound']:.3f})" if r["lower_bound"] > BALANCE_TARGET else ""),
                "value": r["balanced"],
                "met": r["balanced"] <= BALANCE_TARGET} for r in balance]
    return {
        "benchmark": "optimizers",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "bench/optimizers.py", *sys.argv[1:]]),
        "machine": machine(load_average_1min_before_after=[load_before, os.getloadavg()[0]]),
        "wall_s": time.time() - start, "quick": args.quick,
        "adamw": "torch.optim.AdamW with its defaults for a CPU tensor (no foreach, no fused)",
        "step_time": steps, "balance": balance, "state_bytes": states, "training": training, "targets": targets,
    }


def table(result: dict) -> str:
    lines = ["1. Optimizer step() time, one transformer layer's hidden matrices (QKV, proj, fc1, fc2), fp32, CPU",
             "   (median of the timed steps, and the fastest step, the one least touched by other load; an AdamW",
             "   step before each Muon step and after the last, at least five)", "",
             f"{'hidden':>7}{'params':>12}{'Muon ms':>11}{'AdamW ms':>10}{'Muon/AdamW':>12}{'fastest ms':>15}"
             f"{'ratio':>7}{'NS GFLOP/s':>12}  Muon steps"]
    for r in result["step_time"]:
        fastest = f"{min(r['muon_ms_all']):.0f}/{min(r['adamw_ms_all']):.0f}"  # Muon / AdamW ms
        lines.append(f"{r['hidden']:>7}{r['params']:>12,}{r['muon_ms']:>11.1f}{r['adamw_ms']:>10.1f}{r['ratio']:>12.1f}"
                     f"{fastest:>15}{r['ratio_of_fastest']:>7.1f}{r['ns_gflops_per_s']:>12.1f}  "
                     f"{r['muon_warmup']} warm-up + {r['muon_steps']} timed"
                     + (" (one step only: too slow for more on this machine)" if r["muon_steps"] == 1 else ""))
    lines += ["", "2. Newton-Schulz flops per rank, max/mean (1.0 = even; QKV orthogonalised per head); "
              "'bound' = the largest matrix's share, below which no owner assignment can go", "",
              f"{'model':<72}{'ranks':>6}{'balanced':>10}{'by numel':>10}{'round robin':>13}{'bound':>8}"]
    for r in result["balance"]:
        lines.append(f"{r['model']:<72}{r['world']:>6}{r['balanced']:>10.3f}{r['by_numel']:>10.3f}"
                     f"{r['round_robin']:>13.3f}{r['lower_bound']:>8.3f}")
    lines += ["", "3. Optimizer-related bytes per parameter, measured after one step (formula: params + masters + "
              "grads + state)", "",
              f"{'variant':<28}{'scope':<17}{'params':>8}{'masters':>9}{'grads':>7}{'state':>7}{'total':>7}  formula"]
    for r in result["state_bytes"]:
        lines.append(f"{r['variant']:<28}{r['scope']:<17}{r['params']:>8.2f}{r['masters']:>9.2f}{r['grads']:>7.2f}"
                     f"{r['state']:>7.2f}{r['total']:>7.2f}  {r['formula']}")
    lines += ["", *training_table(result["training"])]
    lines += ["", "Targets:", *target_lines(result["targets"]), "", machine_line(result)]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="hidden 1024 only, 10 training iterations (smoke run)")
    parser.add_argument("--skip-training", action="store_true", help="leave out section 4 (megatron training)")
    parser.add_argument("--train-iters", type=int, default=None, help="iterations per training run (default 300)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per training run")
    parser.add_argument("--json", default=None, help=f"default {DEFAULT_JSON}")
    args = parser.parse_args(argv)
    if args.train_iters is not None and args.train_iters < 4:
        parser.error(f"--train-iters must be >= 4, got {args.train_iters}")
    result = run(args)
    return report(result, table(result), args.json or DEFAULT_JSON, args.quick)


if __name__ == "__main__":
    main()
