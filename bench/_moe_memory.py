"""Peak memory per rank of a GPT-MoE under expert parallelism: megatron's DDP + distributed optimizer
against --use-hsdp (levels 1-3) at the same layout, in one gloo world (for bench/expert_parallel.py).

The model and both wrappings are hyper_adaptor/testing/gpt.py's ``build_gpt_moe``, the one
tests/distributed/hsdp_expert_checks.py trains (megatron-core GPT, every layer an MoE with megatron's
all-to-all dispatcher, fp32, megatron's chained Adam), only larger; model state is counted as
bench/hsdp.py counts it (bench/_hsdp_contenders.py's ledgers).

Layout: EP 2 on 4 ranks, so the dense parameters are data-parallel over all 4 ranks and each expert
over an expert-data-parallel group of 2. That group is what HSDP shards the experts over (at EP 4 it is
one rank: experts whole on both sides, and only the dense parameters — a small share of an MoE — would
differ); the experts are most of the model, so this is where their sharding shows.

Each contender: warm-up steps, timed steps, then one step recorded and one measured with
:class:`~hyper_adaptor.testing.measure.PeakMemory` (started a step before, so that what the measured
step frees was seen created). Its peak per rank = the bytes alive at the measured step's start (model
state — parameters, gradients, optimizer state, each storage once — plus what HSDP's host buffer pools
keep reserved) + the rise above them during the step (activations, gathered parameters, communication
buffers). Run alone for a table::

    python bench/_moe_memory.py [--quick]
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import types
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

EP = 4 // 2  # of a 4-rank world: expert data-parallel groups of 2 (module docstring)
DIMS = dict(layers=4, hidden=256, heads=8, ffn=1024, experts=8, topk=2, moe_ffn=512, seq=256, vocab=1024, micro=2)
QUICK_DIMS = dict(layers=2, hidden=64, heads=4, ffn=256, experts=4, topk=2, moe_ffn=128, seq=64, vocab=256, micro=2)
STEPS = {"warmup": 1, "timed": 2}
QUICK_STEPS = {"warmup": 1, "timed": 1}
# megatron first: HSDP's patches, once applied, stay applied in the process
CONTENDERS = {"megatron-distopt": dict(ep=EP), **{f"hsdp-level{n}": dict(ep=EP, hsdp=f"level{n}") for n in (1, 2, 3)}}
BASELINE = "megatron-distopt"
SEED, CLIP = 1234, 0.5  # the weights' seed and Adam's gradient clipping: the tests' (hsdp_expert_checks.py)
LOSS_RTOL = 1e-5


def _batch(step: int, d: dict) -> dict:
    """This rank's micro-batch of ``step``'s global batch (one micro-batch per data-parallel rank)."""
    import torch

    from megatron.core import parallel_state as ps

    dp, rank, mb, seq = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank(), d["micro"], d["seq"]
    g = torch.Generator().manual_seed(1234 + step)
    tokens = torch.randint(0, d["vocab"], (dp * mb, seq + 1), generator=g)[rank * mb : (rank + 1) * mb]
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
            "position_ids": torch.arange(seq).unsqueeze(0).expand(mb, seq).contiguous(),
            "attention_mask": torch.tril(torch.ones(1, 1, seq, seq)) < 0.5}


def _train_step(chunk, optimizer, data: dict, d: dict) -> float:
    """One step as megatron.training takes it: the schedule (forward, backward, finalize_model_grads)
    and the optimizer; the loss averaged over data parallel."""
    import torch.distributed as dist

    from hyper_adaptor.testing.gpt import forward_step  # the GPT step's loss: the mean token loss

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    chunk.zero_grad_buffer()
    optimizer.zero_grad()
    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([data]), model=chunk,
                                      num_microbatches=1, seq_length=d["seq"], micro_batch_size=d["micro"],
                                      forward_only=False)
    loss = out[0]["lm loss"].clone()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    ok, _, _ = optimizer.step()
    if not ok:
        raise RuntimeError("optimizer step skipped (fp32: should not happen)")
    return loss.item() / ps.get_data_parallel_world_size()


def _state(run: dict, model, chunk, optimizer) -> tuple[dict, int]:
    """Model state bytes by part and the bytes HSDP's host buffer pools keep reserved, on this rank."""
    from bench._hsdp_contenders import hsdp_state, megatron_state

    if not run.get("hsdp"):
        return megatron_state(chunk, optimizer), 0
    torch_optimizers = [sub.optimizer for sub in getattr(optimizer, "chained_optimizers", [optimizer])]
    # megatron's dense and expert optimizers seen as one (the ledger reads param_groups and state)
    merged = types.SimpleNamespace(param_groups=[g for o in torch_optimizers for g in o.param_groups],
                                   state={k: v for o in torch_optimizers for k, v in o.state.items()})
    pools = {id(m._hsdp_state.pool): m._hsdp_state.pool for m in model.modules()
             if getattr(m, "_hsdp_state", None) is not None}
    return hsdp_state(model, merged), sum(p.reserved_bytes() for p in pools.values())


