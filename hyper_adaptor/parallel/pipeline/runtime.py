"""One runtime for every schedule: it walks this rank's action list and nothing else.

Why hand-written: the schedule is the product here — a validated list per rank — and the runtime must run
any list (ours, a user's) with megatron's forward/backward helpers as well as plain modules, so it only
knows the :class:`StageRunner` protocol. Communication is torch.distributed's ``batch_isend_irecv``:

- consecutive communication actions form one batch, posted together (megatron's
  ``send_forward_recv_backward`` pairing falls out of the list order);
- without ``overlap_p2p`` a batch is waited for before the next action; with it, a received tensor is
  waited for only by the compute step that reads it, and sends are waited for at the end of the step —
  so receives are in flight while this rank computes;
- the 2-rank communicators point-to-point needs (NCCL / HCCL create one per rank pair lazily, on first
  use) are all created before the first step, one pair after the other in the same order on every rank:
  megatron's interleaved schedule has hung when two pairs were first used in different orders;
- between two stages on the same rank (the bottom of ZBV's V) nothing is sent: the tensor is handed over.

Everything a rank receives is matched FIFO per rank pair; :mod:`.validate` proves before the first step
that the lists agree on that order and cannot deadlock.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from hyper_adaptor import platform
from hyper_adaptor.parallel.pipeline.actions import MetaStep, MetaStepType, StageLayout

T = MetaStepType


class StageRunner(Protocol):
    """What the runtime needs from each stage this rank holds (see module docstring of :mod:`.stage`)."""

    stage_index: int

    def forward(self, micro: int, inp: torch.Tensor | None) -> torch.Tensor | None: ...

    def backward(self, micro: int, grad: torch.Tensor | None, split_weight: bool) -> torch.Tensor | None: ...

    def backward_weight(self, micro: int) -> None: ...

    def recv_meta(self, kind: str, micro: int) -> tuple[torch.Size, torch.dtype]: ...


class PipelineRuntimeError(RuntimeError):
    pass


_WARMED: set = set()


def _group_rank(group) -> int:
    return dist.get_rank(group) if group is not None else dist.get_rank()


def _global(group, pipeline_rank: int) -> int:
    return dist.get_global_rank(group, pipeline_rank) if group is not None else pipeline_rank


def default_device(group) -> torch.device:
    """Where receive buffers live: the host for gloo, this process's accelerator otherwise."""
    if dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return platform.current_device()


def warm_up_pairs(layout: StageLayout, group, device: torch.device) -> None:
    """Create every rank pair's point-to-point channel now, pair by pair, in one order on all ranks."""
    me = _group_rank(group)
    pairs = sorted({tuple(sorted((layout.rank_of(s), layout.rank_of(s + 1))))
                    for s in range(layout.num_stages - 1)
                    if layout.rank_of(s) != layout.rank_of(s + 1)})
    key = (id(group), tuple(pairs), device.type)
    if key in _WARMED:
        return
    for a, b in pairs:
        if me not in (a, b):
            continue
        peer = b if me == a else a
        out, into = torch.zeros(1, device=device), torch.empty(1, device=device)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, _global(group, peer), group),
                                         dist.P2POp(dist.irecv, into, _global(group, peer), group)]):
            w.wait()
    _WARMED.add(key)


