"""Memory engines (hyper_adaptor.memory): activation bytes held on the device and step time of a GPT layer
stack under no recompute, full and selective recompute, swap of attention, swap of everything (with and
without prefetch) and torch's ``save_on_cpu``; optimizer offload's device state bytes and step time.

Run from the repository root (docs/features/memory.md says what each figure is and why)::

    python bench/memory.py            # 8 layers, hidden 256, seq 256, 11 rounds
    python bench/memory.py --quick    # 4 small layers, 2 rounds (smoke run)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench._memory_stack import Layer  # noqa: E402
from hyper_adaptor import platform  # noqa: E402
from hyper_adaptor.memory import (  # noqa: E402
    CheckpointPolicy,
    OffloadOptimizer,
    SwapManager,
    checkpoint_wrapper,
    swap_wrapper,
)
from hyper_adaptor.testing.measure import StorageTracker, machine, report  # noqa: E402
from hyper_adaptor.testing.measure import mib as _mib  # noqa: E402

aten = torch.ops.aten
# Selective recompute: the outputs of matmuls and of the attention kernel are saved, everything else (the
# norms, the activation function, elementwise ops) is recomputed — MindSpeed's --recompute-norm and
# --recompute-activation-function together, through CheckpointPolicy.
SAVE_MATMULS = {op: CheckpointPolicy.MUST_SAVE for op in (
    aten.mm.default, aten.addmm.default, aten.bmm.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_efficient_attention.default, aten._scaled_dot_product_cudnn_attention.default)}
DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "memory.json"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
CONFIGS = ("none", "full-recompute", "selective-recompute", "swap-attention", "swap-all", "swap-all+prefetch",
           "save_on_cpu")


def build(args, device) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Layer(args.hidden, args.heads) for _ in range(args.layers)).to(device, DTYPES[args.dtype])


# ------------------------------------------------------------------------------------------- configurations
class Config:
    """A configured copy of the stack: ``forward(x)`` runs it; ``manager`` is its SwapManager, if any."""

    def __init__(self, name: str, base: nn.ModuleList) -> None:
        self.name, self.stack, self.manager = name, copy.deepcopy(base), None
        if name == "full-recompute":
            for layer in self.stack:
                checkpoint_wrapper(layer)
        elif name == "selective-recompute":
            for layer in self.stack:
                checkpoint_wrapper(layer, policy=SAVE_MATMULS)
        elif name.startswith("swap"):
            self.manager = SwapManager(min_bytes=0, prefetch=0 if name == "swap-all" else 1)
            for i, layer in enumerate(self.stack):
                swap_wrapper(layer.attention if name == "swap-attention" else layer, manager=self.manager, tag=i)
        self.host_copy = False  # set while save_on_cpu copies a saved tensor (its copy is host tier)

    def hooks(self):
        if self.name != "save_on_cpu":
            return contextlib.nullcontext()
        dev = platform.device_type()
        ctx = torch.autograd.graph.save_on_cpu(pin_memory=True, device_type="cuda" if dev == "cpu" else dev)
        pack = ctx.pack_hook

        def marked_pack(t):
            self.host_copy = True
            try:
                return pack(t)
            finally:
                self.host_copy = False

        ctx.pack_hook = marked_pack
        return ctx

    def forward(self, x):
        with self.hooks():
            h = x * 1.0  # a non-leaf input, as inside a model
            for layer in self.stack:
                h = layer(h)
            return h.float().square().mean()


class SavedCounter:
    """Saved-tensor hooks that count the bytes of every saved storage (parameters excluded)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, t):
        if not isinstance(t, nn.Parameter) and not (t.is_leaf and t.requires_grad) and not (
                t._base is not None and t._base.is_leaf and t._base.requires_grad):
            self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


# ------------------------------------------------------------------------------------------- measurements
def grads_of(stack) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in stack.parameters()]


def measure_memory(cfg: Config, x: torch.Tensor) -> dict:
    """One step: device activations at the end of the forward, the engines' accounting, loss and grads."""
    dev = x.device.type
    cfg.stack.zero_grad(set_to_none=True)
    excluded = {t.untyped_storage().data_ptr() for t in list(cfg.stack.parameters()) + [x]}
    if cfg.manager is not None:
        cfg.manager.reset_peak()
        moved_before = cfg.manager.moved_bytes
    counter = SavedCounter()
    result = {}
    if dev == "cpu":
        tracker = StorageTracker(dev, skip=lambda: cfg.host_copy)
        with tracker:
            if cfg.name == "none":
                with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                    loss = cfg.forward(x)
            else:
                loss = cfg.forward(x)
        pool = cfg.manager.pool if cfg.manager is not None else None
        result["device_activation_bytes"] = tracker.alive_bytes(
            lambda ptr: ptr in excluded or (pool is not None and pool.owns(ptr)))
        result["method"] = "storage tracker at the end of the forward"
        result["forward_end_bytes"] = result["device_activation_bytes"]
        loss.backward()
    else:
        module = platform.device_module(dev)
        platform.synchronize()
        module.reset_peak_memory_stats()
        before = module.memory_allocated()
        if cfg.name == "none":
            with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
                loss = cfg.forward(x)
        else:
            loss = cfg.forward(x)
        platform.synchronize()
        # held between forward and backward (what the 1/L target is about), then the peak a user sees
        # over forward + backward: that one also holds the parameters' gradients and, with prefetch, the
        # group loaded ahead beside the one whose backward runs
        result["forward_end_bytes"] = module.memory_allocated() - before
        loss.backward()
        platform.synchronize()
        result["device_activation_bytes"] = module.max_memory_allocated() - before
        result["method"] = "max_memory_allocated over forward + backward, minus what was allocated before"
    if cfg.manager is not None:
        result["accounting_bytes"] = cfg.manager.peak_device_bytes
        result["moved_bytes"] = cfg.manager.moved_bytes - moved_before
    elif cfg.name == "none":
        result["accounting_bytes"], result["moved_bytes"] = counter.bytes, 0
    elif cfg.name == "save_on_cpu":
        result["accounting_bytes"] = 0  # every saved tensor is copied to the host tier
        result["moved_bytes"] = None
    else:
        result["accounting_bytes"], result["moved_bytes"] = None, 0
    result["loss"] = loss.detach()
    result["grads"] = grads_of(cfg.stack)
    return result