def _measure(name: str, run: dict, d: dict, steps: dict) -> dict:
    import torch.distributed as dist

    from hyper_adaptor.testing.gpt import build_gpt_moe
    from hyper_adaptor.testing.measure import PeakMemory

    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads

    dims = {k: v for k, v in d.items() if k != "micro"}
    config, model, chunk, optimizer = build_gpt_moe(run, dims, seed=SEED, clip=CLIP)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    step, losses, times = 0, [], []
    for _ in range(steps["warmup"]):
        losses.append(_train_step(chunk, optimizer, _batch(step, d), d))
        step += 1
    for _ in range(steps["timed"]):
        data = _batch(step, d)
        dist.barrier()
        start = time.perf_counter()
        losses.append(_train_step(chunk, optimizer, data, d))
        times.append(time.perf_counter() - start)
        step += 1
    with PeakMemory() as measured:
        losses.append(_train_step(chunk, optimizer, _batch(step, d), d))  # seen, so its frees are known
        step += 1
        data = _batch(step, d)
        state, pool = _state(run, model, chunk, optimizer)
        dist.barrier()
        measured.mark()
        losses.append(_train_step(chunk, optimizer, data, d))
    state_after, pool_after = _state(run, model, chunk, optimizer)
    start_bytes = sum(state.values()) + pool
    result = {"peak_bytes": start_bytes + measured.rise, "start_bytes": start_bytes, "rise_bytes": measured.rise,
              "state_bytes": state, "pool_bytes": pool, "state_bytes_after": state_after,
              "pool_bytes_after": pool_after, "step_s": times, "losses": losses,
              "params": sum(p.numel() for p in model.parameters()) if not run.get("hsdp") else None}
    ps.destroy_model_parallel()
    del config, model, chunk, optimizer
    gc.collect()
    return result


def memory_rank(rank: int, world_size: int, quick: bool) -> dict:
    """Rank code (``run_world(4, "bench._moe_memory:memory_rank", quick=...)``): per contender, this
    rank's peak and start bytes, the rise, model state by part, timed step seconds and every step's loss."""
    import torch.distributed as dist

    if world_size != 2 * EP:
        raise ValueError(f"bench._moe_memory: needs a world of {2 * EP} ranks (EP {EP}); got {world_size}")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    d, steps = (QUICK_DIMS, QUICK_STEPS) if quick else (DIMS, STEPS)
    contenders = {name: _measure(name, run, d, steps) for name, run in CONTENDERS.items()}
    return {"dims": d, "steps": steps, "ep": EP, "expert_dp": world_size // EP, "dp": world_size,
            "contenders": contenders}


def summarize(ranks: list[dict]) -> dict:
    """Per contender over the ranks: the highest peak, state by part (max), median step time, the
    losses (every rank's are the data-parallel mean: rank 0's) and the loss check against megatron's."""
    base = ranks[0]["contenders"][BASELINE]["losses"]
    rows = {}
    for name in CONTENDERS:
        per_rank = [r["contenders"][name] for r in ranks]
        losses = per_rank[0]["losses"]
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, base, strict=True))
        rows[name] = {
            "peak_bytes_max": max(c["peak_bytes"] for c in per_rank),
            "peak_bytes_per_rank": [c["peak_bytes"] for c in per_rank],
            "start_bytes_max": max(c["start_bytes"] for c in per_rank),
            "rise_bytes_max": max(c["rise_bytes"] for c in per_rank),
            "state_bytes_max": {part: max(c["state_bytes"][part] for c in per_rank)
                                for part in per_rank[0]["state_bytes"]},
            "pool_bytes_max": max(c["pool_bytes"] for c in per_rank),
            "step_ms": 1e3 * statistics.median(t for c in per_rank for t in c["step_s"]),
            "losses": losses, "loss_max_rel_diff_vs_megatron": worst, "loss_parity": worst <= LOSS_RTOL,
        }
    ratio = rows["hsdp-level3"]["peak_bytes_max"] / rows[BASELINE]["peak_bytes_max"]
    return {"rows": rows, "hsdp_level3_peak_vs_distopt": ratio}


def table(summary: dict) -> str:
    mib = 2**20
    head = (f"{'contender':<18}{'peak MiB':>10}{'start MiB':>11}{'rise MiB':>10}{'params':>9}{'grads':>9}"
            f"{'optim':>9}{'pool':>8}{'step ms':>9}  loss rel diff")
    lines = [head]
    for name, r in summary["rows"].items():
        s = r["state_bytes_max"]
        lines.append(f"{name:<18}{r['peak_bytes_max'] / mib:>10.2f}{r['start_bytes_max'] / mib:>11.2f}"
                     f"{r['rise_bytes_max'] / mib:>10.2f}{s['params'] / mib:>9.2f}{s['grads'] / mib:>9.2f}"
                     f"{s['optim'] / mib:>9.2f}{r['pool_bytes_max'] / mib:>8.2f}{r['step_ms']:>9.0f}  "
                     f"{r['loss_max_rel_diff_vs_megatron']:.1e} {'ok' if r['loss_parity'] else 'NOT within'}")
    lines.append(f"HSDP level 3 peak / distributed optimizer peak: {summary['hsdp_level3_peak_vs_distopt']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    import argparse
    import os

    from hyper_adaptor.testing.measure import run_world

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small model, one timed step")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args(argv)
    load, start = os.getloadavg()[0], time.time()
    ranks = run_world(2 * EP, "bench._moe_memory:memory_rank", timeout=args.timeout, quick=args.quick)
    summary = summarize(ranks)
    print(table(summary))
    print(f"load average {load:.1f} before / {os.getloadavg()[0]:.1f} after; {time.time() - start:.0f} s")
    return {"ranks": ranks, "summary": summary}


if __name__ == "__main__":
    main()