class _Step:
    """The state of one execution of one rank's list."""

    def __init__(self, runners, layout: StageLayout, group, overlap_p2p: bool, device, pair_runner=None):
        self.runners, self.layout, self.group = runners, layout, group
        self.overlap = overlap_p2p
        self.pair_runner = pair_runner
        self.device = device
        self.me = _group_rank(group) if dist.is_initialized() else 0
        self.inbox: dict[tuple[str, int, int], torch.Tensor] = {}   # what a stage will read
        self.outbox: dict[tuple[str, int, int], torch.Tensor] = {}  # what a stage produced for another rank
        self.pending: dict[tuple[str, int, int], list] = {}        # receive key -> works to wait for
        self.sends: list = []
        self.waited: dict = {}  # id -> work (kept, so that no id is reused within the step)

    def _wait(self, work) -> None:
        # a gloo work waited for a second time never returns: each is waited for once
        if id(work) not in self.waited:
            self.waited[id(work)] = work
            work.wait()

    def _take(self, key, action: MetaStep) -> torch.Tensor:
        for work in self.pending.pop(key, ()):
            self._wait(work)
        if key not in self.inbox:
            raise PipelineRuntimeError(f"pipeline rank {self.me}: {action} needs a tensor that was neither received "
                                       f"nor handed over ({key[0]} of micro-batch {key[2]} for stage {key[1]})")
        return self.inbox.pop(key)

    def _give(self, kind: str, stage: int, micro: int, tensor, target_stage: int, action: MetaStep) -> None:
        if tensor is None:
            raise PipelineRuntimeError(f"pipeline rank {self.me}: {action} produced no "
                                       f"{'activation' if kind == 'F' else 'input gradient'} for stage {target_stage}")
        tensor = tensor.detach()
        if self.layout.rank_of(target_stage) == self.me:
            self.inbox[(kind, target_stage, micro)] = tensor
        else:
            self.outbox[(kind, stage, micro)] = tensor.contiguous()

    def compute(self, action: MetaStep) -> None:
        halves = action.halves()
        if self.pair_runner is None or len(halves) == 1:
            for half in halves:
                self._half(half)
            return
        forward, backward = halves
        try:
            self.pair_runner.run(lambda: self._half(forward), lambda: self._half(backward))
        except RuntimeError as exc:  # the backward half's own error, not the overlap's wrapper
            if isinstance(exc.__cause__, PipelineRuntimeError):
                raise exc.__cause__ from None
            raise

    def _half(self, half: MetaStep) -> None:
        last = self.layout.num_stages - 1
        s, m = half.stage_index, half.micro_index
        runner = self.runners.get(s)
        if runner is None:
            raise PipelineRuntimeError(f"pipeline rank {self.me}: {half} is for stage {s}, which this rank "
                                       f"does not hold (it holds {sorted(self.runners)})")
        if half.step_type is T.FWD:
            inp = None if s == 0 else self._take(("F", s, m), half)
            out = runner.forward(m, inp)
            if s < last:
                self._give("F", s, m, out, s + 1, half)
        elif half.step_type in (T.BWD, T.BWD_INPUT):
            grad = None if s == last else self._take(("B", s, m), half)
            g = runner.backward(m, grad, half.step_type is T.BWD_INPUT)
            if s > 0:
                self._give("B", s, m, g, s - 1, half)
        elif half.step_type is T.BWD_WEIGHT:
            runner.backward_weight(m)
        else:  # pragma: no cover - MetaStep refuses other pairs
            raise PipelineRuntimeError(f"unknown compute step {half}")

    def communicate(self, batch: list[MetaStep]) -> None:
        ops, keys = [], []
        for a in batch:
            s, m = a.stage_index, a.micro_index
            if a.step_type in (T.SEND_F, T.SEND_B):
                kind, peer_stage = ("F", s + 1) if a.step_type is T.SEND_F else ("B", s - 1)
                tensor = self.outbox.pop((kind, s, m), None)
                if tensor is None:
                    raise PipelineRuntimeError(f"pipeline rank {self.me}: {a} sends before stage {s} produced it")
                ops.append(dist.P2POp(dist.isend, tensor, _global(self.group, self.layout.rank_of(peer_stage)),
                                      self.group))
            else:
                kind, peer_stage = ("F", s - 1) if a.step_type is T.RECV_F else ("B", s + 1)
                shape, dtype = self.runners[s].recv_meta(kind, m)
                buf = torch.empty(shape, dtype=dtype, device=self.device)
                self.inbox[(kind, s, m)] = buf
                keys.append((kind, s, m))
                ops.append(dist.P2POp(dist.irecv, buf, _global(self.group, self.layout.rank_of(peer_stage)),
                                      self.group))
        works = dist.batch_isend_irecv(ops)
        if not self.overlap:
            for w in works:
                w.wait()
            return
        if len(works) == len(ops):  # one work per op (gloo): each receive waits for its own
            for op, work in zip(ops, works):
                if op.op is dist.irecv:
                    self.pending[keys.pop(0)] = [work]
                else:
                    self.sends.append(work)
        else:  # one work for the whole batch (NCCL coalesces): every receive of it waits for that
            for key in keys:
                self.pending[key] = list(works)
            self.sends.extend(works)

    def finish(self) -> None:
        for w in self.sends:
            self._wait(w)
        left = sorted(self.inbox) + sorted(self.outbox)
        if left:
            raise PipelineRuntimeError(f"pipeline rank {self.me}: the step ended with tensors nobody used: {left}")


def execute(actions: list[MetaStep], runners: dict, layout: StageLayout, group=None, *,
            overlap_p2p: bool = False, device: torch.device | None = None, comm_compute_overlap=None) -> None:
    """Run this rank's ``actions`` with ``runners`` (stage index -> StageRunner) over ``group``.

    ``comm_compute_overlap``: an object with ``run(fwd_fn, bwd_fn)`` (``CommComputeOverlap``); each
    ``FWD_BWD`` pair's forward and backward then run through it, concurrently, instead of one after the
    other (its wrapped dispatch / combine order the two halves' expert-parallel exchanges)."""
    if comm_compute_overlap is not None and not callable(getattr(comm_compute_overlap, "run", None)):
        raise TypeError("execute: comm_compute_overlap must have a run(fwd_fn, bwd_fn) method (a "
                        f"CommComputeOverlap), got {type(comm_compute_overlap).__name__}")
    multi_rank = layout.ranks > 1
    if multi_rank:
        device = device or default_device(group)
        warm_up_pairs(layout, group, device)
    step = _Step(runners, layout, group, overlap_p2p, device, comm_compute_overlap)
    i, n = 0, len(actions)
    while i < n:
        if actions[i].step_type.is_comm:
            j = i
            while j < n and actions[j].step_type.is_comm:
                j += 1
            step.communicate(actions[i:j])
            i = j
        else:
            step.compute(actions[i])
            i += 1
    step.finish()


__all__ = ["StageRunner", "execute", "PipelineRuntimeError", "default_device", "warm_up_pairs"]
