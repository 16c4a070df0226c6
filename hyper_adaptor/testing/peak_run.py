"""A real training run's peak memory per rank on CPU, measured the way the benches measure it.

``measure(flags, nproc)`` launches ``examples/pretrain_gpt.py`` (megatron.training's ``pretrain`` with the
adaptor's one line) on ``nproc`` forked CPU ranks (:mod:`hyper_adaptor.testing.launch`) through this
file, which each rank runs first: it imports the adaptor, wraps megatron.training's
``setup_model_and_optimizer`` and ``train_step``, and runs the script. A :class:`TieredTracker` (the
benches' :class:`~hyper_adaptor.testing.measure.StorageTracker`, plus storage resizes and a host tier)
is entered as ``setup_model_and_optimizer`` begins, before the model is built, in the main thread, and
left after the last tracked iteration. Each rank writes one JSON; the parent returns them in rank order:

* ``peak``: the highest total of live CPU tensor storages created under the tracker (the device tier);
* ``parts_at_peak``: those alive at the peak by what they are at the end of the tracked iterations:
  ``parameters`` (the model's parameters, buffers and DDP / HSDP parameter buffers, gathered HSDP copies
  included), ``gradients`` (DDP grad buffers, ``main_grad``, ``.grad``), ``optimizer_state``
  (everything the optimizer object reaches that is neither: ``state``, fp32 main parameters and shards),
  ``other`` (activations, logits, communication buffers, temporaries, and anything freed by then);
* ``host_peak``: the host tier (swap buffers, optimizer offload's masters, gradients and state), which a
  CPU device shares with the device tier, counted apart so that the device figure means what it does on
  an accelerator;
* ``step_time_s``: the median iteration time of the iterations run after the tracker was left (its
  Python dispatch on every operator slows a tracked iteration several times).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import torch

from hyper_adaptor.testing.measure import StorageTracker, _storages
from hyper_adaptor.testing.world import free_port

__all__ = ["PARTS", "TieredTracker", "classify", "measure", "optimizer_tensors", "model_storages"]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pretrain_gpt.py"
ENV_DIR = "HYPER_ADAPTOR_PEAK_DIR"
ENV_TRACKED = "HYPER_ADAPTOR_PEAK_TRACKED_ITERS"
PARTS = ("parameters", "gradients", "optimizer_state", "other")


# ------------------------------------------------------------------------------------------------ tracker
class TieredTracker(StorageTracker):
    """A :class:`StorageTracker` that also sees a storage resized in place (``UntypedStorage.resize_``:
    HSDP level 3 frees and refills its gathered copies that way, swap empties saved activations, the
    offload engine releases main copies), and that counts storages created inside :meth:`host` apart,
    in :attr:`host_live` / :attr:`host_peak`, never in :attr:`live` / :attr:`peak`."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__(device_type)
        self.host_depth = 0
        self.host_sizes: dict[int, int] = {}
        self.host_live = self.host_peak = 0
        self._original_resize = None

    def __enter__(self):
        original = torch.UntypedStorage.resize_
        tracker = self

        @functools.wraps(original)
        def resize_(storage, size):
            out = original(storage, size)
            tracker._resized(storage)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc_info):
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize
            self._original_resize = None
        return super().__exit__(*exc_info)

    @contextlib.contextmanager
    def host(self):
        """Storages created inside the block are host memory (nested blocks are one)."""
        self.host_depth += 1
        try:
            yield
        finally:
            self.host_depth -= 1

    def _track(self, storage, func) -> None:
        key = id(storage)
        with self.lock:
            if key in self.host_sizes:
                self._host_delta(key, storage.nbytes())
                return
            if self.host_depth and key not in self.tracked:
                self.host_sizes[key] = 0
                weakref.finalize(storage, self._host_freed, key)
                self._host_delta(key, storage.nbytes())
                return
        super()._track(storage, func)

    def _host_delta(self, key: int, size: int) -> None:
        self.host_live += size - self.host_sizes[key]
        self.host_sizes[key] = size
        self.host_peak = max(self.host_peak, self.host_live)

    def _host_freed(self, key: int) -> None:
        with self.lock:
            self.host_live -= self.host_sizes.pop(key)

    def _resized(self, storage) -> None:
        key, size = id(storage), storage.nbytes()
        with self.lock:
            if key in self.host_sizes:
                self._host_delta(key, size)
                return
            known = self.tracked.get(key)
            if known is None or known[0] == size:
                return
            counted, op, ref, serial = known
            self.tracked[key] = (size, op, ref, serial)
            self._grow(serial, size - counted)


# ------------------------------------------------------------------------------------------ classification
def _ids(t) -> set[int]:
    return {id(s) for s in _storages(t)} if isinstance(t, torch.Tensor) else set()


