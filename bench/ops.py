"""Fused ops (level 1): forward+backward time and saved activation bytes, fused vs eager vs megatron-core,
at shapes scaled down from real models.

Run from the repository root (docs/features/fused-kernels.md says what each path is and how it is measured)::

    python bench/ops.py                 # scale 4, 10 repeats
    python bench/ops.py --quick         # scale 8, 4 repeats (smoke run)
    python bench/ops.py --dtype bf16    # -> bench/results/ops-bf16.json
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import hyper_adaptor.megatron_adaptor  # noqa: E402,F401
from hyper_adaptor import platform as ha_platform  # noqa: E402
from hyper_adaptor.testing.measure import free_port, machine, quick_json, write  # noqa: E402

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "ops.json"


def saved_bytes(fn) -> int:
    """Bytes of tensors autograd keeps for the backward of ``fn()`` (storage counted once)."""
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return total


def device_name() -> str | None:
    """The accelerator's name (e.g. ``NVIDIA H100 80GB HBM3``); None on CPU."""
    dev = ha_platform.device_type()
    if dev == "cpu":
        return None
    module = ha_platform.device_module()
    return module.get_device_name(module.current_device()) if hasattr(module, "get_device_name") else dev


def timed(fn, grad_of) -> float:
    """Forward + backward wall time; the device is drained before the clock starts and before it is read
    (kernels on CUDA/NPU run asynchronously to the host)."""
    ha_platform.synchronize()
    start = time.perf_counter()
    out = fn()
    out.backward(grad_of(out))
    ha_platform.synchronize()
    return time.perf_counter() - start


class Case:
    def __init__(self, name, shape_note, make, paths):
        self.name, self.shape_note, self.make, self.paths = name, shape_note, make, paths


