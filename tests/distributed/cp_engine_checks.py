"""Context-parallel engine checks, run inside a gloo world (hyper_adaptor/testing/world.py).

Every rank builds the same seeded full-sequence q, k, v and output gradient, computes the reference
with single-process ``attention()`` (eager, fp32) and autograd on the whole sequence, then runs the CP
engine on its own shard (megatron's load-balanced layout or the contiguous one) and compares its
output and q/k/v gradients with the reference rows it owns. Errors come back as numbers; the
tolerances live in tests/distributed/test_context_parallel.py. One world runs many checks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from hyper_adaptor.ops.attention import attention

B, HN, NP = 2, 8, 4
CHUNK = 3  # rows per chunk of 2N: odd, so a half-chunk or off-by-one slice cannot line up by accident
LAYOUTS = [(True, True), (True, False), (False, True), (False, False)]  # (causal, load_balanced)


def init(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)


def shard(full: torch.Tensor, r: int, n: int, load_balanced: bool, dim: int = 0) -> torch.Tensor:
    """Position r's rows of ``full`` (sequence at ``dim``), as megatron's get_batch_on_this_cp_rank cuts them."""
    if not load_balanced:
        return full.chunk(n, dim)[r]
    chunks = full.chunk(2 * n, dim)
    return torch.cat([chunks[r], chunks[2 * n - 1 - r]], dim)


def full_inputs(n: int, ng: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    s = 2 * n * CHUNK
    shapes = [(s, B, NP, HN), (s, B, ng, HN), (s, B, ng, HN), (s, B, NP, HN)]  # q, k, v, dout
    return [torch.randn(shape, generator=g).to(dtype) for shape in shapes]  # rounded once: both sides see them


def reference(q, k, v, dout, causal: bool) -> dict:
    leaves = [t.float().clone().requires_grad_() for t in (q, k, v)]  # a copy: .float() of fp32 is itself
    out = attention(*leaves, causal=causal, backend="eager").unflatten(2, q.shape[2:])
    out.backward(dout.float())
    return {"out": out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}


def errors(got: dict, want: dict) -> dict:
    """Per tensor: max abs error, and ||got - want|| / ||want|| (bf16), and the latter for got * 1.1."""
    report = {}
    for name, w in want.items():
        g = got[name].float()
        rel = lambda x: ((x - w).norm() / w.norm()).item()  # noqa: E731
        report[name] = {"max_abs": (g - w).abs().max().item(), "rel": rel(g), "rel_off_10pct": rel(g * 1.1)}
    return report


def run_case(groups, algo, *, causal, load_balanced, ng, dtype=torch.float32, seed=0, stats=None):
    from hyper_adaptor.parallel.context import context_parallel_attention

    n, r = groups.cp.size(), groups.cp.rank()
    q, k, v, dout = full_inputs(n, ng, dtype, seed)
    want = reference(q, k, v, dout, causal)
    want = {name: shard(t, r, n, load_balanced) for name, t in want.items()}
    local = [shard(t, r, n, load_balanced).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, groups=groups, algo=algo, causal=causal,
                                     load_balanced=load_balanced, stats=stats)
    out.backward(shard(dout, r, n, load_balanced))
    got = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    shapes_ok = all(got[name].shape == want[name].shape for name in want) and out.dtype == dtype
    return {"shapes_ok": shapes_ok, **errors(got, want)}


def engine_matrix(groups, algos, kv_heads) -> dict:
    """fp32 for every algorithm x layout x kv-head count; bf16 for two layouts and GQA."""
    results = {}
    for algo in algos:
        for causal, lb in LAYOUTS:
            for ng in kv_heads:
                key = f"{algo}-{'causal' if causal else 'full'}-{'lb' if lb else 'contig'}-ng{ng}-fp32"
                results[key] = run_case(groups, algo, causal=causal, load_balanced=lb, ng=ng, seed=len(results))
        for causal, lb, ng in [(True, True, kv_heads[1]), (True, False, kv_heads[-1]), (False, True, NP)]:
            key = f"{algo}-{'causal' if causal else 'full'}-{'lb' if lb else 'contig'}-ng{ng}-bf16"
            results[key] = run_case(groups, algo, causal=causal, load_balanced=lb, ng=ng, dtype=torch.bfloat16,
                                    seed=len(results))
    return results


# ----------------------------------------------------------------------------------------- the style
class CoreAttention(nn.Module):
    """Unsharded core attention in [b, s, h, d] (seq_dim=1, head_dim=2) through ``attention()``."""

    def __init__(self, causal=True):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, attention_mask=None):
        assert attention_mask is None
        out = attention(*(t.transpose(0, 1) for t in (q, k, v)), causal=self.causal)  # [s, b, h*d]
        return out.unflatten(2, q.shape[2:]).transpose(0, 1)


class SdpaAttention(nn.Module):
    """Unsharded core attention in [b, h, s, d] (seq_dim=2, head_dim=1) through PyTorch's SDPA."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def style_case(mesh, style_kwargs, *, module_cls=CoreAttention, seq_dim=1, head_dim=2, ng=2, dtype=torch.float32,
               seed=0) -> dict:
    """The module parallelized with ContextParallel on shards vs the same module on the whole sequence."""
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.context import ContextParallel

    n, r = mesh.size(), mesh.get_local_rank()
    lb = style_kwargs.get("load_balance", False)
    g = torch.Generator().manual_seed(seed)
    s = 2 * n * CHUNK
    shape = [B, B, B, HN]
    shape[seq_dim], shape[head_dim] = s, NP
    kv_shape = list(shape)
    kv_shape[head_dim] = ng
    q, dout = (torch.randn(shape, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(kv_shape, generator=g).to(dtype) for _ in range(2))

    leaves = [t.float().clone().requires_grad_() for t in (q, k, v)]  # a copy: .float() of fp32 is itself
    ref_out = module_cls()(*leaves)
    ref_out.backward(dout.float())
    want = {"out": ref_out.detach(), "dq": leaves[0].grad, "dk": leaves[1].grad, "dv": leaves[2].grad}
    want = {name: shard(t, r, n, lb, seq_dim) for name, t in want.items()}

    module = parallelize_module(module_cls(), mesh, ContextParallel(seq_dim=seq_dim, head_dim=head_dim,
                                                                    **style_kwargs))
    local = [shard(t, r, n, lb, seq_dim).clone().requires_grad_() for t in (q, k, v)]
    out = module(*local)
    out.backward(shard(dout, r, n, lb, seq_dim))
    got = {"out": out.detach(), "dq": local[0].grad, "dk": local[1].grad, "dv": local[2].grad}
    shapes_ok = all(got[name].shape == want[name].shape for name in want) and out.dtype == dtype
    return {"shapes_ok": shapes_ok, **errors(got, want)}


def style_matrix(mesh, variants: dict) -> dict:
    results = {}
    for name, kwargs in variants.items():
        for lb in (True, False):
            results[f"{name}-{'lb' if lb else 'contig'}"] = style_case(mesh, {**kwargs, "load_balance": lb},
                                                                       seed=len(results))
        results[f"{name}-bnsd-sdpa-mqa"] = style_case(mesh, {**kwargs, "load_balance": True}, module_cls=SdpaAttention,
                                                      seq_dim=2, head_dim=1, ng=1, seed=len(results))
    results["ulysses-bf16"] = style_case(mesh, {"load_balance": True}, dtype=torch.bfloat16, seed=99)
    return results


# ------------------------------------------------------------------------------------ bad arguments
def raised(fn) -> str:
    try:
        fn()
    except ValueError as error:
        return str(error)
    return "no ValueError"


def bad_arguments(mesh, groups) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.context import ContextParallel, build_cp_groups, context_parallel_attention

    n = mesh.size()
    q = torch.randn(2 * CHUNK, B, NP, HN)
    kv = torch.randn(2 * CHUNK, B, 1, HN)
    apply = lambda style, m=mesh: parallelize_module(CoreAttention(), m, style)  # noqa: E731
    once = apply(ContextParallel())
    report = {
        "degree_not_dividing": raised(lambda: apply(ContextParallel(ulysses_degree=3))),
        "ulysses_algo_partial_degree": raised(lambda: apply(ContextParallel(ulysses_degree=n // 2, algo="ulysses"))),
        "hybrid_whole_degree": raised(lambda: apply(ContextParallel(ulysses_degree=n, algo="hybrid"))),
        "two_d_mesh": raised(lambda: apply(ContextParallel(), init_device_mesh("cpu", (2, n // 2)))),
        "applied_twice": raised(lambda: parallelize_module(once, mesh, ContextParallel())),
        "mask_passed": raised(lambda: once(q, kv, kv, torch.ones(1, dtype=torch.bool))),
        "heads_not_divisible": raised(lambda: context_parallel_attention(
            q[:, :, :3], kv, kv, groups=groups, algo="ulysses")),
        "odd_rows_load_balanced": raised(lambda: context_parallel_attention(
            q[:-1], kv[:-1], kv[:-1], groups=groups, algo="allgather", load_balanced=True)),
        "unknown_algo": raised(lambda: context_parallel_attention(q, kv, kv, groups=groups, algo="p2p")),
        "cp_group_mismatch": raised(lambda: build_cp_groups(
            [list(range(0, n, 2)), list(range(1, n, 2))], cp_group=dist.group.WORLD)),
    }
    return report


# ------------------------------------------------------------------------------------------- worlds
def world_two(rank, world_size):
    """2 ranks: ulysses, all-gather and ring over the pair; the style; bad arguments."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_adaptor.parallel.context import build_cp_groups

    init(rank, world_size)
    groups = build_cp_groups([[0, 1]])
    mesh = init_device_mesh("cpu", (2,))
    return {
        "engine": engine_matrix(groups, ("ulysses", "allgather", "ring"), kv_heads=(4, 2, 1)),
        "style": style_matrix(mesh, {"ulysses": {}, "allgather": {"ulysses_degree": 1},
                                     "ring": {"algo": "ring"}}),
        "bad": bad_arguments(mesh, groups),
    }


def world_four(rank, world_size):
    """4 ranks: every algorithm over the whole world (hybrid 2x2); ulysses, all-gather and ring over two
    CP groups of non-adjacent ranks; the style on the whole mesh and on a 'cp' sub-mesh of a 2x2 mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    from hyper_adaptor.parallel.context import RingStats, build_cp_groups

    init(rank, world_size)
    whole = build_cp_groups([[0, 1, 2, 3]], ulysses_degree=2)
    strided = build_cp_groups([[0, 2], [1, 3]])
    membership = {name: dist.get_process_group_ranks(getattr(whole, name)) for name in ("cp", "ulysses", "ring")}
    membership["strided"] = dist.get_process_group_ranks(strided.cp)
    stats = RingStats()
    run_case(whole, "hybrid", causal=True, load_balanced=True, ng=2, stats=stats)
    mesh = init_device_mesh("cpu", (4,))
    sub = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))["cp"]
    return {
        "membership": membership,
        "hybrid_stats": vars(stats),
        "engine": engine_matrix(whole, ("ulysses", "allgather", "ring", "hybrid"), kv_heads=(4, 2, 1)),
        "strided": engine_matrix(strided, ("ulysses", "allgather", "ring"), kv_heads=(4, 1)),
        "style": style_matrix(mesh, {"ulysses": {}, "allgather": {"ulysses_degree": 1},
                                     "hybrid": {"ulysses_degree": 2}, "ring": {"algo": "ring"}}),
        "style_submesh": style_matrix(sub, {"ulysses": {}, "allgather": {"ulysses_degree": 1}}),
        "bad": bad_arguments(mesh, whole),
    }
