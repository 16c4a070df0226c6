"""Ring attention checks, run inside a gloo world (hyper_adaptor/testing/world.py).

Every rank builds the same seeded full-sequence q, k, v and output gradient, computes the single-process
reference itself (``attention()`` + autograd on the whole sequence, fp32, no communication), slices its
shard as the CP layout says and runs ``ring_attention`` on it. ``ring_checks`` returns, per rank,
{check name: [failure messages]} (empty = passed) and the counters each run left in its ``RingStats``.

Tolerances (relative to max(1, the reference's largest magnitude), out and dq/dk/dv):
- fp32: 1e-5. The ring only reorders the softmax sums (lse merges) against one softmax: measured
  <= 8e-7 on 2 and 4 ranks.
- bf16: 2e-2, against the fp32 reference on the same bf16-rounded inputs: each block's output and
  gradients are rounded to bf16 once before the fp32 merge/accumulation. Measured <= 8e-3, where
  single-process bf16 ``attention()`` itself is <= 6e-3 off that reference; a missing or doubled
  block is off by O(1).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

from hyper_adaptor.ops.attention import attention
from hyper_adaptor.parallel.context._ring import RingStats, ring_attention

CHUNK, BATCH, HEADS, HEAD_DIM = 3, 2, 4, 16  # chunk of 3: odd block lengths; s_local = 6 load-balanced
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
LAYOUTS = {  # name: (causal, load_balanced)
    "causal-lb": (True, True),
    "causal-contig": (True, False),
    "noncausal": (False, True),
}
KV_HEADS = {"mha": HEADS, "gqa": HEADS // 2}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BACKENDS = ("fast", "eager")


def shard_positions(r: int, n: int, seq: int, load_balanced: bool) -> torch.Tensor:
    """Global positions that CP position r of n holds, in local order (the Conventions of the spec)."""
    if load_balanced:
        c = seq // (2 * n)
        return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])
    c = seq // n
    return torch.arange(r * c, (r + 1) * c)


def full_inputs(seq: int, ng: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, BATCH, HEADS, HEAD_DIM, generator=g)
    k = torch.randn(seq, BATCH, ng, HEAD_DIM, generator=g)
    v = torch.randn(seq, BATCH, ng, HEAD_DIM, generator=g)
    dout = torch.randn(seq, BATCH, HEADS, HEAD_DIM, generator=g)
    return q, k, v, dout


def reference(q, k, v, dout, causal):
    """(out, dq, dk, dv) of single-process attention on the whole sequence, in fp32."""
    xs = [x.detach().float().clone().requires_grad_() for x in (q, k, v)]
    out = attention(*xs, causal=causal, backend="eager").unflatten(2, (q.shape[2], q.shape[3]))
    out.backward(dout.float())
    return [out.detach()] + [x.grad for x in xs]


def compare(name, got, want, tol) -> list[str]:
    if got.shape != want.shape:
        return [f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"]
    error = (got.float() - want).abs().max().item()
    bound = tol * max(1.0, want.abs().max().item())
    return [] if error <= bound else [f"{name}: max error {error:.3g} > {bound:.3g}"]


def run_ring(group, n, r, layout, ng, dtype, backend, seed=0):
    """One ring forward + backward on this rank's shard: (failures, stats after forward, after backward)."""
    causal, load_balanced = LAYOUTS[layout]
    seq = 2 * n * CHUNK
    q, k, v, dout = (x.to(dtype) for x in full_inputs(seq, ng, seed))
    want = reference(q, k, v, dout, causal)
    mine = shard_positions(r, n, seq, load_balanced)
    xs = [x[mine].clone().requires_grad_() for x in (q, k, v)]
    stats = RingStats()
    out = ring_attention(*xs, group=group, causal=causal, load_balanced=load_balanced, backend=backend,
                         stats=stats)
    after_forward = RingStats(**vars(stats))
    out.backward(dout[mine])
    failures = [] if out.dtype == dtype else [f"out dtype {out.dtype}"]
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out.detach()] + [x.grad for x in xs], want):
        failures += compare(name, got, ref[mine], TOL[dtype])
    return failures, vars(after_forward), vars(stats)


def ring_checks(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    n, r = world_size, rank
    parity, stats = {}, collections.defaultdict(dict)  # stats[key]: {"forward": ..., "total": ...}
    for layout in LAYOUTS:
        for heads, ng in KV_HEADS.items():
            for dtype_name, dtype in DTYPES.items():
                for backend in BACKENDS:
                    key = f"{layout}-{heads}-{dtype_name}-{backend}"
                    parity[key], stats[key]["forward"], stats[key]["total"] = run_ring(
                        dist.group.WORLD, n, r, layout, ng, dtype, backend)

    # sub-rings, every rank creating every group in one order: strided pairs (positions differ from
    # global ranks, as in hybrid's ring groups) on 4 ranks, and rings of one (the degenerate case)
    subgroups = {}
    if n == 4:
        for members in ([0, 2], [1, 3]):
            group = dist.new_group(members)
            if r in members:
                subgroups["pair"] = (group, members)
    for single in range(n):
        group = dist.new_group([single])
        if r == single:
            subgroups["single"] = (group, [single])
    for kind, (group, members) in subgroups.items():
        for layout in LAYOUTS:
            key = f"{kind}-{layout}"
            parity[key], stats[key]["forward"], stats[key]["total"] = run_ring(
                group, len(members), members.index(r), layout, KV_HEADS["gqa"], torch.float32, "fast", seed=7)

    # an odd local sequence cannot hold two equal chunks: refused before any communication
    odd = torch.zeros(5, 1, 2, 8)
    try:
        ring_attention(odd, odd, odd, group=dist.group.WORLD, causal=True, load_balanced=True)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return {"parity": parity, "stats": dict(stats), "odd_refused": refused}