def _leaf(shape, dtype, seed):
    """Seeded numbers drawn on the CPU (identical on every device), then moved: the leaf is the device tensor."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(device=ha_platform.current_device(), dtype=dtype).requires_grad_()


def cases(scale: int, dtype: torch.dtype, backend: str | None):
    from hyper_adaptor.ops import attention as att
    from hyper_adaptor.ops import rms_norm as rn
    from hyper_adaptor.ops import rope
    from hyper_adaptor.ops import swiglu as sw
    from hyper_adaptor.ops import wgrad_accum as wg

    hidden, seq, heads, head_dim = 4096 // scale, 4096 // scale, 32 // scale, 128
    ffn = 11008 // scale
    tokens = seq  # micro-batch 1
    device = ha_platform.current_device()
    out = []

    # RMSNorm
    def make_norm():
        x = _leaf((seq, 1, hidden), dtype, 1)
        w = torch.ones(hidden, dtype=dtype, device=device).requires_grad_()
        ref = torch.nn.RMSNorm(hidden, eps=1e-5, dtype=dtype, device=device)
        return x, w, ref

    out.append(Case("rms_norm", f"[s={seq}, b=1, h={hidden}]", make_norm, {
        "fused": lambda x, w, ref: rn.rms_norm(x, w, 1e-5, backend=backend),
        "eager": lambda x, w, ref: rn.rms_norm(x, w, 1e-5, backend="eager"),
        "megatron": lambda x, w, ref: ref(x),
    }))

    # SwiGLU (no bias, as in Llama-style MLPs)
    def make_swiglu():
        return (_leaf((seq, 1, 2 * ffn), dtype, 2),)

    def megatron_glu(x):
        a, b = torch.chunk(x, 2, dim=-1)
        return torch.nn.functional.silu(a) * b

    out.append(Case("swiglu", f"[s={seq}, b=1, 2*ffn={2 * ffn}]", make_swiglu, {
        "fused": lambda x: sw.swiglu(x, backend=backend),
        "eager": lambda x: sw.swiglu(x, backend="eager"),
        "megatron": megatron_glu,
    }))

    # RoPE
    def make_rope():
        t = _leaf((seq, 1, heads, head_dim), dtype, 3)
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :].to(device)
        return t, freqs

    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    out.append(Case("rope", f"[s={seq}, b=1, n={heads}, d={head_dim}]", make_rope, {
        "fused": lambda t, f: rope.apply_rotary(t, f, backend=backend),
        "eager": lambda t, f: rope.apply_rotary(t, f, backend="eager"),
        "megatron": lambda t, f: _apply_rotary_pos_emb_bshd(t, f, rotary_interleaved=False),
    }))

    # Core attention, causal
    def make_attention():
        q = _leaf((seq, 1, heads, head_dim), dtype, 4)
        k = _leaf((seq, 1, heads, head_dim), dtype, 5)
        v = _leaf((seq, 1, heads, head_dim), dtype, 6)
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
        return q, k, v, mask

    scale_qk = head_dim ** -0.5
    out.append(Case("attention (causal)", f"[s={seq}, b=1, n={heads}, d={head_dim}]", make_attention, {
        "fused": lambda q, k, v, m: att.attention(q, k, v, causal=True, scale=scale_qk, backend=backend),
        "eager": lambda q, k, v, m: att.attention(q, k, v, causal=True, mask=m, scale=scale_qk, backend="eager"),
        "megatron": _megatron_attention(heads, head_dim, dtype),
    }))

    # Weight-gradient GEMM accumulated into fp32 main_grad (no autograd: time the call alone)
    def make_wgrad():
        x = _leaf((tokens, hidden), dtype, 7).detach()
        g = _leaf((tokens, ffn), dtype, 8).detach()
        main_grad = torch.zeros(ffn, hidden, dtype=torch.float32, device=device)
        return x, g, main_grad

    out.append(Case("wgrad accumulate (fp32 main_grad)", f"[tokens={tokens}] x [{hidden} -> {ffn}]", make_wgrad, {
        "fused": lambda x, g, mg: wg.wgrad_accum(x, g, mg, backend=backend),
        "eager": lambda x, g, mg: wg.wgrad_accum(x, g, mg, backend="eager"),
        "megatron": lambda x, g, mg: mg.add_(g.t().matmul(x)),
    }))

    # MoE experts (SwiGLU) through grouped GEMMs vs megatron's SequentialMLP (one expert at a time)
    moe = moe_shape(scale)
    experts_module, grouped_forward = _megatron_experts(moe, dtype)

    def make_experts():
        g = torch.Generator().manual_seed(9)
        rows = moe["tokens"] * moe["topk"]
        # tokens_per_expert stays on the CPU, as megatron's token dispatchers hand it to SequentialMLP (both
        # SequentialMLP and the grouped GEMM read it with .tolist(); a device tensor would add a sync)
        counts = torch.distributions.Multinomial(rows, torch.ones(moe["experts"])).sample().long()
        hidden_states = _leaf((rows, moe["hidden"]), dtype, 10)
        probs = torch.rand(rows, generator=g).to(device).requires_grad_()
        return hidden_states, counts, probs

    out.append(Case("moe experts (grouped GEMM)",
                    f"[{moe['tokens']} tok x top-{moe['topk']}, h={moe['hidden']}, ffn={moe['ffn']}, "
                    f"E={moe['experts']}]",
                    make_experts, {
        "fused": lambda h, c, p: _on_backend(backend, grouped_forward, experts_module, h, c, p)[0],
        "eager": lambda h, c, p: _on_backend("eager", grouped_forward, experts_module, h, c, p)[0],
        "megatron": lambda h, c, p: experts_module(h, c, p)[0],
    }))
    shapes = dict(hidden=hidden, seq=seq, heads=heads, head_dim=head_dim, ffn=ffn, scale=scale, moe=moe)
    return out, shapes


# Fine-grained MoE (Qwen3-30B-A3B: hidden 2048, expert ffn 768, 128 experts, top-8, sequence 4096),
# hidden, ffn, experts, top-k and tokens each divided by the scale.
MOE_MODEL = dict(name="Qwen3-30B-A3B", hidden=2048, ffn=768, experts=128, topk=8, tokens=4096)


def moe_shape(scale: int) -> dict:
    shape = {k: max(1, v // scale) for k, v in MOE_MODEL.items() if k != "name"}
    return dict(shape, model=MOE_MODEL["name"])


def _on_backend(name, fn, *args):
    """``fn(*args)`` with every fused op's first backend forced to ``name`` (None: the platform's)."""
    from hyper_adaptor.ops import backend as ops_backend

    previous = ops_backend._forced
    ops_backend.force_backend(name)
    try:
        return fn(*args)
    finally:
        ops_backend._forced = previous


def _megatron_experts(moe: dict, dtype):
    """megatron-core's SequentialMLP (local spec, SwiGLU with megatron's fused weighted SwiGLU), and
    its forward as the ``--moe-grouped-gemm`` patch runs it (without patching the class)."""
    import torch.nn.functional as F

    from hyper_adaptor.patches.fused import grouped_gemm as grouped_patch

    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    _world_of_one()
    config = TransformerConfig(num_layers=1, hidden_size=moe["hidden"], num_attention_heads=4,
                               num_moe_experts=moe["experts"], moe_ffn_hidden_size=moe["ffn"],
                               moe_router_topk=moe["topk"], moe_router_pre_softmax=moe["topk"] == 1,
                               gated_linear_unit=True, activation_func=F.silu,
                               add_bias_linear=False, bias_activation_fusion=True, moe_grouped_gemm=True,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16, use_cpu_initialization=True)
    # initialised on the CPU (seeded, the same weights on every device), then moved with its dtype kept
    module = SequentialMLP(moe["experts"], config,
                           MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
                           pg_collection=ProcessGroupCollection.use_mpu_process_groups()).to(ha_platform.current_device())
    return module, grouped_patch._wrap_forward(SequentialMLP.forward)


_ATTN = {}


def _world_of_one() -> None:
    """A gloo group of one and megatron's model-parallel state, for megatron's own modules."""
    import torch.distributed as dist

    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
        tensor_parallel.model_parallel_cuda_manual_seed(1)


def _megatron_attention(heads, head_dim, dtype):
    """megatron-core's DotProductAttention (local spec) in a world of one."""
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    _world_of_one()
    config = TransformerConfig(num_layers=1, hidden_size=heads * head_dim, num_attention_heads=heads,
                               attention_dropout=0.0, masked_softmax_fusion=False, params_dtype=dtype,
                               bf16=dtype == torch.bfloat16)
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                 attention_type="self").to(ha_platform.current_device())
    return lambda q, k, v, m: module(q, k, v, m)