def model_storages(model_chunks) -> tuple[set[int], set[int]]:
    """Ids of the storages of the model's parameters and of its gradients (the chunks as
    ``setup_model_and_optimizer`` returns them: DDP- or HSDP-wrapped modules)."""
    params, grads = set(), set()
    for chunk in model_chunks:
        for p in chunk.parameters():
            params |= _ids(p)
            grads |= _ids(getattr(p, "main_grad", None)) | _ids(p.grad)
            hsdp = getattr(p, "_hsdp_param", None)
            if hsdp is not None:  # the gathered full copy (level 3 refills it in place for each use)
                params |= _ids(hsdp.full)
                grads |= _ids(hsdp.full.grad)
        for b in torch.nn.Module.buffers(chunk):  # DDP's ``buffers`` attribute hides the method
            params |= _ids(b)
        # megatron DDP's contiguous buffers: the parameters are views of param_data (where it exists), the
        # main gradients of grad_data
        for buffer in list(vars(chunk).get("buffers", [])) + list(vars(chunk).get("expert_parallel_buffers", [])):
            params |= _ids(getattr(buffer, "param_data", None))
            grads |= _ids(getattr(buffer, "grad_data", None))
    return params, grads


def optimizer_tensors(optimizer, max_depth: int = 8) -> tuple[list, list]:
    """Every tensor the optimizer object reaches through its attributes, containers and inner optimizers
    (not through modules), and the parameters its inner torch optimizers step (the main parameters where
    they are copies)."""
    found, stepped, seen = [], [], set()
    stack = [(optimizer, 0)]
    while stack:
        obj, depth = stack.pop()
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, type, torch.nn.Module)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            if obj.grad is not None:
                found.append(obj.grad)
            continue
        if depth >= max_depth:
            continue
        if isinstance(obj, torch.optim.Optimizer):
            stepped += [p for group in obj.param_groups for p in group["params"]]
        if isinstance(obj, dict):
            items = list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = list(obj)
        else:
            namespace = getattr(obj, "__dict__", None)
            items = list(namespace.values()) if isinstance(namespace, dict) else []
        stack += [(item, depth + 1) for item in items]
    return found, stepped


def classify(at_peak: list, model_chunks, optimizer) -> dict:
    """``at_peak`` (a tracker's ``(bytes, op, weakref, serial)`` entries) by :data:`PARTS`, plus
    ``main_parameters`` (within ``optimizer_state``) and ``other_by_op``. Judged by what each storage is
    now: call it while the model and optimizer are alive."""
    params, grads = model_storages(model_chunks)
    reached, stepped = optimizer_tensors(optimizer) if optimizer is not None else ([], [])
    main = set().union(*(_ids(p) for p in stepped)) - params - grads
    # a main parameter's own gradient (fp32 copies of half-precision gradients) is a gradient
    grads |= set().union(*(_ids(p.grad) for p in stepped)) - params
    state = set().union(*(_ids(t) for t in reached)) - params - grads
    parts = dict.fromkeys(PARTS, 0)
    main_bytes, other_by_op = 0, {}
    for size, op, ref, _ in at_peak:
        storage = ref()
        key = None if storage is None else id(storage)
        if key in params:
            parts["parameters"] += size
        elif key in grads:
            parts["gradients"] += size
        elif key in state:
            parts["optimizer_state"] += size
            main_bytes += size if key in main else 0
        else:
            parts["other"] += size
            other_by_op[op] = other_by_op.get(op, 0) + size
    top = dict(sorted(other_by_op.items(), key=lambda kv: -kv[1])[:8])
    return {"parts": parts, "main_parameters": main_bytes, "other_by_op": top}


