"""One profiling window per process: steps [start, end) of megatron's train loop, on the chosen ranks.

Step ``i`` is the train step megatron runs after ``i`` iterations are done (megatron's log prints it as
iteration ``i + 1``), the numbering of megatron's own ``--profile`` window. Each recorded step is one
``ProfilerStep#i`` range around megatron's ``train_step``; the recorder is warmed up one step early,
stopped when step ``end - 1`` returns, and the rank then writes its trace (and memory snapshot) and
prints a short summary.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

import torch

from hyper_adaptor import platform
from hyper_adaptor.patches.profiling import backends, summary
from hyper_adaptor.patches.profiling.ranks import profiled_ranks

TAG = "[profile]"


@dataclass(frozen=True)
class WindowConfig:
    start: int
    end: int
    ranks: tuple[int, ...] | None  # None: every rank
    level: str
    with_cpu: bool
    with_stack: bool
    with_memory: bool
    record_shapes: bool
    save_path: str

    @classmethod
    def from_args(cls, args) -> WindowConfig:
        ranks = profiled_ranks(args)
        return cls(
            start=args.profile_step_start, end=args.profile_step_end,
            ranks=None if ranks is None else tuple(ranks),
            level=args.profile_level,
            # on CPU the host is the device: its operators are the only thing there is to record
            with_cpu=bool(args.profile_with_cpu) or platform.device_type() == "cpu",
            with_stack=bool(args.profile_with_stack or getattr(args, "pytorch_profiler_collect_callstack", False)),
            with_memory=bool(args.profile_with_memory),
            record_shapes=bool(args.profile_record_shapes or getattr(args, "pytorch_profiler_collect_shapes", False)),
            save_path=args.profile_save_path,
        )


_window: ProfileWindow | None = None


def configure(config: WindowConfig | None) -> None:
    global _window
    _window = None if config is None else ProfileWindow(config)


def current() -> ProfileWindow | None:
    return _window


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


class ProfileWindow:
    def __init__(self, config: WindowConfig):
        self.config = config
        self.recorder = None
        self.recording = False
        self.first: int | None = None
        self.last: int | None = None
        self.done = False
        self.started_at = 0.0
        self.outputs: list[str] = []

    def profiles_this_rank(self) -> bool:
        return self.config.ranks is None or _rank() in self.config.ranks

    @contextlib.contextmanager
    def step(self, iteration: int):
        c = self.config
        if self.done or not self.profiles_this_rank():
            yield
            return
        if self.recording and iteration >= c.end:  # steps skipped past the window's end
            self.finish()
            yield
            return
        if not c.start <= iteration < c.end:
            if iteration == c.start - 1 and self.recorder is None:
                self.recorder = backends.recorder(c)
                self.recorder.warm_up()
            yield
            return
        if not self.recording:
            self._start(iteration)
        with self.recorder.marker(iteration):
            yield
        self.last = iteration
        if iteration == c.end - 1:
            self.finish()

    def _start(self, iteration: int) -> None:
        if self.recorder is None:
            self.recorder = backends.recorder(self.config)
        if self.config.with_memory and backends.snapshot_supported():
            backends.start_memory_history()
        self.first = iteration
        self.recorder.start()
        self.started_at = time.perf_counter()
        self.recording = True

    def finish(self) -> None:
        c, rank = self.config, _rank()
        stem = f"rank{rank}.steps{self.first}-{self.last}"
        self.recorder.stem = stem
        wall = time.perf_counter() - self.started_at  # the steps only, not the profiler's stop
        os.makedirs(c.save_path, exist_ok=True)
        self.recorder.stop()
        self.recording, self.done = False, True
        self.outputs = [self.recorder.save(c.save_path, stem)]
        notes = []
        if c.with_memory:
            if backends.snapshot_supported():
                path = os.path.join(c.save_path, f"{stem}.memory_snapshot.pickle")
                backends.dump_memory_history(path)
                self.outputs.append(path)
            else:
                notes.append(f"no memory snapshot on {platform.device_type()}: torch keeps no allocator history "
                             "for host memory; the trace holds the allocation events (profile_memory)")
        lines = summary.lines(self.recorder.averages(), device_time=self.recorder.device_time, wall_ms=wall * 1e3,
                              comm_intervals=self.recorder.communication_intervals())
        head = (f"{TAG} rank {rank}: steps {self.first}-{self.last} ({c.level}, {self.recorder.kind}, "
                f"window {wall * 1e3:.1f} ms) -> {', '.join(self.outputs)}")
        print("\n".join([head, *(f"{TAG} rank {rank}: {line}" for line in lines + notes)]), flush=True)