def timed_step(fn) -> float:
    platform.synchronize()
    start = time.perf_counter()
    fn()
    platform.synchronize()
    return time.perf_counter() - start


def interleaved(steps: dict, rounds: int) -> dict:
    """Median seconds per named step, rounds interleaved (reversed on odd rounds)."""
    names, times = list(steps), {name: [] for name in steps}
    for name in names:  # warm-up
        steps[name]()
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(timed_step(steps[name]))
    return {name: statistics.median(ts) for name, ts in times.items()}


def max_rel_diff(a: list, b: list) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))


def activation_rows(args, device) -> list:
    base = build(args, device)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1)).to(
        device, DTYPES[args.dtype])
    configs = {name: Config(name, base) for name in CONFIGS}
    memory = {name: measure_memory(cfg, x) for name, cfg in configs.items()}

    def step(cfg):
        def run():
            cfg.stack.zero_grad(set_to_none=True)
            cfg.forward(x).backward()
        return run

    seconds = interleaved({name: step(cfg) for name, cfg in configs.items()}, args.rounds)
    ref = memory["none"]
    rows = []
    for name in CONFIGS:
        m = memory[name]
        rows.append({
            "config": name,
            "device_activation_bytes": m["device_activation_bytes"],
            "ratio_to_none": m["device_activation_bytes"] / ref["device_activation_bytes"],
            "forward_end_bytes": m["forward_end_bytes"],
            "accounting_bytes": m["accounting_bytes"],
            "moved_bytes": m["moved_bytes"],
            "step_s": seconds[name],
            "time_ratio": seconds[name] / seconds["none"],
            "loss_diff": abs(m["loss"] - ref["loss"]).item(),
            "grad_max_rel_diff": max_rel_diff(m["grads"], ref["grads"]),
            "method": m["method"],
        })
    return rows


def optimizer_rows(args, device) -> list:
    base = build(args, device)
    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1)).to(
        device, DTYPES[args.dtype])
    setups = {
        "device Adam": lambda stack: torch.optim.Adam(stack.parameters(), lr=1e-3),
        "offload Adam (fraction 1.0)": lambda stack: OffloadOptimizer(stack.parameters(), torch.optim.Adam, lr=1e-3),
        "offload Adam (fraction 0.5)": lambda stack: OffloadOptimizer(stack.parameters(), torch.optim.Adam,
                                                                      offload_fraction=0.5, lr=1e-3),
    }
    runs = {}
    for name, make in setups.items():
        stack = copy.deepcopy(base)
        runs[name] = (stack, make(stack))

    def step(stack, opt):
        def run():
            opt.zero_grad(set_to_none=True)
            h = x * 1.0
            for layer in stack:
                h = layer(h)
            h.float().square().mean().backward()
            opt.step()
        return run

    for stack, opt in runs.values():  # 3 steps each from the same weights: parity
        for _ in range(3):
            step(stack, opt)()
    ref_params = list(runs["device Adam"][0].parameters())
    seconds = interleaved({name: step(*run) for name, run in runs.items()}, args.rounds)
    rows = []
    for name, (stack, opt) in runs.items():
        if isinstance(opt, OffloadOptimizer):
            state = opt.state_bytes()
        else:
            state = {"device": sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0), "host": 0}
        rows.append({
            "config": name,
            "device_state_bytes": state["device"],
            "host_state_bytes": state["host"],
            "step_s": seconds[name],
            "time_ratio": seconds[name] / seconds["device Adam"],
            "param_max_abs_diff_after_3_steps": None if name == "device Adam" else max(
                (a - b).abs().max().item() for a, b in zip(stack.parameters(), ref_params)),
        })
    return rows


