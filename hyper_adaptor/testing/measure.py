"""What every bench in ``bench/`` measures with: collectives, peak memory, bytes, the result table and JSON.

* :class:`CollectiveCounter`: calls and bytes per torch.distributed function while a phase is set;
* :class:`StorageTracker` / :class:`PeakMemory`: the bytes a measured step allocates above what was
  allocated when it began (docs/features/hsdp-measured.md says why this method and not the profiler's);
* :func:`nbytes`, :func:`mib`, :func:`machine`, :func:`report` (table + JSON);
* quick mode: :func:`quick_json` (a smoke run never writes over the recorded figures), :func:`add_preset_options`
  and :func:`preset` (``--steps`` / ``--rounds`` / ``--warmup`` / ``--quick``);
* :func:`free_port` and :func:`run_world` come from :mod:`hyper_adaptor.testing.world`.

Importing this module imports torch, never megatron.
"""

from __future__ import annotations

import functools
import importlib.metadata
import inspect
import json
import os
import platform as py_platform
import sys
import threading
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from hyper_adaptor.testing.world import free_port, run_world

__all__ = ["BUFFER_BYTES", "SENT_BYTES", "CollectiveCounter", "PeakMemory", "StorageTracker", "add_preset_options",
           "free_port", "machine", "machine_line", "mib", "nbytes", "preset", "quick_json", "report", "run_world",
           "target_lines", "write"]


# ------------------------------------------------------------------------------------------------ bytes
def nbytes(t) -> int:
    """Bytes of a tensor's elements, or of every tensor in a (nested) list or tuple; 0 for anything else."""
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    return 0


def mib(x, spec: str = ".2f") -> str:
    """Bytes as MiB, ``-`` for None."""
    return "-" if x is None else format(x / 2**20, spec)


# ---------------------------------------------------------------------------------- collective counter
def _p2p_sent(a, n, r):
    from torch.distributed import distributed_c10d as c10d

    # only the isends: every receive is some rank's send, counted there
    return sum(nbytes(op.tensor) for op in a["p2p_op_list"]
               if getattr(op.op, "__name__", "") == "isend" or op.op is c10d.isend)


def _a2a_single_sent(a, n, r):
    split, total = a.get("input_split_sizes"), nbytes(a["input"])
    if split is None or len(split) == 0:
        return total * (n - 1) // n
    # a list, or (as megatron's MoE dispatcher hands them) a tensor or numpy array of counts
    split = [int(s) for s in (split.tolist() if hasattr(split, "tolist") else split)]
    return total - total * split[r] // sum(split) if sum(split) else 0


# Two conventions, each ``name -> bytes(bound arguments, group size n, rank in group r)``.
# SENT_BYTES: what this rank sends in the bandwidth-optimal schedule of the collective (every one moves
# (N-1)/N of its buffer), the volume an algorithm asks for, not what gloo moves internally.
SENT_BYTES = {
    "all_to_all_single": _a2a_single_sent,
    "all_to_all": lambda a, n, r: sum(nbytes(t) for i, t in enumerate(a["input_tensor_list"]) if i != r),
    "all_gather_into_tensor": lambda a, n, r: (n - 1) * nbytes(a["input_tensor"]),
    "all_gather_single": lambda a, n, r: (n - 1) * nbytes(a["input_tensor"]),
    "_all_gather_base": lambda a, n, r: (n - 1) * nbytes(a["input_tensor"]),
    "all_gather": lambda a, n, r: (n - 1) * nbytes(a["tensor"]),
    "reduce_scatter_tensor": lambda a, n, r: (n - 1) * nbytes(a["output"]),
    "reduce_scatter_single": lambda a, n, r: (n - 1) * nbytes(a["output"]),
    "_reduce_scatter_base": lambda a, n, r: (n - 1) * nbytes(a["output"]),
    "reduce_scatter": lambda a, n, r: (n - 1) * nbytes(a["output"]),
    "all_reduce": lambda a, n, r: 2 * (n - 1) * nbytes(a["tensor"]) // n,
    "send": lambda a, n, r: nbytes(a["tensor"]),
    "isend": lambda a, n, r: nbytes(a["tensor"]),
    "batch_isend_irecv": _p2p_sent,
}
# BUFFER_BYTES: the ZeRO papers' convention: all-gather and reduce-scatter count their full (unsharded)
# buffer, all-reduce twice it, broadcast and reduce the buffer. A point-to-point send is one of the N-1
# chunks of an all-to-all style exchange, so it counts N/(N-1) times its bytes (the N-1 sends add up to
# the buffer); receives count 0.
BUFFER_BYTES = {
    "all_reduce": lambda a, n, r: 2 * nbytes(a["tensor"]),
    "all_reduce_coalesced": lambda a, n, r: 2 * nbytes(a["tensors"]),
    "broadcast": lambda a, n, r: nbytes(a["tensor"]),
    "all_gather": lambda a, n, r: nbytes(a["tensor_list"]),
    "all_gather_single": lambda a, n, r: nbytes(a["output_tensor"]),
    "all_gather_into_tensor": lambda a, n, r: nbytes(a["output_tensor"]),
    "_all_gather_base": lambda a, n, r: nbytes(a["output_tensor"]),
    "all_gather_coalesced": lambda a, n, r: nbytes(a["output_tensor_lists"]),
    "reduce_scatter": lambda a, n, r: nbytes(a["input_list"]),
    "reduce_scatter_single": lambda a, n, r: nbytes(a["input"]),
    "reduce_scatter_tensor": lambda a, n, r: nbytes(a["input"]),
    "_reduce_scatter_base": lambda a, n, r: nbytes(a["input"]),
    "reduce": lambda a, n, r: nbytes(a["tensor"]),
    "all_to_all_single": lambda a, n, r: nbytes(a["input"]),
    "all_to_all": lambda a, n, r: nbytes(a["input_tensor_list"]),
    "barrier": lambda a, n, r: 0,
    "isend": lambda a, n, r: nbytes(a["tensor"]) * (n / (n - 1)),
    "irecv": lambda a, n, r: 0,
}


