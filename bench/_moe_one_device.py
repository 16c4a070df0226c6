"""One MoE layer on one accelerator (``bench/expert_parallel.py --one-device``): megatron's ``MoELayer``
with its all-to-all dispatcher, the same layer with the engine's dispatcher (what
``--moe-dispatcher-engine hyper`` installs) and the engine's own ``MoE`` block (grouped GEMM experts), at
expert parallel 1 on a one-rank group of the device's backend (NCCL on CUDA): time per forward + backward
and the device's peak allocated bytes per contender, in one process. One device cannot run an all-to-all
between ranks, so this measures what the engine changes on the device: permutation, the dispatcher's host
syncs and the experts' GEMMs."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from bench import _moe_layer
from hyper_adaptor import platform

CONTENDERS = ("megatron-alltoall", "engine", "engine-block")


def dims(quick: bool) -> dict:
    if quick:
        return {"hidden": 128, "ffn": 256, "experts": 8, "topk": 2, "seq": 256, "micro": 1}
    return {"hidden": 2048, "ffn": 1024, "experts": 16, "topk": 4, "seq": 4096, "micro": 1}


def _engine_block(d: dict, dtype, device):
    """The engine's ``MoE`` with the weights megatron's layers get (``_moe_layer.full_weights``)."""
    from hyper_adaptor.parallel.expert import MoE

    router, fc1, fc2 = _moe_layer.full_weights(d)
    h, f, e = d["hidden"], d["ffn"], d["experts"]
    moe = MoE(h, f, e, d["topk"], aux_loss_coeff=1e-2, normalize_topk=True)
    with torch.no_grad():
        moe.router.weight.copy_(router)
        moe.experts.w_gate.copy_(fc1[:, :f])
        moe.experts.w_up.copy_(fc1[:, f:])
        moe.experts.w_down.copy_(fc2)
    return moe.to(device=device, dtype=dtype)


def _step(layer, x, probe):
    x = x.clone().requires_grad_()
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    (out * probe).sum().backward()


def _step_peak(layer, x, probe, dev: str) -> int:
    if dev == "cpu":
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(layer)
        with tracker:
            _step(layer, x, probe)
        before = sum(p.numel() * p.element_size() for p in layer.parameters())  # no gradients yet
        return sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values()) - before
    platform.synchronize()
    platform.device_module(dev).reset_peak_memory_stats()
    before = platform.current_memory_bytes()
    _step(layer, x, probe)
    platform.synchronize()
    return platform.peak_memory_bytes() - before


def run(quick: bool, steps: int, warmup: int, dtype_name: str) -> dict:
    import hyper_adaptor.megatron_adaptor  # noqa: F401  (the one line, as a pretrain script has it: level 0)

    from megatron.core import parallel_state as ps

    dev = platform.device_type()
    device = platform.current_device()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    d = dims(quick)
    if not dist.is_initialized():
        from hyper_adaptor.testing import free_port

        dist.init_process_group(platform.distributed_backend(dev), init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
    x, probe = (t.to(device=device, dtype=dtype) for t in _moe_layer.inputs(d, 0))
    layers = {"megatron-alltoall": _moe_layer.build(d, 1, "alltoall")}
    manager = _moe_layer.install_engine()
    layers["engine"] = _moe_layer.build(d, 1, "engine")
    layers = {name: layer.to(device=device, dtype=dtype) for name, layer in layers.items()}
    layers["engine-block"] = _engine_block(d, dtype, device)
    rows = {}
    with torch.no_grad():  # the same weights and tokens: each contender's output against megatron's
        outputs = {name: layer(x) for name, layer in layers.items()}
        outputs = {name: (out[0] if isinstance(out, tuple) else out).float() for name, out in outputs.items()}
    reference = outputs["megatron-alltoall"]
    for name in CONTENDERS:
        layer = layers[name]
        for _ in range(warmup):
            layer.zero_grad(set_to_none=True)
            _step(layer, x, probe)
        platform.synchronize()
        times = []
        for _ in range(steps):
            layer.zero_grad(set_to_none=True)
            start = time.perf_counter()
            _step(layer, x, probe)
            platform.synchronize()
            times.append(time.perf_counter() - start)
        # the peak of one more step over what is allocated before it (the other contenders' weights stay
        # allocated: the same for every contender). On an accelerator its allocator's peak; on the CPU, which
        # keeps no allocator statistics (the process's RSS says little here), the peak of live tensors
        # seen by torch's MemTracker
        layer.zero_grad(set_to_none=True)
        step_peak = _step_peak(layer, x, probe, dev)
        rows[name] = {"step_ms": [1e3 * t for t in times], "median_ms": 1e3 * statistics.median(times),
                      "step_peak_mib": step_peak / 2**20,
                      "output_max_diff": float((outputs[name] - reference).abs().max() / reference.abs().max())}
    ps.destroy_model_parallel()
    manager.undo()
    device_name = (platform.device_module(dev).get_device_name() if dev == "cuda" else dev)
    return {"device": device_name, "dtype": dtype_name, "dims": d, "tokens": d["seq"] * d["micro"],
            "contenders": rows}


def table(result: dict) -> str:
    d = result["dims"]
    head = ("| contender | median step ms (fwd+bwd) | step peak MiB over allocated "
            "| output vs megatron's (max, relative) |")
    lines = [f"One MoE layer on {result['device']} ({result['dtype']}; hidden {d['hidden']}, ffn {d['ffn']}, "
             f"{d['experts']} experts top-{d['topk']}, {result['tokens']} tokens, expert parallel 1)", "",
             head, "|---|---|---|---|"]
    for name, row in result["contenders"].items():
        lines.append(f"| {name} | {row['median_ms']:.2f} | {row['step_peak_mib']:.1f} | {row['output_max_diff']:.1e} |")
    return "\n".join(lines)
