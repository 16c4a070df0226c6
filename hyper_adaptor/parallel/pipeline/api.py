"""The library entry: schedules that run :class:`~.stage.PipelineStage` objects, HyperParallel's names.

    stage = PipelineStage(my_chunk, stage_index=rank, stage_num=world)
    schedule = Schedule1F1B(stage, micro_batch_num=8, loss_fn=loss)
    losses = []
    out = schedule.step(x, target=y, losses=losses)    # x on rank 0, y on the last rank; None elsewhere
    optimizer.step()

Each schedule builds its action lists once (:func:`.schedules.build`, validated by :mod:`.validate`:
crossed send/receive order and deadlock are errors on every rank before any communication), keeps this
rank's list as ``actions`` and all of them as ``all_actions``, and prints as the timeline (``str``).
``step`` splits the inputs into micro-batches (:class:`BatchDimSpec` per argument, ``torch.tensor_split``),
runs the list with the runtime (:func:`.runtime.execute`), appends the per-micro-batch losses to ``losses``
and returns the outputs concatenated along dim 0 on the rank of the last stage (None elsewhere).

Gradient convention: each micro-batch's loss is backpropagated as it is, so the stage modules' gradients
are those of the **sum** of the micro-batch losses (accumulated onto what ``.grad`` held before; zero them
yourself). With a mean-reduced loss, the gradient of the whole-batch mean is that sum divided by
``micro_batch_num`` (scale the loss in ``loss_fn`` if you want it). ``loss_fn=None`` makes a forward-only
(inference) schedule.

Layouts: GPipe, 1F1B and ZB-H1 hold one stage per rank (stage r on rank r); interleaved 1F1B holds
``len(stages)`` chunks per rank, stage ``c * ranks + r`` on rank ``r``; ZBV holds two, stages ``r`` and
``2 * ranks - 1 - r`` (a V). The constructor checks the stages given match.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.pipeline.actions import MetaStep, MetaStepType, StageLayout
from hyper_adaptor.parallel.pipeline.runtime import default_device, execute, warm_up_pairs

# the functions, not the modules: the package re-exports a function named ``validate``
from hyper_adaptor.parallel.pipeline.schedules import build as build_lists
from hyper_adaptor.parallel.pipeline.stage import PipelineStage, infer_input_shapes
from hyper_adaptor.parallel.pipeline.timeline import render as render_timeline
from hyper_adaptor.parallel.pipeline.validate import validate as validate_lists
from hyper_adaptor.parallel.pipeline.wgrad import enable_weight_deferral

__all__ = ["BatchDimSpec", "PipelineSchedule", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZBH1", "ScheduleZBV", "schedule_from_actions", "split_micro_batches"]


@dataclasses.dataclass(frozen=True)
class BatchDimSpec:
    """How one ``step`` argument splits into micro-batches: ``torch.tensor_split`` along ``dim``."""

    dim: int = 0


def split_micro_batches(args: tuple, specs, micro: int) -> list[tuple]:
    """``args`` cut into ``micro`` tuples; tensors by their spec (default dim 0), anything else repeated."""
    if specs is None:
        specs = [BatchDimSpec()] * len(args)
    if len(specs) != len(args):
        raise ValueError(f"{len(specs)} BatchDimSpec for {len(args)} arguments")
    columns = []
    for i, (a, spec) in enumerate(zip(args, specs)):
        if isinstance(a, torch.Tensor) and spec is not None:
            if a.shape[spec.dim] < micro:
                raise ValueError(f"argument {i}: {a.shape[spec.dim]} rows along dim {spec.dim} cannot make "
                                 f"{micro} micro-batches")
            parts = torch.tensor_split(a, micro, dim=spec.dim)
            if len({p.shape for p in parts}) != 1:
                raise ValueError(f"argument {i}: {a.shape[spec.dim]} rows along dim {spec.dim} do not split into "
                                 f"{micro} equal micro-batches (every micro-batch must have one shape)")
            columns.append(parts)
        else:
            columns.append([a] * micro)
    return [tuple(col[m] for col in columns) for m in range(micro)]


def _to(x, device):
    return x.to(device) if device is not None and isinstance(x, torch.Tensor) else x


class PipelineSchedule:
    """A validated action list per rank run over this rank's stages. Prefer the named subclasses;
    :func:`schedule_from_actions` builds one from lists of your own."""

    def __init__(self, stages, micro_batch_num: int, loss_fn, layout: StageLayout, lists, *,
                 overlap_p2p: bool = False, args_chunk_spec=None, validated: bool = False,
                 comm_compute_overlap=None):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if not stages:
            raise ValueError("a schedule needs the stage(s) this rank holds")
        self.group = stages[0].group
        self.rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        ranks = dist.get_world_size(self.group) if dist.is_initialized() else 1
        if ranks != layout.ranks:
            raise ValueError(f"the pipeline group has {ranks} ranks, the schedule's layout {layout.ranks}")
        if len(lists) != layout.ranks:
            raise ValueError(f"{len(lists)} action lists for {layout.ranks} pipeline ranks")
        forward_only = not any(a.step_type is not MetaStepType.FWD and a.step_type.is_compute
                               for r in lists for a in r)
        if not validated:
            validate_lists(lists, layout, micro_batch_num, forward_only=forward_only)
        self.layout, self.micro_batch_num, self.loss_fn = layout, micro_batch_num, loss_fn
        self.all_actions: list[list[MetaStep]] = [list(a) for a in lists]
        self.actions = self.all_actions[self.rank]
        self.overlap_p2p = overlap_p2p
        self.comm_compute_overlap = comm_compute_overlap  # runs each FWD_BWD pair (see runtime.execute)
        self.args_chunk_spec = args_chunk_spec
        want = sorted(layout.stages_of(self.rank))
        have = sorted(s.stage_index for s in stages)
        if have != want:
            raise ValueError(f"pipeline rank {self.rank} holds stages {want} in this schedule's layout "
                             f"({layout.style}, {layout.chunks} per rank), but was given stages {have}")
        for s in stages:
            if s.stage_num != layout.num_stages:
                raise ValueError(f"stage {s.stage_index} says stage_num={s.stage_num}; the schedule has "
                                 f"{layout.num_stages} stages")
        self.stages = {s.stage_index: s for s in stages}
        self.forward_only = forward_only
        if loss_fn is None and not self.forward_only:
            raise ValueError("a schedule with backward steps needs a loss_fn")
        deferring = {h.stage_index for a in self.actions for h in a.halves()
                     if h.step_type is MetaStepType.BWD_INPUT}
        for s in deferring:  # only where the list splits B: elsewhere nn.Linear stays torch's own
            enable_weight_deferral(self.stages[s].module)
        device = None
        if layout.ranks > 1:
            device = default_device(self.group)
        self._comm_device = device
        self._shapes_known = layout.ranks == 1  # one rank: every hand-over is in memory

    def __str__(self) -> str:
        return render_timeline(self.all_actions, self.layout)

    def reset_shapes(self) -> None:
        """Infer the stages' input shapes again at the next step (call on every rank at once)."""
        self._shapes_known = self.layout.ranks == 1

    def step(self, *args, target=None, losses: list | None = None):
        m = self.micro_batch_num
        first = self.stages.get(0)
        last = self.stages.get(self.layout.num_stages - 1)
        micro_args = None
        if first is not None:
            if not args:
                raise ValueError("step(): the rank holding stage 0 must pass the inputs")
            micro_args = [tuple(_to(a, first.device) for a in t)
                          for t in split_micro_batches(args, self.args_chunk_spec, m)]
        targets = None
        if last is not None and target is not None:
            targets = [_to(t, last.device) for (t,) in split_micro_batches((target,), None, m)]
        training = not self.forward_only
        for s in self.stages.values():
            s._begin_step(micro_args if s is first else None, targets if s is last else None,
                          self.loss_fn, training)
        try:
            if not self._shapes_known:
                # the runtime's pair-by-pair channel creation first, so the header exchange opens none
                warm_up_pairs(self.layout, self.group, self._comm_device)
                infer_input_shapes(self.stages, self.layout, self.group, self._comm_device)
                self._shapes_known = True
            execute(self.actions, self.stages, self.layout, self.group, overlap_p2p=self.overlap_p2p,
                    device=self._comm_device, comm_compute_overlap=self.comm_compute_overlap)
        finally:
            errors = []
            for s in self.stages.values():
                try:
                    s._end_step()
                except RuntimeError as e:
                    errors.append(e)
        if errors:
            raise errors[0]
        if last is None:
            return None
        if losses is not None and last.losses:
            losses.extend(last.losses[i] for i in range(m))
        return torch.cat([last.outputs[i] for i in range(m)], dim=0)

    def run(self, *inputs, target=None, losses: list | None = None):
        """HyperParallel's entry: ``step`` under its name. Returns the last stage's outputs (concatenated over
        the micro-batches) on the rank holding it, None elsewhere."""
        return self.step(*inputs, target=target, losses=losses)


