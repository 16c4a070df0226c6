"""``PipelineStage``: one model chunk as a :class:`~.runtime.StageRunner` for the library schedules.

A stage wraps an ``nn.Module`` that maps the previous stage's activation (one tensor; stage 0: the user's
micro-batch arguments) to one tensor. Per micro-batch it keeps only what backward needs, and drops it the
moment the action that needs it is done:

- after ``forward``: the input leaf and the output (last stage: the loss) until ``backward``;
- after ``backward(split_weight=True)`` (zero bubble's I): nothing but the :class:`~.wgrad.WeightGradQueue`
  of that micro-batch (each deferred Linear's input and output gradient) until ``backward_weight`` (W).

The input of a stage > 0 becomes a fresh leaf that requires grad (its ``.grad`` is what goes back). The last
stage applies the schedule's ``loss_fn(output, target)`` (``loss_fn(output)`` without a target) in its forward
and backpropagates the loss as it is: gradients are those of the **sum** of the micro-batch losses.

Receive shapes. The runtime asks ``recv_meta`` before it posts a receive:

- ``"B"`` (the gradient of this stage's output) is the shape/dtype of the output this stage produced for
  that micro-batch — always known, since a stage's backward follows its forward;
- ``"F"`` (the activation from the previous stage) is found once, by :func:`infer_input_shapes`, which the
  schedule runs before its first step: every rank walks its stages in stage order; stage ``s`` receives a
  small header (ndim, dtype, sizes) and the activation of micro-batch 0 from stage ``s - 1``'s rank (or takes
  it in memory from the same rank), runs its module on it under ``no_grad``, and sends its output on to stage
  ``s + 1``. Blocking sends/receives along the model order cannot deadlock: every wait points to a lower
  stage, or to the receive of ``s + 1`` whose rank reaches it after only lower stages. It costs one forward
  of one micro-batch. All micro-batches of a step must then have that shape (stage 0 checks that its split is
  even; after a shape change call the schedule's ``reset_shapes()`` on every rank).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.pipeline.wgrad import WeightGradQueue, defer_weight_grads

__all__ = ["PipelineStage", "infer_input_shapes"]


class PipelineStage:
    """Stage ``stage_index`` of ``stage_num`` (all stages of the pipeline, every chunk counted) running
    ``module`` on this rank. ``device``: where stage 0's micro-batch inputs are moved (default: left where
    they are). ``group``: the pipeline process group (default: the world)."""

    def __init__(self, module: torch.nn.Module, stage_index: int, stage_num: int, device=None, group=None):
        if not 0 <= stage_index < stage_num:
            raise ValueError(f"PipelineStage: stage_index {stage_index} outside 0..{stage_num - 1} (stage_num)")
        self.module = module
        self.stage_index = stage_index
        self.stage_num = stage_num
        self.device = torch.device(device) if device is not None else None
        self.group = group
        self.is_first = stage_index == 0
        self.is_last = stage_index == stage_num - 1
        # set by the schedule for one step
        self._micro_args: list[tuple] | None = None
        self._targets: list | None = None
        self._loss_fn = None
        self._training = True
        # per micro-batch state, dropped as soon as the action that needs it is done
        self._saved: dict[int, tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._out_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._wgrad: dict[int, WeightGradQueue] = {}
        self._in_meta: tuple[torch.Size, torch.dtype] | None = None
        self.outputs: dict[int, torch.Tensor] = {}   # last stage: detached outputs, for the merged result
        self.losses: dict[int, torch.Tensor] = {}    # last stage: detached losses
        self.peak_live_micro_batches = 0            # micro-batches whose F is done and B (or W) is not

    def __repr__(self) -> str:
        return f"PipelineStage({self.stage_index}/{self.stage_num}, {type(self.module).__name__})"

    # -- the schedule's side -------------------------------------------------------------------------
    def _begin_step(self, micro_args, targets, loss_fn, training: bool) -> None:
        self._micro_args, self._targets, self._loss_fn, self._training = micro_args, targets, loss_fn, training
        self.outputs, self.losses = {}, {}

    def _end_step(self) -> None:
        left = sorted(self._saved) + sorted(self._wgrad)
        self._saved.clear(), self._wgrad.clear(), self._out_meta.clear()
        self._micro_args = self._targets = None
        if left:
            raise RuntimeError(f"stage {self.stage_index}: micro-batches {left} were not fully backpropagated "
                               "(the schedule has an F without its B, or an I without its W)")

    def _live(self) -> int:
        return len(self._saved) + len(self._wgrad)

    # -- StageRunner ---------------------------------------------------------------------------------
    def forward(self, micro: int, inp: torch.Tensor | None) -> torch.Tensor | None:
        leaf = None
        if self.is_first:
            if self._micro_args is None:
                raise RuntimeError("stage 0: no inputs — call step(*inputs) on the rank holding stage 0")
            args = self._micro_args[micro]
        else:
            leaf = inp.detach()
            if self._training and leaf.is_floating_point():
                leaf.requires_grad_(True)
            args = (leaf,)
        with torch.set_grad_enabled(self._training):
            out = self.module(*args)
            if self.is_last:
                self.outputs[micro] = out.detach()
                keep = None
                if self._loss_fn is not None:
                    target = None if self._targets is None else self._targets[micro]
                    keep = self._loss_fn(out) if target is None else self._loss_fn(out, target)
                    self.losses[micro] = keep.detach()
            else:
                if not isinstance(out, torch.Tensor):
                    raise TypeError(f"stage {self.stage_index}: a stage before the last must return one tensor "
                                    f"(it is sent to stage {self.stage_index + 1}), got {type(out).__name__}")
                keep = out
                self._out_meta[micro] = (out.shape, out.dtype)
        if self._training:
            if keep is None:
                raise RuntimeError(f"stage {self.stage_index}: backward needs a loss_fn on the last stage")
            self._saved[micro] = (leaf, keep)
            self.peak_live_micro_batches = max(self.peak_live_micro_batches, self._live())
        return None if self.is_last else out

    def backward(self, micro: int, grad: torch.Tensor | None, split_weight: bool) -> torch.Tensor | None:
        leaf, keep = self._saved.pop(micro)
        queue = WeightGradQueue() if split_weight else None
        with defer_weight_grads(queue) if split_weight else contextlib.nullcontext():
            if self.is_last:
                torch.autograd.backward(keep)
            else:
                torch.autograd.backward(keep, grad)
        del keep
        if queue is not None and len(queue):
            self._wgrad[micro] = queue
        self._out_meta.pop(micro, None)
        return None if leaf is None else leaf.grad

    def backward_weight(self, micro: int) -> None:
        queue = self._wgrad.pop(micro, None)  # none: this stage had no deferrable layer
        if queue is not None:
            queue.run()

    def recv_meta(self, kind: str, micro: int) -> tuple[torch.Size, torch.dtype]:
        if kind == "B":
            if micro not in self._out_meta:
                raise RuntimeError(f"stage {self.stage_index}: gradient of micro-batch {micro} received before "
                                   "its forward ran here")
            return self._out_meta[micro]
        if self._in_meta is None:
            raise RuntimeError(f"stage {self.stage_index}: the shape of its input is unknown; the schedule infers "
                               "it before the first step (infer_input_shapes)")
        return self._in_meta


# -- shape inference ---------------------------------------------------------------------------------------
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16, torch.float8_e4m3fn, torch.float8_e5m2]
_MAX_DIMS = 8


def _send_tensor(t: torch.Tensor, dst: int, group, device) -> None:
    if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
        raise ValueError(f"pipeline activation {tuple(t.shape)} {t.dtype}: at most {_MAX_DIMS} dims, dtype one of "
                         f"{_DTYPES}")
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    header[0], header[1] = t.dim(), _DTYPES.index(t.dtype)
    header[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, dst, group=group)
    dist.send(t.detach().to(device).contiguous(), dst, group=group)


def _recv_tensor(src: int, group, device) -> torch.Tensor:
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, src, group=group)
    header = header.tolist()
    t = torch.empty(header[2:2 + header[0]], dtype=_DTYPES[header[1]], device=device)
    dist.recv(t, src, group=group)
    return t


def infer_input_shapes(stages: dict[int, PipelineStage], layout, group, device) -> None:
    """Set every stage's input shape (``recv_meta("F")``) by one no-grad forward of micro-batch 0 along the
    model, stage by stage (see the module docstring); call on every rank of the pipeline at once."""
    me = dist.get_rank(group) if dist.is_initialized() else 0
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    handed = None
    for s in range(layout.num_stages):
        if layout.rank_of(s) != me:
            continue
        stage = stages[s]
        if s == 0:
            args = stage._micro_args[0]
        else:
            if layout.rank_of(s - 1) == me:
                x = handed
            else:
                x = _recv_tensor(to_global(layout.rank_of(s - 1)), group, device)
            stage._in_meta = (x.shape, x.dtype)
            args = (x,)
        # the extra forward must not move the RNG the real step's dropout draws from
        with torch.no_grad(), torch.random.fork_rng(
                devices=[] if device.type == "cpu" else None, device_type=device.type):
            out = stage.module(*args)
        if s < layout.num_stages - 1:
            if layout.rank_of(s + 1) == me:
                handed = out
            else:
                _send_tensor(out, to_global(layout.rank_of(s + 1)), group, device)