def _rebind_c10d(names, wrap) -> list:
    """Put ``wrap(name, fn)`` in place of each named torch.distributed function in every module that holds
    it by name: ``torch.distributed.X``, c10d's own globals (P2POp compares ``op is isend`` against them,
    so they must stay the object an engine passes) and aliases such as megatron's
    ``dist_reduce_scatter_func``. Where ``torch.distributed.X`` is itself a wrap of c10d's function (level
    0's gloo shape fixes), both are wrapped, so a call is counted under the name it was made by (the
    inner call is nested and not counted again). Returns what :func:`_restore` puts back."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    known: dict[int, tuple] = {}  # id(fn) -> (fn, its counted wrapper)
    for name in names:
        for fn in (getattr(c10d, name, None), getattr(dist, name, None)):
            if fn is not None and id(fn) not in known:
                known[id(fn)] = (fn, wrap(name, fn))
    installed = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            entry = known.get(id(value)) if callable(value) else None
            if entry is not None and entry[0] is value:
                namespace[attr] = entry[1]
                installed.append((namespace, attr, value))
    return installed


def _restore(installed: list) -> None:
    for namespace, attr, value in reversed(installed):
        namespace[attr] = value


def _group_of(name: str, a: dict):
    if name == "batch_isend_irecv":
        return a["p2p_op_list"][0].group if a["p2p_op_list"] else None
    return a.get("group")


class CollectiveCounter:
    """Calls and bytes of every torch.distributed collective issued while :attr:`phase` is set, by phase
    and function; a call inside another counted one (``reduce_scatter_tensor`` calling
    ``reduce_scatter_single``, ``batch_isend_irecv`` calling ``isend``) counts once, as the outer one.
    A call on a group of one rank moves nothing: it is listed as ``"<name> (group of 1, not counted)"``.

    ``with CollectiveCounter(SENT_BYTES) as counter:`` wraps the functions for the block's duration."""

    def __init__(self, volume: dict | None = None):
        self.volume = SENT_BYTES if volume is None else volume
        self.phase: str | None = None
        self.depth = 0
        self.counts: dict = {}
        self._installed: list = []

    def __enter__(self) -> CollectiveCounter:
        self._installed = _rebind_c10d(self.volume, self._wrap)
        return self

    def __exit__(self, *exc_info) -> None:
        _restore(self._installed)
        self._installed = []

    def _wrap(self, name, fn):
        import torch.distributed as dist

        signature, volume = inspect.signature(fn), self.volume[name]

        @functools.wraps(fn)
        def counted(*args, **kwargs):
            if self.phase is not None and self.depth == 0:
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                group = _group_of(name, a)
                n = dist.get_world_size(group)
                label, size = (f"{name} (group of 1, not counted)", 0) if n == 1 else (
                    name, volume(a, n, dist.get_rank(group)))
                self.record(label, size)
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return counted

    def record(self, label: str, size: int) -> None:
        """One call of ``label`` moving ``size`` bytes, in the current phase (for counters of other APIs)."""
        entry = self.counts.setdefault(self.phase, {}).setdefault(label, [0, 0])
        entry[0] += 1
        entry[1] += size

    def take(self) -> dict:
        """``{phase: {"bytes": total, "ops": {name: {"calls", "bytes"}}}}`` since the last take."""
        out = {phase: {"bytes": sum(v[1] for v in ops.values()),
                       "ops": {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(ops.items())}}
               for phase, ops in self.counts.items()}
        self.counts = {}
        return out