class _Named(PipelineSchedule):
    _name: str = ""
    _chunks: int | None = 1

    def __init__(self, stages, micro_batch_num: int, loss_fn=None, overlap_p2p: bool = False,
                 overlap_b_f: bool = False, *, args_chunk_spec=None, comm_compute_overlap=None):
        stages = [stages] if isinstance(stages, PipelineStage) else list(stages)
        if self._chunks is not None and len(stages) != self._chunks:
            raise ValueError(f"{type(self).__name__} holds {self._chunks} stage(s) per rank, got {len(stages)}")
        if not stages:
            raise ValueError(f"{type(self).__name__}: no stages")
        group = stages[0].group
        ranks = dist.get_world_size(group) if dist.is_initialized() else 1
        kwargs = {"forward_only": loss_fn is None}
        if overlap_b_f:
            kwargs["overlap_b_f"] = True
        layout, lists = build_lists(self._name, ranks, micro_batch_num, len(stages), **kwargs)
        super().__init__(stages, micro_batch_num, loss_fn, layout, lists, overlap_p2p=overlap_p2p,
                         args_chunk_spec=args_chunk_spec, validated=True, comm_compute_overlap=comm_compute_overlap)


class ScheduleGPipe(_Named):
    """All forwards, then all backwards; one stage per rank."""

    _name = "gpipe"