def run(args) -> dict:
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    all_cases, shapes = cases(args.scale, dtype, args.backend)
    if args.only:
        all_cases = [c for c in all_cases if any(word in c.name for word in args.only.split(","))]
    rows = []
    for case in all_cases:
        inputs = case.make()
        no_grad = case.name.startswith("wgrad")
        times = {name: [] for name in case.paths}
        for _ in range(args.warmup):
            for fn in case.paths.values():
                _one(fn, inputs, no_grad)
        for r in range(args.repeats):
            order = list(case.paths) if r % 2 == 0 else list(reversed(case.paths))
            for name in order:
                times[name].append(_one(case.paths[name], inputs, no_grad))
        med = {name: statistics.median(t) * 1000 for name, t in times.items()}
        mem = {name: (0 if no_grad else saved_bytes(lambda fn=fn: fn(*inputs))) for name, fn in case.paths.items()}
        rows.append({"op": case.name, "shape": case.shape_note, "median_ms": med, "saved_bytes": mem,
                     "speedup_vs_eager": med["eager"] / med["fused"],
                     "speedup_vs_megatron": med["megatron"] / med["fused"]})
        print(f"  {case.name}: fused {med['fused']:.2f} ms, eager {med['eager']:.2f} ms, "
              f"megatron {med['megatron']:.2f} ms",
              flush=True)
    return {"benchmark": "ops", "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": ha_platform.device_type(), "device_name": device_name(), "dtype": args.dtype,
            "backend": args.backend or "platform default",
            "shapes": shapes, "scale_note": (f"real model dims divided by {args.scale} (head dim kept at 128; MoE: "
                           f"{shapes['moe']['model']}'s hidden, expert ffn, experts, top-k and tokens)"),
            "machine": machine(),
            "repeats": args.repeats, "rows": rows,
            "attention_memory": attention_memory_sweep(shapes["heads"], shapes["head_dim"], dtype, args.backend)}


