"""HSDP (hyper_adaptor.parallel.hsdp) against Megatron DDP, Megatron's distributed optimizer and
torch FSDP2: model-state memory and communication per rank against the ZeRO theory, step time.

Run from the repository root::

    python bench/hsdp.py            # about 5 minutes on 2 CPU cores (4 ranks, 33 rounds of 18 contenders)
    python bench/hsdp.py --quick    # smaller model, fewer steps (smoke run, under a minute)

One gloo world of N = 4 ranks (hyper_adaptor/testing/world.py), fp32, Adam (lr 1e-3, no weight decay,
no clipping), the same megatron-core GPTModel (local spec, TP = PP = 1, DP = 4, tied embedding, built
with ``use_cpu_initialization`` from one seed) under every contender:

* ``megatron-ddp``: megatron.core DistributedDataParallel + get_megatron_optimizer
  (``use_distributed_optimizer=False``, ``grad_reduce_in_fp32=True``);
* ``megatron-distopt``: the same with ``use_distributed_optimizer=True`` (ZeRO-1);
* ``hsdp-level{1,2,3}``: ``hsdp(layer, optimizer_level=..., threshold=0, comm_fusion=True)`` on every
  TransformerLayer, then on the root GPTModel, ``torch.optim.Adam(model.parameters(), foreach=True)``
  (the multi-tensor Adam torch picks by default on CUDA; megatron's optimizers step flat buffers);
  ``-t64`` rows: the same with the default threshold (64 KB: smaller parameters stay whole);
  ``-async`` rows: the same with ``comm_async=True`` (reductions overlap the rest of backward);
  on gloo HSDP reduce-scatters with an all-to-all exchange of point-to-point messages and a local sum
  (``_bucket.reduce_scatter``: gloo's ``reduce_scatter_tensor`` is a clone + all-reduce + copy) and
  all-gathers by sending its shard to every peer (``_bucket.all_gather``: gloo's all-gather is a ring);
  these sends count as their collective (see ``_VOLUME``); the ``-gloo`` rows use gloo's
  own reduce-scatter and all-gather (``hsdp(..., gloo_reduce_scatter_as_all_to_all=False,
  gloo_all_gather_as_all_to_all=False)``), as Megatron and FSDP2 do, to show what that choice is
  worth; at level 3 HSDP keeps the root and the last layer gathered from forward to backward (as FSDP2
  keeps its root), the ``-reshard-all`` row frees every unit after forward
  (``set_reshard_after_forward(True)``);
  every HSDP contender has its own CPU buffer pool (``hsdp(..., buffer_pool=HostBufferPool())``), whose
  reserved bytes are printed under the table; every HSDP row has ``bucket_size`` ``--bucket-kb``
  (default 4 MiB, below the 13 MiB model) but the ``-unbounded`` rows, ``bucket_size=-1``: the
  behaviour before the bucket bound (issue 18), the same-run reference for step time and peak;
* ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every layer, then the root, the same Adam
  (foreach).

A step is ``zero_grad``, forward (``model(tokens, position_ids, attention_mask, labels=labels).mean()``
on this rank's micro-batch), backward, (Megatron: ``finish_grad_sync``) and ``optimizer.step()``; no
pipeline schedule. Every contender sees the same batches. Rounds interleave the contenders (reversed
order on odd rounds) so machine drift falls on all alike; a barrier precedes each timed step and a
step's time is the slowest rank's.

What is measured
----------------
* parity, against Megatron DDP, within 1e-5 relative: the first-step loss (same initial weights) and
  the global norm of the reduced gradient after the first step (Adam's update is invariant to the
  gradient's scale, so a wrong averaging factor would not show in later losses). The loss of the last
  step (after ``warmup + steps - 1`` Adam updates) is printed as a check of the update.
* model state per rank after a step: bytes of parameters, gradients and optimizer state, each storage
  counted once (by ``data_ptr``), DTensors by their local shard, padding included. Parameters include
  full copies kept alive between steps (HSDP: ``_hsdp_param.full``; FSDP2: its unsharded parameters and
  all-gather outputs), gradients include full gradients kept alive (HSDP level 1: ``full.grad``) and
  Megatron's grad buffers, optimizer state is every tensor in the (inner) torch optimizer's ``state``
  plus Megatron's master shards. Theory for fp32 Adam (K = 16 bytes per parameter: 4 param, 4 grad,
  8 Adam moments; the fp32 parameter is its own master): DDP 16Ψ, ZeRO-1 8Ψ + 8Ψ/N, ZeRO-2 4Ψ + 12Ψ/N,
  ZeRO-3 16Ψ/N. These are the mixed-precision forms 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N with the
  2-byte param and grad copies at 4 bytes and no separate master (so 12 sharded bytes become 8).
  Parameters kept whole by the threshold carry the full 16 bytes on every rank.
* communication per rank in one steady-state step: every torch.distributed collective is counted
  (each module-level alias of the functions, e.g. Megatron's ``dist_reduce_scatter_func``, is
  rebound), all-gather and reduce-scatter as the full (unsharded) buffer, all-reduce as twice it,
  broadcast as the buffer; nested calls (``reduce_scatter_tensor`` -> ``reduce_scatter_single``)
  count once. Theory 2Ψ x 4 bytes for DDP / ZeRO-1 / ZeRO-2, 3Ψ x 4 bytes for ZeRO-3 / FSDP2. HSDP's own
  ``hsdp_comm_bytes()`` delta over the same step is printed as a cross-check.
* step time: median over the timed rounds after the warm-up, as ratios to Megatron's distributed
  optimizer and to FSDP2 (both ZeRO-style anchors).
* peak memory of a step per rank (:func:`measure_peaks`, :class:`PeakRise`): bytes live at the start
  of a steady-state step (model state as above + HSDP's pool) + the highest rise of allocated bytes
  during it — on CPU from the allocator's events (torch's profiler, ``profile_memory=True``), on
  CUDA/NPU ``max_memory_allocated`` — against the ZeRO theory as configured + the activations (the
  plain model's forward + backward, measured the same way) + 2 buckets, and as ratios to Megatron's
  distributed optimizer and to FSDP2.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_JSON = REPO_ROOT / "bench" / "results" / "hsdp.json"
WORLD = 4
SEED = 1234
LR = 1e-3
PARITY_RTOL = 1e-5

# name -> (kind, level, threshold KB); level names the ZeRO stage the contender implements
CONTENDERS = {
    "megatron-ddp": ("megatron", "ddp", None),
    "megatron-distopt": ("megatron", "zero1", None),
    "hsdp-level1": ("hsdp", "level1", 0),
    "hsdp-level2": ("hsdp", "level2", 0),
    "hsdp-level3": ("hsdp", "level3", 0),
    "hsdp-level1-t64": ("hsdp", "level1", 64),
    "hsdp-level2-t64": ("hsdp", "level2", 64),
    "hsdp-level3-t64": ("hsdp", "level3", 64),
    # comm_async=True: reductions started as buckets fill, waited at the end of backward
    "hsdp-level1-async": ("hsdp", "level1", 0),
    "hsdp-level2-async": ("hsdp", "level2", 0),
    "hsdp-level3-async": ("hsdp", "level3", 0),
    # gloo's own reduce_scatter_tensor (a clone + all-reduce + copy) and all_gather_into_tensor (a
    # ring) instead of HSDP's all-to-all ones: the collectives of megatron-distopt (level 1) and of
    # FSDP2 (level 3), to show what the all-to-alls are worth
    "hsdp-level1-gloo": ("hsdp", "level1", 0),
    "hsdp-level3-gloo": ("hsdp", "level3", 0),
    # every unit freed after forward and gathered again for backward: exactly 3Ψ
    "hsdp-level3-reshard-all": ("hsdp", "level3", 0),
    # bucket_size=-1: no bucket limit, the behaviour before issue 18 (the root's early all-gather of
    # every unit and level 1's end-of-backward reduce-scatter each one whole-model collective)
    "hsdp-level1-unbounded": ("hsdp", "level1", 0),
    "hsdp-level2-unbounded": ("hsdp", "level2", 0),
    "hsdp-level3-unbounded": ("hsdp", "level3", 0),
    "fsdp2": ("fsdp2", "zero3", None),
}
DEFAULT_BUCKET_KB_BENCH = 4096  # 4 MiB: smaller than the model (13 MiB), so the bound is not vacuous
ZERO_STAGE = {"ddp": "ddp", "zero1": "zero1", "level1": "zero1", "level2": "zero2", "level3": "zero3", "zero3": "zero3"}


def theory_state_bytes(stage: str, psi: int, n: int) -> float:
    """fp32 Adam model state per rank (bytes) for Ψ parameters over N ranks."""
    return {"ddp": 16 * psi, "zero1": 8 * psi + 8 * psi / n, "zero2": 4 * psi + 12 * psi / n,
            "zero3": 16 * psi / n}[stage]


def theory_comm_bytes(stage: str, psi: int) -> int:
    """Collective volume per rank per step (bytes, fp32): 2Ψ elements, 3Ψ when parameters are
    gathered again for backward (ZeRO-3)."""
    return (3 if stage == "zero3" else 2) * psi * 4


def configured_theory(stage: str, psi: int, n: int, psi_whole: int, psi_gathered_once: int) -> tuple[float, int]:
    """The theory for the layout as configured: parameters kept whole (HSDP's threshold) hold all 16
    bytes on every rank and are all-reduced (2 x 4 bytes); units not resharded after forward (FSDP2's
    root group; HSDP level 3's root and last layer) are gathered once per step, not twice."""
    state = theory_state_bytes(stage, psi - psi_whole, n) + 16 * psi_whole
    comm = theory_comm_bytes(stage, psi - psi_whole) + 8 * psi_whole - 4 * psi_gathered_once
    return state, comm


# --------------------------------------------------------------------------------------------------
# communication counter
# --------------------------------------------------------------------------------------------------
def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _arg(args, kwargs, index, *names):
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


# collective -> (bytes it counts for, from (args, kwargs); position of its ``group`` argument)
_VOLUME = {
    "all_reduce": (lambda a, k: 2 * _nbytes(_arg(a, k, 0, "tensor")), 2),
    "all_reduce_coalesced": (lambda a, k: 2 * _nbytes(_arg(a, k, 0, "tensors")), 2),
    "broadcast": (lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 2),
    "all_gather": (lambda a, k: _nbytes(_arg(a, k, 0, "tensor_list")), 2),
    "all_gather_single": (lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")), 2),
    "all_gather_into_tensor": (lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")), 2),
    "_all_gather_base": (lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor")), 2),
    "all_gather_coalesced": (lambda a, k: _nbytes(_arg(a, k, 0, "output_tensor_lists")), 2),
    "reduce_scatter": (lambda a, k: _nbytes(_arg(a, k, 1, "input_list")), 3),
    "reduce_scatter_single": (lambda a, k: _nbytes(_arg(a, k, 1, "input")), 3),
    "reduce_scatter_tensor": (lambda a, k: _nbytes(_arg(a, k, 1, "input")), 3),
    "_reduce_scatter_base": (lambda a, k: _nbytes(_arg(a, k, 1, "input")), 3),
    "reduce": (lambda a, k: _nbytes(_arg(a, k, 0, "tensor")), 3),
    "all_to_all_single": (lambda a, k: _nbytes(_arg(a, k, 1, "input")), 4),
    "all_to_all": (lambda a, k: _nbytes(_arg(a, k, 1, "input_tensor_list")), 2),
    "barrier": (lambda a, k: 0, 0),
    # HSDP's all-to-all exchanges on gloo are point-to-point messages (_bucket._exchange): each send
    # is one of the S-1 chunks of a reduce-scatter or all-gather, so it counts S/(S-1) times its bytes
    # and the S-1 sends add up to the collective's buffer, the convention above; receives count 0
    "isend": (lambda a, k: _nbytes(_arg(a, k, 0, "tensor")) * _per_send(k.get("group")), 2),
    "irecv": (lambda a, k: 0, 2),
}


def _per_send(group) -> float:
    size = dist.get_world_size(group)
    return size / (size - 1) if size > 1 else 0.0


class CommCounter:
    """Counts every torch.distributed collective issued while ``active`` (outermost call only)."""

    def __init__(self):
        self.active = False
        self.depth = 0
        self.bytes = 0
        self.calls: dict[str, list[int]] = {}  # op -> [calls, bytes]
        self._installed = []

    def install(self) -> None:
        from bench import _results as bench_results

        self._installed = bench_results.rebind_c10d(_VOLUME, self._wrap)

    def uninstall(self) -> None:
        from bench import _results as bench_results

        bench_results.restore(self._installed)
        self._installed = []

    def _wrap(self, name, fn):
        volume, group_at = _VOLUME[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.active and self.depth == 0:
                group = _arg(args, kwargs, group_at, "group")
                nbytes = volume(args, kwargs)
                if dist.get_world_size(group) == 1:
                    # megatron's cross entropy all-reduces over the TP group, here of one rank: no traffic
                    label, nbytes = f"{name} (group of 1, not counted)", 0
                else:
                    label = name
                entry = self.calls.setdefault(label, [0, 0])
                entry[0] += 1
                entry[1] += nbytes
                self.bytes += nbytes
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def start(self) -> None:
        self.bytes, self.calls, self.active = 0, {}, True

    def stop(self) -> dict:
        self.active = False
        return {"bytes": self.bytes, "ops": {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(self.calls.items())}}


# --------------------------------------------------------------------------------------------------
# peak memory of a step
# --------------------------------------------------------------------------------------------------
def high_water(deltas) -> int:
    """The highest the running sum of ``deltas`` (bytes allocated > 0, freed < 0, in time order)
    rises above its start: the peak of live bytes relative to what was live when counting began."""
    live = top = 0
    for nbytes in deltas:
        live += nbytes
        top = max(top, live)
    return top


PEAK_REPEATS = 2
_MARK_BYTES = 7_777_777  # the size of the sentinel allocation PeakRise.mark() makes (unlikely elsewhere)


class PeakRise:
    """While entered, the highest rise of allocated bytes after :meth:`mark` above what was allocated
    at the mark.

    CUDA / NPU: the caching allocator's own counter (``reset_peak_memory_stats`` at the mark,
    ``max_memory_allocated`` minus ``memory_allocated`` at the mark). CPU: torch keeps no statistics of
    host memory, and the process RSS is drowned by the interpreter, so the allocator's events are
    summed instead: torch's profiler with ``profile_memory=True`` records every allocation and free
    of torch's CPU allocator (bytes as requested) on the profiled thread, and :func:`high_water` runs
    through those after the mark in time order. The profiler reports no size for the free of a block
    allocated before it started (it warns so), which would count a step's frees of the previous step's
    buffers (gradients dropped by ``zero_grad``, level 1's spent full gradient) as nothing: so the
    recording starts one step earlier, the measured step begins at :meth:`mark`, and the sizes of its
    frees are known. The mark is found in the event stream as a sentinel allocation of an odd size.
    Checked against hand-computed cases in tests/unit/test_hsdp_bench_peak.py. For gloo: the buffers
    gloo allocates as torch tensors (its reduce-scatter's clone of the input, its all-gather's staging)
    are allocated on the calling thread and counted; its socket buffers are not torch allocations,
    for any contender. Allocations and frees on other threads are not seen: a tensor whose last
    reference a gloo worker drops is never seen freed (the rise errs high), one a worker would allocate
    is missed (none was found: the checks above). Pooled blocks (HSDP's HostBufferPool) allocated
    before the mark are in the baseline the caller adds (``pool_bytes``); a block the pool allocates
    or drops after it is an event."""

    def __enter__(self):
        from hyper_adaptor import platform

        self.device = platform.device_type()
        self.marked = False
        if self.device == "cpu":
            from torch.profiler import ProfilerActivity, profile

            self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self.profiler.__enter__()
        else:
            self.mark()  # without a mark, the whole block is measured
            self.marked = False
        return self

    def mark(self) -> None:
        """The measured part begins here."""
        self.marked = True
        if self.device == "cpu":
            torch.empty(_MARK_BYTES, dtype=torch.uint8)  # allocated and freed at once
            return
        from hyper_adaptor import platform

        module = platform.device_module(self.device)
        module.synchronize()
        module.reset_peak_memory_stats()
        self.start = module.memory_allocated()

    def __exit__(self, *exc_info):
        if self.device != "cpu":
            from hyper_adaptor import platform

            module = platform.device_module(self.device)
            module.synchronize()
            self.rise = int(module.max_memory_allocated()) - int(self.start)
            return
        self.profiler.__exit__(*exc_info)
        # the raw allocator records ("[memory]" events, bytes signed), not the per-operator
        # aggregates, which lose the order of allocations and frees
        events = sorted((e for e in self.profiler.profiler.kineto_results.events()
                         if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")),
                        key=lambda e: e.start_ns())
        after = [e.nbytes() for e in events]
        if self.marked:
            at = max(i for i, n in enumerate(after) if n == _MARK_BYTES)  # the sentinel, then its free
            after = after[at + 1 :]
            if after and after[0] == -_MARK_BYTES:
                after = after[1:]
        self.rise = high_water(after)


# --------------------------------------------------------------------------------------------------
# model-state memory
# --------------------------------------------------------------------------------------------------
class Ledger:
    """Bytes per category, every storage counted once (the first category that sees it)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.bytes = {"params": 0, "grads": 0, "optim": 0}

    def add(self, kind: str, t) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        if hasattr(t, "to_local"):
            t = t.to_local()
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in self.seen:
            return
        self.seen.add(storage.data_ptr())
        self.bytes[kind] += storage.nbytes()

    def add_optimizer_state(self, optimizer) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                self.add("params", p)
                self.add("grads", p.grad)
        for state in optimizer.state.values():
            for value in state.values():
                self.add("optim", value)


def megatron_state(ddp, optimizer) -> dict:
    ledger = Ledger()
    for buffer in list(ddp.buffers) + list(getattr(ddp, "expert_parallel_buffers", [])):
        ledger.add("params", getattr(buffer, "param_data", None))
        ledger.add("grads", buffer.grad_data)
    for p in ddp.parameters():
        ledger.add("params", p)
        ledger.add("grads", getattr(p, "main_grad", None))
        ledger.add("grads", p.grad)
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for attr in ("shard_fp32_groups", "shard_fp32_from_float16_groups", "fp32_from_float16_groups",
                     "fp32_from_fp32_groups"):
            for group in getattr(opt, attr, None) or []:
                for master in group:
                    if master is not None:
                        ledger.add("params", master)
                        ledger.add("grads", master.grad)
        ledger.add_optimizer_state(opt.optimizer)
    return ledger.bytes


def hsdp_state(model, optimizer) -> dict:
    ledger = Ledger()
    for p in model.parameters():
        ledger.add("params", p)
        hp = p._hsdp_param
        ledger.add("params", hp.full)
        ledger.add("grads", p.grad)
        ledger.add("grads", hp.full.grad)
    ledger.add_optimizer_state(optimizer)
    return ledger.bytes


def fsdp2_state(model, optimizer) -> dict:
    from torch.distributed.fsdp import FSDPModule

    ledger = Ledger()
    for p in model.parameters():
        ledger.add("params", p)
        ledger.add("grads", p.grad)
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for group in module._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                ledger.add("params", getattr(fp, "_sharded_param_data", None))
                for t in getattr(fp, "all_gather_outputs", None) or []:
                    ledger.add("params", t)
                unsharded = getattr(fp, "_unsharded_param", None)
                ledger.add("params", unsharded)
                if unsharded is not None:
                    ledger.add("grads", unsharded.grad)
                ledger.add("grads", getattr(fp, "unsharded_accumulated_grad", None))
    ledger.add_optimizer_state(optimizer)
    return ledger.bytes


# --------------------------------------------------------------------------------------------------
# model and contenders
# --------------------------------------------------------------------------------------------------
def _transformer_config(dims: dict):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=dims["layers"], hidden_size=dims["hidden"], num_attention_heads=dims["heads"],
        ffn_hidden_size=4 * dims["hidden"], hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )


def make_gpt(dims: dict, init: dict | None):
    """The same GPTModel (local spec, tied embedding) every time; ``init``: weights to load."""
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    tensor_parallel.model_parallel_cuda_manual_seed(SEED)
    torch.manual_seed(SEED)
    config = _transformer_config(dims)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=dims["vocab"],
                     max_sequence_length=dims["seq"], share_embeddings_and_output_weights=True)
    if init is not None:  # (megatron seeds the same numbers; load them anyway, so it cannot drift)
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(init[name])
    return config, model


class Contender:
    def __init__(self, name: str, dims: dict, init: dict, bucket_kb: float = DEFAULT_BUCKET_KB_BENCH):
        self.name = name
        self.kind, self.level, self.threshold = CONTENDERS[name]
        self.stage = ZERO_STAGE[self.level]
        config, model = make_gpt(dims, init)
        self.pool = None
        self.bucket_kb = -1 if name.endswith("-unbounded") else bucket_kb
        if self.kind == "megatron":
            self._build_megatron(config, model)
        elif self.kind == "hsdp":
            from hyper_adaptor.parallel.hsdp import HostBufferPool, hsdp

            self.pool = HostBufferPool()  # its own, so that what it keeps is this contender's
            all_to_all = not name.endswith("-gloo")
            kwargs = dict(optimizer_level=self.level, threshold=self.threshold, comm_fusion=True,
                          bucket_size=self.bucket_kb, comm_async=name.endswith("-async"), buffer_pool=self.pool,
                          gloo_reduce_scatter_as_all_to_all=all_to_all, gloo_all_gather_as_all_to_all=all_to_all)
            for layer in model.decoder.layers:
                hsdp(layer, **kwargs)
            self.model = hsdp(model, **kwargs)
            if name.endswith("-reshard-all"):
                self.model.set_reshard_after_forward(True)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR, foreach=True)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for layer in model.decoder.layers:
                fully_shard(layer, mesh=mesh)
            self.model = fully_shard(model, mesh=mesh)
            self.optimizer = torch.optim.Adam(self.model.parameters(), lr=LR, foreach=True)

    def _build_megatron(self, config, model):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        distributed = self.level == "zero1"
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=distributed)
        self.model = DistributedDataParallel(config, ddp_config, model)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, params_dtype=torch.float32,
                            use_distributed_optimizer=distributed),
            [self.model],
        )

    def step(self, batch: dict) -> tuple[float, float, float]:
        """One training step: (loss on this rank, seconds to the end of backward and gradient
        reduction, seconds of ``optimizer.step()``)."""
        start = time.perf_counter()
        if self.kind == "megatron":
            self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        output = self.model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        loss = output.mean()
        loss.backward()
        if self.kind == "megatron":
            self.model.finish_grad_sync()
        elif self.kind == "hsdp":
            from hyper_adaptor.parallel.hsdp import hsdp_sync_stream

            hsdp_sync_stream()
        backward_done = time.perf_counter()
        if self.kind == "megatron":
            ok, _, _ = self.optimizer.step()  # (the distributed optimizer all-gathers parameters here)
            assert ok, f"{self.name}: optimizer step skipped"
        else:
            self.optimizer.step()
        return loss.item(), backward_done - start, time.perf_counter() - backward_done

    def grad_norm(self) -> float:
        """Global norm of the reduced gradient after a step (Adam is invariant to the gradient's
        scale, so the losses alone would not catch a wrong averaging factor)."""
        if self.kind == "megatron":
            return float(self.optimizer.get_grad_norm())
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None])
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def layout(self) -> dict:
        """Parameters kept whole on every rank (HSDP's threshold) and those of units not resharded
        after forward, so not gathered again for backward (FSDP2's root group; HSDP level 3's root
        and last layer)."""
        whole = once = 0
        if self.kind == "hsdp":
            whole = sum(p._hsdp_param.full.numel() for p in self.model.parameters() if not p._hsdp_param.sharded)
            if self.level == "level3":
                for state in (self.model._hsdp_state, *self.model._hsdp_state._nested_states()):
                    if state.reshard_after_forward is False:
                        once += sum(hp.full.numel() for hp in state.params if hp.sharded)
        if self.kind == "fsdp2":
            for group in self.model._get_fsdp_state()._fsdp_param_groups:
                once += sum(fp.sharded_param.numel() for fp in group.fsdp_params)
        return {"psi_whole": whole, "psi_gathered_once": once}

    def model_state(self) -> dict:
        if self.kind == "megatron":
            return megatron_state(self.model, self.optimizer)
        if self.kind == "hsdp":
            return hsdp_state(self.model, self.optimizer)
        return fsdp2_state(self.model, self.optimizer)

    def bucket_bytes(self) -> int:
        """The largest collective buffer this contender's configuration allows (the "bucket" of the
        peak bound): HSDP its bucket size (-1: every sharded parameter at once); megatron its bucket,
        max(40 M, 1 M x DP) elements by default, capped by the model (one bucket here); FSDP2 its largest
        unit, gathered whole."""
        if self.kind == "hsdp":
            whole_model = 4 * sum(p._hsdp_param.full.numel() for p in self.model.parameters())
            return whole_model if self.bucket_kb == -1 else int(self.bucket_kb * 1024)
        if self.kind == "megatron":
            default_bucket = max(40_000_000, 1_000_000 * dist.get_world_size())
            return 4 * min(sum(p.numel() for p in self.model.parameters()), default_bucket)
        units = [4 * sum(fp.sharded_param.numel() for fp in group.fsdp_params)  # (a DTensor's numel is global)
                 for module in self.model.modules() if hasattr(module, "_get_fsdp_state")
                 for group in module._get_fsdp_state()._fsdp_param_groups]
        return max(units, default=0)

    def pool_bytes(self) -> int | None:
        """Bytes HSDP's CPU buffer pool keeps reserved between steps (not model state)."""
        return self.pool.reserved_bytes() if self.pool is not None else None

    def largest_pooled_block(self) -> int | None:
        if self.pool is None:
            return None
        return max((b.numel() * b.element_size() for blocks in self.pool.free.values() for b in blocks), default=0)

    def hsdp_comm_bytes(self) -> int | None:
        return self.model.hsdp_comm_bytes() if self.kind == "hsdp" else None


def batch(step: int, rank: int, world: int, dims: dict) -> dict:
    """This rank's micro-batch of the global batch of ``step`` (the same on every rank)."""
    g = torch.Generator().manual_seed(SEED + step)
    mb, seq = dims["micro_batch"], dims["seq"]
    tokens = torch.randint(0, dims["vocab"], (world * mb, seq + 1), generator=g)[rank * mb : (rank + 1) * mb]
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(seq).unsqueeze(0).expand(mb, seq).contiguous(),
        "attention_mask": torch.tril(torch.ones(1, 1, seq, seq)) < 0.5,
    }


# --------------------------------------------------------------------------------------------------
# one rank
# --------------------------------------------------------------------------------------------------
def bench_rank(rank: int, world_size: int, dims: dict, names: list[str], warmup: int, steps: int,
               bucket_kb: float = DEFAULT_BUCKET_KB_BENCH) -> dict:
    import warnings

    from megatron.core import parallel_state as ps

    warnings.filterwarnings("ignore", category=FutureWarning)  # deprecated c10d aliases megatron calls
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ps.initialize_model_parallel(1, 1)
    _, reference = make_gpt(dims, None)
    init = {k: v.detach().clone() for k, v in reference.named_parameters()}
    psi = sum(p.numel() for p in reference.parameters())  # tied embedding counted once
    del reference

    contenders = [Contender(name, dims, init, bucket_kb) for name in names]
    counter = CommCounter()
    counter.install()
    comm_step = warmup - 1 if warmup >= 2 else 0  # steady state: level 1/2 re-gather after an update
    losses = {c.name: [] for c in contenders}
    times = {c.name: [] for c in contenders}
    phases = {c.name: [] for c in contenders}
    comm, hsdp_comm, grad_norm = {}, {}, {}
    try:
        for r in range(warmup + steps):
            order = contenders if r % 2 == 0 else contenders[::-1]
            data = batch(r, rank, world_size, dims)
            for c in order:
                counting = r == comm_step
                before = c.hsdp_comm_bytes()
                dist.barrier()
                if counting:
                    counter.start()
                start = time.perf_counter()
                loss, backward_s, optimizer_s = c.step(data)
                elapsed = time.perf_counter() - start
                losses[c.name].append(loss)
                if counting:
                    comm[c.name] = counter.stop()
                    if before is not None:
                        hsdp_comm[c.name] = c.hsdp_comm_bytes() - before
                if r == 0:
                    grad_norm[c.name] = c.grad_norm()
                if r >= warmup:
                    times[c.name].append(elapsed)
                    phases[c.name].append((backward_s, optimizer_s))
            if rank == 0:
                print(f"  round {r + 1}/{warmup + steps} done", flush=True)
    finally:
        counter.uninstall()
    state = {c.name: c.model_state() for c in contenders}
    pool = {c.name: c.pool_bytes() for c in contenders}
    activation_rise, peak = measure_peaks(contenders, batch(warmup + steps, rank, world_size, dims), dims, init)

    # the loss of the global batch (mean over ranks) and the slowest rank's time per step
    loss_tensor = torch.tensor([losses[c.name] for c in contenders], dtype=torch.float64)
    dist.all_reduce(loss_tensor)
    loss_tensor /= world_size
    time_tensor = torch.tensor([times[c.name] for c in contenders], dtype=torch.float64)
    dist.all_reduce(time_tensor, op=dist.ReduceOp.MAX)
    layout = {c.name: c.layout() for c in contenders}
    ps.destroy_model_parallel()
    return {
        "psi": psi,
        "loss": {c.name: loss_tensor[i].tolist() for i, c in enumerate(contenders)},
        "step_s": {c.name: time_tensor[i].tolist() for i, c in enumerate(contenders)},
        "phase_s": {c.name: phases[c.name] for c in contenders},
        "grad_norm": grad_norm,
        "layout": layout,
        "state": state,
        "pool_bytes": pool,
        "comm": comm,
        "hsdp_comm_bytes": hsdp_comm,
        "comm_step": comm_step,
        "activation_rise": activation_rise,
        "peak": peak,
    }


def measure_peaks(contenders: list, data: dict, dims: dict, init: dict) -> tuple[int, dict]:
    """Two more steps per contender (not timed, after the timed ones, so levels 1/2 re-gather after an
    update as in every steady-state step), the allocations of the second measured (:class:`PeakRise`);
    done ``PEAK_REPEATS`` times, the highest kept (the same step measured twice has differed by up to
    5 MiB for megatron's distributed optimizer: allocations made or freed on gloo's threads are not
    seen, see PeakRise).

    A step's peak = the bytes live when it starts (model state, each storage once, plus what HSDP's
    pool holds) + the highest rise above that during zero_grad, forward, backward, gradient
    reduction and ``optimizer.step()``. Also measured, once: the rise of forward + backward of the
    plain model in one process, its gradients already allocated (so not counted) — the activations
    and per-operator temporaries every contender pays alike, which no ZeRO level removes."""
    _, plain = make_gpt(dims, init)
    args = (data["tokens"], data["position_ids"], data["attention_mask"])
    with PeakRise() as measured:
        plain(*args, labels=data["labels"]).mean().backward()  # the gradients exist from now on
        for p in plain.parameters():
            p.grad.zero_()
        measured.mark()
        plain(*args, labels=data["labels"]).mean().backward()
    activation_rise = measured.rise
    del plain
    peak = {}
    for c in contenders:
        repeats = []
        for _ in range(PEAK_REPEATS):
            with PeakRise() as measured:
                c.step(data)  # recorded so that the sizes of what the measured step frees are known
                start = sum(c.model_state().values()) + (c.pool_bytes() or 0)
                dist.barrier()
                measured.mark()
                c.step(data)
            repeats.append((start, measured.rise))
        start, rise = max(repeats, key=sum)
        peak[c.name] = {"start_bytes": start, "rise_bytes": rise, "repeats": repeats, "bucket_bytes": c.bucket_bytes(),
                        "pool_bytes_after": c.pool_bytes(), "largest_pooled_block_after": c.largest_pooled_block()}
    return activation_rise, peak


# --------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------
def run(args) -> dict:
    from hyper_adaptor.testing import run_world

    dims = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, vocab=args.vocab, seq=args.seq,
                micro_batch=args.micro_batch)
    names = list(CONTENDERS)
    if args.contenders:
        wanted = set(args.contenders.split(",")) | {"megatron-ddp", "megatron-distopt", "fsdp2"}  # the anchors
        unknown = wanted - set(names)
        if unknown:
            raise SystemExit(f"--contenders: unknown {sorted(unknown)}; known: {', '.join(names)}")
        names = [n for n in names if n in wanted]
    load_before = os.getloadavg()
    results = run_world(WORLD, "bench.hsdp:bench_rank", timeout=args.timeout, dims=dims, names=names,
                        warmup=args.warmup, steps=args.steps, bucket_kb=args.bucket_kb)
    r0 = results[0]
    psi, n = r0["psi"], WORLD
    ref_loss = r0["loss"]["megatron-ddp"]
    rows = []
    medians = {name: statistics.median(r0["step_s"][name]) for name in names}
    activation_rise = max(res["activation_rise"] for res in results)
    peaks = {name: max(res["peak"][name]["start_bytes"] + res["peak"][name]["rise_bytes"] for res in results)
             for name in names}
    for name in names:
        kind, level, threshold = CONTENDERS[name]
        stage = ZERO_STAGE[level]
        # per-rank figures: memory and communication from every rank (they differ by padding only)
        state = [res["state"][name] for res in results]
        total = [sum(s.values()) for s in state]
        comm = [res["comm"][name]["bytes"] for res in results]
        loss = r0["loss"][name]
        layout = r0["layout"][name]
        state_configured, comm_configured = configured_theory(stage, psi, n, **layout)
        backward_s = statistics.median(b for b, _ in r0["phase_s"][name])
        optimizer_s = statistics.median(o for _, o in r0["phase_s"][name])
        norm, ref_norm = r0["grad_norm"][name], r0["grad_norm"]["megatron-ddp"]
        rows.append({
            "contender": name, "kind": kind, "zero_stage": stage, "threshold_kb": threshold,
            "first_grad_norm": norm, "first_grad_norm_rel_diff": abs(norm - ref_norm) / abs(ref_norm),
            "first_loss": loss[0], "first_loss_rel_diff": abs(loss[0] - ref_loss[0]) / abs(ref_loss[0]),
            "last_loss": loss[-1], "last_loss_rel_diff": abs(loss[-1] - ref_loss[-1]) / abs(ref_loss[-1]),
            "parity_ok": (abs(loss[0] - ref_loss[0]) <= PARITY_RTOL * abs(ref_loss[0])
                          and abs(norm - ref_norm) <= PARITY_RTOL * abs(ref_norm)),
            "state_bytes_rank0": state[0], "state_bytes_max": max(total),
            "state_theory_bytes": theory_state_bytes(stage, psi, n),
            "state_vs_theory": max(total) / theory_state_bytes(stage, psi, n),
            "psi_whole": layout["psi_whole"], "psi_gathered_once": layout["psi_gathered_once"],
            "state_theory_configured_bytes": state_configured,
            "state_vs_configured_theory": max(total) / state_configured,
            "comm_bytes_rank0": comm[0], "comm_bytes_max": max(comm), "comm_ops_rank0": r0["comm"][name]["ops"],
            "comm_theory_bytes": theory_comm_bytes(stage, psi),
            "comm_vs_theory": max(comm) / theory_comm_bytes(stage, psi),
            "comm_theory_configured_bytes": comm_configured,
            "comm_vs_configured_theory": max(comm) / comm_configured,
            "hsdp_comm_bytes_rank0": r0["hsdp_comm_bytes"].get(name),
            "hsdp_pool_bytes_max": (None if r0["pool_bytes"][name] is None
                                    else max(res["pool_bytes"][name] for res in results)),
            # peak of a step (max over ranks) against the configured theory + activations + 2 buckets
            "peak_bytes_max": peaks[name],
            "peak_start_bytes_rank0": r0["peak"][name]["start_bytes"],
            "peak_rise_bytes_rank0": r0["peak"][name]["rise_bytes"],
            "bucket_bytes": r0["peak"][name]["bucket_bytes"],
            "activation_rise_bytes": activation_rise,
            "peak_bound_bytes": state_configured + activation_rise + 2 * r0["peak"][name]["bucket_bytes"],
            "peak_vs_bound": peaks[name] / (state_configured + activation_rise + 2 * r0["peak"][name]["bucket_bytes"]),
            "peak_vs_megatron_distopt": peaks[name] / peaks["megatron-distopt"],
            "peak_vs_fsdp2": peaks[name] / peaks["fsdp2"],
            "pool_bytes_after_peak_step_max": (None if r0["peak"][name]["pool_bytes_after"] is None
                                               else max(res["peak"][name]["pool_bytes_after"] for res in results)),
            "largest_pooled_block_after_bytes": r0["peak"][name]["largest_pooled_block_after"],
            "step_ms_median": medians[name] * 1000,
            "step_ms_all": [t * 1000 for t in r0["step_s"][name]],
            "rank0_forward_backward_ms_median": backward_s * 1000, "rank0_optimizer_ms_median": optimizer_s * 1000,
            "step_vs_megatron_distopt": medians[name] / medians["megatron-distopt"],
            "step_vs_fsdp2": medians[name] / medians["fsdp2"],
        })
    return {
        "benchmark": "hsdp", "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "world": n, "dtype": "fp32", "optimizer": f"Adam lr={LR}, no weight decay, no clipping",
        "model": dict(dims, psi=psi, ffn=4 * args.hidden, spec="megatron-core GPTModel, local spec, tied embedding"),
        "warmup": args.warmup, "steps": args.steps, "comm_step": r0["comm_step"] + 1,
        "hsdp_bucket_kb": args.bucket_kb, "activation_rise_bytes": activation_rise,
        "machine": dict(_machine_of_ranks(), load_average_1min_before_after=[load_before[0], os.getloadavg()[0]]),
        "rows": rows,
    }


def _machine_of_ranks() -> dict:
    from bench import _results as bench_results

    info = bench_results.machine()
    info["torch_threads"] = 1  # per rank (hyper_adaptor/testing/world.py sets OMP_NUM_THREADS=1)
    info["ranks"] = WORLD
    return info


def _mib(x: float) -> str:
    return f"{x / 2**20:.2f}"


def table(result: dict) -> str:
    psi, n = result["model"]["psi"], result["world"]
    head = ("contender", "ZeRO", "step-1 loss / grad norm (rel. diff vs DDP)", "params / grads / optim MiB",
            "state MiB", "x theory", "x as configured", "comm MiB", "x theory", "x as configured",
            "hsdp_comm_bytes MiB",
            "step ms (fwd+bwd / opt)", "x distopt", "x fsdp2")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        s = r["state_bytes_rank0"]
        hsdp_comm = "-" if r["hsdp_comm_bytes_rank0"] is None else _mib(r["hsdp_comm_bytes_rank0"])
        threshold = "" if r["threshold_kb"] is None else f", threshold {r['threshold_kb']} KB"
        lines.append("| " + " | ".join((
            r["contender"] + threshold, r["zero_stage"],
            f"{r['first_loss']:.6f} ({r['first_loss_rel_diff']:.1e}) / {r['first_grad_norm']:.5f} "
            f"({r['first_grad_norm_rel_diff']:.1e}){'' if r['parity_ok'] else ' FAIL'}",
            f"{_mib(s['params'])} / {_mib(s['grads'])} / {_mib(s['optim'])}", _mib(r["state_bytes_max"]),
            f"{r['state_vs_theory']:.3f}", f"{r['state_vs_configured_theory']:.3f}",
            _mib(r["comm_bytes_max"]), f"{r['comm_vs_theory']:.3f}", f"{r['comm_vs_configured_theory']:.3f}",
            hsdp_comm,
            f"{r['step_ms_median']:.0f} ({r['rank0_forward_backward_ms_median']:.0f} / "
            f"{r['rank0_optimizer_ms_median']:.0f})",
            f"{r['step_vs_megatron_distopt']:.2f}", f"{r['step_vs_fsdp2']:.2f}",
        )) + " |")
    whole = ", ".join(f"{w:,}" for w in sorted({r["psi_whole"] for r in result["rows"] if r["psi_whole"]}))
    once = {r["contender"]: r["psi_gathered_once"] for r in result["rows"] if r["psi_gathered_once"]}
    notes = [
        "",
        f"Ψ = {psi:,} parameters ({_mib(4 * psi)} MiB fp32), N = {n}. Theory (fp32 Adam, 16 B/param), MiB: "
        f"DDP 16Ψ = {_mib(16 * psi)}, ZeRO-1 8Ψ+8Ψ/N = {_mib(8 * psi + 8 * psi / n)}, "
        f"ZeRO-2 4Ψ+12Ψ/N = {_mib(4 * psi + 12 * psi / n)}, ZeRO-3 16Ψ/N = {_mib(16 * psi / n)}; "
        f"communication 2Ψ·4 B = {_mib(8 * psi)}, 3Ψ·4 B = {_mib(12 * psi)} per rank per step. These are the "
        "mixed-precision forms 16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N, 16Ψ/N (2 B param + 2 B grad + 12 B fp32 master and "
        "moments) with 4 B param and grad and no separate master: ZeRO-1 keeps 4+4 B whole, ZeRO-2 4 B.",
        f"As configured: HSDP threshold 64 KB keeps {whole or 'no'} parameters whole (16 B each on every rank, "
        "all-reduced: 8 B); units not resharded after forward are gathered once per step, not twice "
        "(FSDP2: its root group; HSDP level 3: the root and the last layer), parameters: "
        + ", ".join(f"{name} {count:,}" for name, count in once.items()) + ".",
        f"step ms: median over {result['steps']} interleaved steps after {result['warmup']} warm-up, slowest rank; "
        f"fwd+bwd / opt: rank 0's medians of forward+backward(+gradient reduction) and optimizer.step().",
        "HSDP's CPU buffer pool (its largest transient communication buffers, kept between steps as a "
        "caching allocator would; not in the model state above), MiB per rank: " + ", ".join(
            f"{r['contender']} {_mib(r['hsdp_pool_bytes_max'])}" for r in result["rows"]
            if r.get("hsdp_pool_bytes_max") is not None) + ".",
        "",
        f"Collectives per rank in step {result['comm_step']} (rank 0: calls, MiB):",
    ]
    for r in result["rows"]:
        ops = ", ".join(f"{op} {v['calls']}x {_mib(v['bytes'])}" for op, v in r["comm_ops_rank0"].items())
        notes.append(f"  {r['contender']}: {ops}")
    notes += ["", peak_table(result)]
    notes.append("")
    notes.append(f"Loss at step {result['warmup'] + result['steps']} relative to DDP's: " + ", ".join(
        f"{r['contender']} {r['last_loss_rel_diff']:.1e}" for r in result["rows"]))
    return "\n".join(lines + notes)


def peak_table(result: dict) -> str:
    """Peak bytes of a step per rank: the model state and pool live at its start, the rise above it
    (allocator events), against the bound theory + activations + 2 buckets, distopt and FSDP2."""
    head = ("contender", "bucket MiB", "start MiB (state + pool)", "rise MiB", "peak MiB",
            "bound MiB (theory + act. + 2 buckets)", "x bound", "x distopt", "x fsdp2",
            "pool after MiB (largest block)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        pool = ("-" if r["pool_bytes_after_peak_step_max"] is None else
                f"{_mib(r['pool_bytes_after_peak_step_max'])} ({_mib(r['largest_pooled_block_after_bytes'])})")
        lines.append("| " + " | ".join((
            r["contender"], _mib(r["bucket_bytes"]), _mib(r["peak_start_bytes_rank0"]),
            _mib(r["peak_rise_bytes_rank0"]), _mib(r["peak_bytes_max"]), _mib(r["peak_bound_bytes"]),
            f"{r['peak_vs_bound']:.3f}", f"{r['peak_vs_megatron_distopt']:.3f}", f"{r['peak_vs_fsdp2']:.3f}", pool,
        )) + " |")
    lines.append("")
    lines.append(
        f"Peak of one step per rank (max over ranks; start and rise: rank 0), measured after the timed steps: "
        f"bytes live at its start (model state as above + HSDP's pool) + the highest rise of allocated bytes "
        f"during it (CPU: torch's profiler memory events, summed in time order; CUDA/NPU: "
        f"max_memory_allocated). Activations (act.): forward + backward of the plain model in one process, "
        f"its gradients already allocated: {_mib(result['activation_rise_bytes'])} MiB. Bound = ZeRO theory as "
        f"configured + act. + 2 x bucket; bucket: HSDP bucket_size ({result['hsdp_bucket_kb']:g} KB; the "
        f"-unbounded rows: the whole model), megatron's bucket (the whole model here), FSDP2's largest unit.")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--bucket-kb", type=float, default=DEFAULT_BUCKET_KB_BENCH,
                        help="HSDP bucket_size of every hsdp row but the -unbounded ones (KB)")
    parser.add_argument("--contenders", default="",
                        help="comma-separated subset of rows (megatron-ddp, megatron-distopt, fsdp2 always run)")
    parser.add_argument("--quick", action="store_true", help="hidden 128, 2 layers, seq 64, 2 warm-up + 3 steps")
    parser.add_argument("--json", default=str(DEFAULT_JSON))
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.seq, args.warmup, args.steps = 128, 2, 64, 2, 3
    from bench import _results as bench_results

    result = run(args)
    return bench_results.report(result, table(result), args.json, quick=args.quick)


if __name__ == "__main__":
    main()