# ------------------------------------------------------------------------------------------------ the rank
class _Rank:
    """What one rank records: the tracker from the model build to the last tracked iteration, then the
    iteration times of the untracked ones."""

    def __init__(self, tracked: int):
        self.tracked = tracked
        self.tracker = TieredTracker("cpu")
        self.active = False
        self.model = self.optimizer = None
        self.times: list[float] = []
        self.iterations = 0
        self.peak_iteration = 0
        self.record: dict | None = None

    def wrap_setup(self, original):
        @functools.wraps(original)
        def setup_model_and_optimizer(*args, **kwargs):
            self.tracker.__enter__()
            self.active = True
            result = original(*args, **kwargs)
            self.model, self.optimizer = result[0], result[1]
            return result
        return setup_model_and_optimizer

    def wrap_train_step(self, original):
        @functools.wraps(original)
        def train_step(*args, **kwargs):
            before = self.tracker.peak
            start = time.perf_counter()
            out = original(*args, **kwargs)
            self.times.append(time.perf_counter() - start)
            if self.active:
                self.iterations += 1
                if self.tracker.peak > before:
                    self.peak_iteration = self.iterations
                if self.iterations >= self.tracked:
                    self.stop()
            return out
        return train_step

    def stop(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        t = self.tracker
        with t.lock:
            peak, at_peak, live = t.peak, list(t.at_peak), t.live
        chunks = self.model if isinstance(self.model, (list, tuple)) else [self.model]
        classes = classify(at_peak, chunks, self.optimizer)
        kept_on = _get_current_dispatch_mode() is not t  # another mode above it: it cannot be left here
        if not kept_on:
            t.__exit__(None, None, None)
            self.active = False
        self.record = {
            "peak": peak, "parts_at_peak": classes["parts"], "main_parameters_at_peak": classes["main_parameters"],
            "other_by_op": classes["other_by_op"], "live_after_tracked": live, "peak_iteration": self.peak_iteration,
            "host_peak": t.host_peak, "host_after_tracked": t.host_live, "tracked_iterations": self.iterations,
            "tracker_left_on": kept_on,
        }

    def result(self, rank: int) -> dict:
        if self.record is None:
            raise RuntimeError(f"rank {rank}: the run ended after {self.iterations} of {self.tracked} tracked "
                               "iterations (or never built a model through setup_model_and_optimizer)")
        untimed = self.times[self.tracked:] or self.times[1:] or self.times
        return {"rank": rank, **self.record, "iterations": len(self.times),
                "step_times_s": self.times, "step_time_s": statistics.median(untimed) if untimed else None,
                "step_time_tracked": not self.times[self.tracked:]}


def _host_tier(tracker: TieredTracker) -> None:
    """Mark the adaptor's host-memory allocations: swap's host buffers (all through
    ``platform.host_buffer``), optimizer offload's masters, their gradient buffers and the host optimizer's
    state and temporaries."""
    from hyper_adaptor import platform
    from hyper_adaptor.memory import optimizer_offload

    def on_host(fn):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            with tracker.host():
                return fn(*args, **kwargs)
        return marked

    platform.host_buffer = on_host(platform.host_buffer)
    cls = optimizer_offload.OffloadOptimizer
    step = cls.step

    @functools.wraps(step)
    def marked_step(self, closure=None):
        # the masters' gradient buffers are made inside step() beside device work: made here first,
        # the same buffers step() would make, so that the host tier gets them
        with tracker.host():
            for p, m in self.masters.items():
                if m.grad is None and self.grad_of(p) is not None:
                    m.grad = torch.empty(m.shape, dtype=m.dtype, device="cpu", pin_memory=self.pin_memory)
        inner = self.host_optimizer
        if inner is not None and "step" not in vars(inner):
            inner.step = on_host(inner.step)
        return step(self, closure)

    cls._master, cls.step = on_host(cls._master), marked_step


def _rank_main(argv: list[str]) -> None:
    import runpy

    out_dir, tracked = Path(os.environ[ENV_DIR]), int(os.environ[ENV_TRACKED])
    script, *script_args = argv
    rank = int(os.environ.get("RANK", "0"))
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    import hyper_adaptor.megatron_adaptor  # noqa: F401  (before megatron, as the script's own line)

    import megatron.training.training as training

    state = _Rank(tracked)
    _host_tier(state.tracker)
    training.setup_model_and_optimizer = state.wrap_setup(training.setup_model_and_optimizer)
    training.train_step = state.wrap_train_step(training.train_step)
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    if state.active:
        state.tracker.__exit__(None, None, None)
    (out_dir / f"rank-{rank}.json").write_text(json.dumps(state.result(rank), indent=1) + "\n")


# ---------------------------------------------------------------------------------------------- the parent
def measure(flags: list[str], nproc: int, iters: int = 3, timed_iters: int = 2, script: str | os.PathLike = SCRIPT,
            timeout: float = 900, env: dict | None = None) -> list[dict]:
    """Run ``script`` with megatron ``flags`` on ``nproc`` CPU ranks for ``iters`` tracked iterations and
    ``timed_iters`` untracked ones (``--train-iters`` is set here); one dict per rank, in rank order (see
    the module docstring). A failed or timed-out run raises RuntimeError with the end of its output."""
    flags = [str(f) for f in flags]
    if "--train-iters" in flags:
        raise ValueError("measure: --train-iters is set from iters + timed_iters; leave it out of flags")
    if nproc < 1 or iters < 1 or timed_iters < 0:
        raise ValueError(f"measure: nproc and iters must be >= 1, timed_iters >= 0; got {nproc}, {iters}, "
                         f"{timed_iters}")
    with tempfile.TemporaryDirectory(prefix="peak_run-") as out:
        command = [sys.executable, "-m", "hyper_adaptor.testing.launch", "--nproc-per-node", str(nproc),
                   "--master-port", str(free_port()), str(Path(__file__).resolve()), str(script), *flags,
                   "--train-iters", str(iters + timed_iters)]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=path,
                       **{ENV_DIR: out, ENV_TRACKED: str(iters)}, **(env or {}))
        with subprocess.Popen(command, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) as proc:
            try:
                output, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                output, _ = proc.communicate()
                raise RuntimeError(f"measure: timed out after {timeout} s: {' '.join(flags)}\n{output[-4000:]}") \
                    from None
        if proc.returncode != 0:
            raise RuntimeError(f"measure: the run exited with {proc.returncode}: {' '.join(flags)}\n{output[-6000:]}")
        ranks = [json.loads((Path(out) / f"rank-{r}.json").read_text()) for r in range(nproc)]
    return ranks


if __name__ == "__main__":
    _rank_main(sys.argv[1:])