def attention_memory_sweep(heads: int, head_dim: int, dtype: torch.dtype, backend: str | None) -> list[dict]:
    """Bytes autograd saves for causal attention as the sequence doubles: O(s) fused, O(s^2) eager."""
    from hyper_adaptor.ops import attention as att

    rows = []
    for seq in (256, 512, 1024, 2048):
        q, k, v = (_leaf((seq, 1, heads, head_dim), dtype, i) for i in (4, 5, 6))
        mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=ha_platform.current_device()),
                          diagonal=1)[None, None]
        fused = saved_bytes(lambda: att.attention(q, k, v, causal=True, scale=head_dim ** -0.5, backend=backend))
        eager = saved_bytes(lambda: att.attention(q, k, v, causal=True, mask=mask, scale=head_dim ** -0.5,
                                                  backend="eager"))
        rows.append({"seq": seq, "fused_saved_bytes": fused, "eager_saved_bytes": eager})
    return rows


def _one(fn, inputs, no_grad) -> float:
    if no_grad:
        ha_platform.synchronize()
        start = time.perf_counter()
        fn(*inputs)
        ha_platform.synchronize()
        return time.perf_counter() - start
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.grad is not None:
            t.grad = None
    return timed(lambda: fn(*inputs), torch.ones_like)


def table(result: dict) -> str:
    head = ("op", "shape", "fused ms", "eager ms", "megatron ms", "x eager", "x megatron",
            "saved MiB fused/eager/megatron")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in result["rows"]:
        m, s = r["median_ms"], r["saved_bytes"]
        mib = "/".join(f"{s[k] / 2**20:.1f}" for k in ("fused", "eager", "megatron"))
        lines.append(" | ".join((r["op"], r["shape"], f"{m['fused']:.2f}", f"{m['eager']:.2f}", f"{m['megatron']:.2f}",
                                 f"{r['speedup_vs_eager']:.2f}", f"{r['speedup_vs_megatron']:.2f}", mib)))
    sweep = ["", "| seq | attention saved MiB fused | eager | fused growth per 2x seq | eager growth |",
             "| --- | --- | --- | --- | --- |"]
    prev = None
    for r in result["attention_memory"]:
        f, e = r["fused_saved_bytes"] / 2**20, r["eager_saved_bytes"] / 2**20
        growth = ("-", "-") if prev is None else (f"{f / prev[0]:.2f}x", f"{e / prev[1]:.2f}x")
        sweep.append(f"| {r['seq']} | {f:.1f} | {e:.1f} | {growth[0]} | {growth[1]} |")
        prev = (f, e)
    return "\n".join(f"| {line} |" for line in lines) + "\n" + "\n".join(sweep)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=int, default=4, help="divide real dims by this (default 4)")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--backend", choices=("npu", "fast", "eager"), default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="--scale 8 --repeats 4 --warmup 1")
    parser.add_argument("--only", default="", help="comma-separated words: run only the ops whose name has one")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.scale, args.repeats, args.warmup = 8, 4, 1
    result = run(args)
    print(f"\n{result['scale_note']}; {result['device']}"
          f"{' (' + result['device_name'] + ')' if result['device_name'] else ''}, {result['dtype']}, "
          f"{result['machine']['torch_threads']} threads\n")
    print(table(result))
    path = quick_json(args.json, args.quick)
    if args.dtype != "fp32" or args.backend:
        path = path.with_name(f"{path.stem}-{args.dtype}{'-' + args.backend if args.backend else ''}{path.suffix}")
    write(result, path)
    return result


if __name__ == "__main__":
    main()