def copy_bandwidth(device: str, nbytes: int = 256 * 2**20) -> dict | None:
    """Pinned host <-> device copy speed (GB/s, median of 5): the floor under what swap can hide."""
    if not platform.copies_are_async(device):
        return None
    host = platform.host_buffer(nbytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    speeds = {}
    for name, (dst, src) in {"device_to_host": (host, dev), "host_to_device": (dev, host)}.items():
        times = [timed_step(lambda: dst.copy_(src, non_blocking=True)) for _ in range(6)][1:]
        speeds[name + "_gb_s"] = nbytes / statistics.median(times) / 1e9
    return speeds


def run(args) -> dict:
    device = platform.device_type()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = activation_rows(args, device)
    bandwidth = copy_bandwidth(device)
    for r in rows:  # the least a step that moves these bytes out and back can take over this link
        r["copy_floor_s"] = None if not (bandwidth and r["moved_bytes"]) else (
            r["moved_bytes"] / (bandwidth["device_to_host_gb_s"] * 1e9)
            + r["moved_bytes"] / (bandwidth["host_to_device_gb_s"] * 1e9))
    none_forward_end = next(r for r in rows if r["config"] == "none")["forward_end_bytes"]
    opt_rows = [] if args.activations_only else optimizer_rows(args, device)
    swap_all = next(r for r in rows if r["config"] == "swap-all+prefetch")
    return {
        "bench": "memory",
        "device": device,
        "copies_overlap_compute": platform.copies_are_async(device),
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "machine": machine(),
        "copy_bandwidth": bandwidth,
        "activations": rows,
        "optimizer": opt_rows,
        "targets": {
            # between forward and backward (on cpu the tracker's figure is that one)
            "swap_all_device_bytes_le_1_over_L_plus_last_layer": {
                "target_bytes": 2 * none_forward_end / args.layers,
                "measured_bytes": swap_all["forward_end_bytes"],
                "met": swap_all["forward_end_bytes"] <= 2 * none_forward_end / args.layers},
            "swap_prefetch_time_ratio_le_1.10_on_gpu": None if device == "cpu" else swap_all["time_ratio"] <= 1.10,
        },
    }


def mib(n) -> str:
    return _mib(n, "8.2f")


def table(result: dict) -> str:
    c = result["config"]
    lines = [f"memory engines, {result['device']}: {c['layers']} layers, hidden {c['hidden']}, heads {c['heads']}, "
             f"seq {c['seq']}, batch {c['batch']}, {c.get('dtype', 'fp32')}; median of {c['rounds']} interleaved rounds"
             + ("" if result["copies_overlap_compute"] else "; cpu: copies are synchronous (no overlap)"),
             "",
             f"{'configuration':22s} {'device act MiB':>14s} {'/ none':>7s} {'fwd end MiB':>12s} "
             f"{'accounting MiB':>15s} "
             f"{'moved MiB':>10s} {'step s':>8s} {'time / none':>11s} {'grad diff':>10s}"]
    for r in result["activations"]:
        lines.append(f"{r['config']:22s} {mib(r['device_activation_bytes']):>14s} {r['ratio_to_none']:7.3f} "
                     f"{mib(r['forward_end_bytes']):>12s} "
                     f"{mib(r['accounting_bytes']):>15s} {mib(r['moved_bytes']):>10s} {r['step_s']:8.3f} "
                     f"{r['time_ratio']:11.3f} {r['grad_max_rel_diff']:10.2e}"
                     + ("" if r.get("copy_floor_s") is None else f"  copy floor {r['copy_floor_s'] * 1e3:.1f} ms"))
    t = result["targets"]["swap_all_device_bytes_le_1_over_L_plus_last_layer"]
    if result.get("copy_bandwidth"):
        bw = result["copy_bandwidth"]
        lines += ["", f"pinned copies: device->host {bw['device_to_host_gb_s']:.1f} GB/s, "
                      f"host->device {bw['host_to_device_gb_s']:.1f} GB/s"]
    lines += ["", f"target, between forward and backward: swap-all+prefetch <= 1/L of none + the last layer = "
                  f"{mib(t['target_bytes']).strip()} MiB: "
                  f"measured {mib(t['measured_bytes']).strip()} MiB -> {'met' if t['met'] else 'NOT met'}",
              ""] + ([] if not result["optimizer"] else [
              f"{'optimizer':28s} {'device state MiB':>16s} {'host state MiB':>15s} {'step s':>8s} "
              f"{'time / device':>13s} {'param diff (3 steps)':>20s}"])
    for r in result["optimizer"]:
        diff = "-" if r["param_max_abs_diff_after_3_steps"] is None else f"{r['param_max_abs_diff_after_3_steps']:.1e}"
        lines.append(f"{r['config']:28s} {mib(r['device_state_bytes']):>16s} {mib(r['host_state_bytes']):>15s} "
                     f"{r['step_s']:8.3f} {r['time_ratio']:13.3f} {diff:>20s}")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared 2-core VM, more threads wait on each other)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="parameters and activations (bf16: what GPT training runs on a GPU)")
    parser.add_argument("--activations-only", action="store_true", help="skip the optimizer offload rows")
    parser.add_argument("--quick", action="store_true", help="4 layers, hidden 128, seq 128, 2 rounds")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.hidden, args.seq, args.rounds = 4, 128, 128, 2
    result = run(args)
    return report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