# ---------------------------------------------------------------------------------------- peak memory
def _storages(t):
    """The storages holding ``t``'s data: its own, or its inner tensors' for a wrapper subclass (DTensor)."""
    if is_traceable_wrapper_subclass(t):
        for attr in t.__tensor_flatten__()[0]:
            inner = getattr(t, attr)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
    elif isinstance(t, torch.Tensor) and t.layout is torch.strided:
        yield t.untyped_storage()


class StorageTracker(TorchDispatchMode):
    """Bytes of the storages operators create while the mode is on, from creation until freed: the
    running total :attr:`live`, its maximum :attr:`peak`, and :attr:`rise` above the last :meth:`mark`.

    A storage is new when an operator returns it and was not given it (views and in-place results share
    an input's storage; a tensor made before the mode arrives as an input the first time it is seen, so
    it is never counted). Its free is seen by a finalizer on the storage, which runs in whichever thread
    drops the last reference (gloo's worker threads release the buffers of finished sends). Not seen:
    what an operator allocates and frees inside itself (kernel scratch, gloo's staging inside a
    collective). ``device_type``: only storages on that device count; ``skip()`` true: nothing counts."""

    def __init__(self, device_type: str = "cpu", skip=None):
        super().__init__()
        self.device_type, self.skip = device_type, skip
        self.lock = threading.RLock()  # re-entrant: a free may run inside ``_track`` on this thread
        self.live = self.peak = self.base = self.high = 0
        self.tracked: dict[int, tuple] = {}  # id(storage) -> (bytes, creating op, weakref, serial)
        self.at_peak: list[tuple] = []  # what was alive at the peak, to say what it is made of
        self.timeline: list[tuple[int, int]] = []  # (serial, +-bytes) in order, to leave storages out later

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_leaves((args, kwargs))
        # a storage handed over as it is (``set_(storage)``) is given too: it already exists
        given = {id(s) for t in leaves if isinstance(t, torch.Tensor) for s in _storages(t)}
        given.update(id(t) for t in leaves if isinstance(t, torch.UntypedStorage))
        out = func(*args, **kwargs)
        if self.skip is None or not self.skip():
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                    for storage in _storages(t):
                        if id(storage) not in given or id(storage) in self.tracked:
                            self._track(storage, func)
        return out

    def _track(self, storage, func) -> None:
        key, size = id(storage), storage.nbytes()
        with self.lock:
            known = self.tracked.get(key)
            counted = known[0] if known else 0
            if known is None:
                serial = len(self.timeline)
                weakref.finalize(storage, self._freed, key)
            elif size <= counted:
                return
            else:  # seen again with more bytes: resized by an out= operator
                serial = known[3]
            self.tracked[key] = (size, str(func.overloadpacket), weakref.ref(storage), serial)
            self._grow(serial, size - counted)

    def _grow(self, serial, delta) -> None:
        # under self.lock: a tracked storage's bytes changed by ``delta`` (created or resized)
        self.timeline.append((serial, delta))
        self.live += delta
        self.high = max(self.high, self.live)
        if self.live > self.peak:
            self.peak = self.live
            self.at_peak = list(self.tracked.values())

    def _freed(self, key) -> None:
        with self.lock:
            size, _, _, serial = self.tracked.pop(key)
            self.timeline.append((serial, -size))
            self.live -= size

    def mark(self) -> None:
        """The measured part begins here: :attr:`rise` counts from what is live now."""
        with self.lock:
            self.base = self.high = self.live

    @property
    def rise(self) -> int:
        """The highest the running total rose above its value at the last mark (the start, unmarked)."""
        return self.high - self.base

    def alive_bytes(self, exclude=lambda ptr: False) -> int:
        """Bytes of the tracked storages alive now, but those whose ``data_ptr`` ``exclude`` names."""
        with self.lock:
            refs = [(size, ref()) for size, _, ref, _ in self.tracked.values()]
        return sum(size for size, s in refs if s is not None and not exclude(s.data_ptr()))

    def peak_by_op(self) -> dict[str, int]:
        """Bytes alive at the peak by the operator that created them, largest first."""
        by_op: dict[str, int] = {}
        for size, op, _, _ in self.at_peak:
            by_op[op] = by_op.get(op, 0) + size
        return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))

    def peak_without(self, tensors) -> int:
        """The peak of the same running total with ``tensors``' storages (created during the run and
        still alive) left out."""
        mine = {id(t.untyped_storage()) for t in tensors if t is not None}
        left_out = {serial for _, _, ref, serial in self.tracked.values()
                    if ref() is not None and id(ref()) in mine}
        total = peak = 0
        for serial, delta in self.timeline:
            if serial not in left_out:
                total += delta
                peak = max(peak, total)
        return peak