class Schedule1F1B(_Named):
    """One forward one backward after a warm-up of ``ranks - rank`` forwards; one stage per rank."""

    _name = "1f1b"


class ScheduleInterleaved1F1B(_Named):
    """Megatron's interleaved 1F1B (virtual pipeline): several chunks (stages) per rank, in a loop."""

    _name = "interleaved"
    _chunks = None


class ScheduleZBH1(_Named):
    """Zero bubble H1: 1F1B with B split into I and W, W filling the cool-down; one stage per rank."""

    _name = "zbh1"


class ScheduleZBV(_Named):
    """Zero bubble V: two stages per rank in a V (stages ``r`` and ``2 * ranks - 1 - r``), B split in I/W."""

    _name = "zbv"
    _chunks = 2


def schedule_from_actions(stages, lists, layout: StageLayout, micro_batch_num: int, loss_fn=None, *,
                          overlap_p2p: bool = False, args_chunk_spec=None) -> PipelineSchedule:
    """A schedule from your own action lists (one per pipeline rank; validated on every rank before any
    communication: a missing receive, crossed send order or a deadlock raise ``ScheduleError``)."""
    return PipelineSchedule(stages, micro_batch_num, loss_fn, layout, lists, overlap_p2p=overlap_p2p,
                            args_chunk_spec=args_chunk_spec)