class PeakMemory:
    """``with PeakMemory() as m: ...; m.mark(); <measured>`` then ``m.rise``: the highest rise of allocated
    bytes after the mark (the whole block if never marked) above what was allocated at the mark.

    On CPU, a :class:`StorageTracker` (host memory has no allocator statistics). Start it a step before
    the measured one, so that the buffers of the previous step the measured one frees were seen created
    and their frees lower the total. On CUDA / NPU, the caching allocator's own figure:
    ``max_memory_allocated`` since the mark minus ``memory_allocated`` at it, through
    :mod:`hyper_adaptor.platform`."""

    def __init__(self, device_type: str | None = None):
        self.device_type = device_type
        self.tracker: StorageTracker | None = None
        self.start = self.rise = 0

    def __enter__(self) -> PeakMemory:
        from hyper_adaptor import platform

        self.device_type = self.device_type or platform.device_type()
        if self.device_type == "cpu":
            self.tracker = StorageTracker("cpu")
            self.tracker.__enter__()
        else:
            self.mark()
        return self

    def mark(self) -> None:
        if self.tracker is not None:
            self.tracker.mark()
            return
        from hyper_adaptor import platform

        module = platform.device_module(self.device_type)
        module.synchronize()
        module.reset_peak_memory_stats()
        self.start = int(module.memory_allocated())

    def __exit__(self, *exc_info) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc_info)
            self.rise = self.tracker.rise
            return
        from hyper_adaptor import platform

        module = platform.device_module(self.device_type)
        module.synchronize()
        self.rise = int(module.max_memory_allocated()) - self.start


# ------------------------------------------------------------------------------------ results and JSON
def machine(**extra) -> dict:
    """The machine and software a result was measured on (``extra``: per-bench facts, e.g. ranks)."""
    cpu_model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        megatron_version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        megatron_version = None
    return {
        "processor": py_platform.processor(), "machine": py_platform.machine(), "cpu_model": cpu_model,
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "python": py_platform.python_version(), "torch": torch.__version__, "megatron_core": megatron_version,
        **extra,
    }


def machine_line(result: dict) -> str:
    """The machine, the load around the run and the run's wall time, as the benches print them."""
    m = result["machine"]
    load = m["load_average_1min_before_after"]
    return (f"Machine: {m['cpu_model']} ({m['cpu_count']} cores), torch {m['torch']}, load average "
            f"{load[0]:.1f} before / {load[1]:.1f} after; {result['wall_s']:.0f} s.")


def target_lines(targets: list, value_format: str = ".3f") -> list[str]:
    """One line per target: whether every place it applies met it, then each value (NOT where missed)."""
    grouped: dict[str, list] = {}
    for t in targets:
        grouped.setdefault(t["target"], []).append(t)
    lines = []
    for target, checks in grouped.items():
        verdict = "all met" if all(t["met"] for t in checks) else f"{sum(not t['met'] for t in checks)} NOT met"
        lines.append(f"  {target} ({verdict}): " + "; ".join(
            f"{t['where']} {format(t['value'], value_format)}{'' if t['met'] else ' NOT'}" for t in checks))
    return lines


def add_preset_options(parser, defaults: dict, quick: dict, quick_help: str = "short smoke run") -> None:
    """``--steps``, ``--rounds``, ``--warmup`` (unset: the preset's) and ``--quick`` (the ``quick`` preset)."""
    for name, what in (("steps", "timed steps per contender per round"), ("rounds", "interleaved rounds"),
                       ("warmup", "untimed warm-up per contender")):
        parser.add_argument(f"--{name}", type=int, default=None,
                            help=f"{what} (default {defaults[name]}, --quick {quick[name]})")
    parser.add_argument("--quick", action="store_true", help=quick_help)


def preset(args, defaults: dict, quick: dict) -> dict:
    """The steps, rounds and warm-up of a run: those given on the command line, else the preset's."""
    chosen = quick if args.quick else defaults
    return {name: chosen[name] if getattr(args, name) is None else getattr(args, name) for name in defaults}


def quick_json(path, quick: bool) -> Path:
    """Where a result goes: a ``--quick`` smoke run to ``<name>-quick.json``, never over the recorded figures."""
    path = Path(path)
    return path.with_name(f"{path.stem}-quick{path.suffix}") if quick else path


def write(result: dict, path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def report(result: dict, text: str, json_path, quick: bool = False) -> dict:
    """Print a bench's table and write its JSON (see :func:`quick_json`)."""
    print()
    print(text)
    write(result, quick_json(json_path, quick))
    return result
