"""Zero-bubble weight-gradient deferral for megatron's tensor-parallel linear layers.

Megatron-core 0.19.2 splits a linear layer's backward only with TransformerEngine (``--delay-wgrad-compute``);
the local layers' ``backward_dw`` does nothing. Every local Column/RowParallelLinear runs its product through
``LinearWithGradAccumulationAndAsyncCommunication``; that Function's ``backward`` already knows how to skip the
weight gradient: with a ``grad_output_buffer`` it keeps ``grad_output`` and computes only the input gradient
(with its tensor-parallel all-reduce / sequence-parallel reduce-scatter). That path is only complete under
gradient-accumulation fusion, so while a pipeline schedule's input-gradient step (``BWD_INPUT``) runs, the wrap
below hands megatron's backward a buffer and the fusion switch, collects ``(input, weight, grad_output)``
and gives autograd no weight gradient. The schedule's ``BWD_WEIGHT`` step then computes each
``grad_output^T @ input`` (gathering the input over the tensor-parallel group first under sequence parallel)
and accumulates it where megatron would have: into the fp32 ``main_grad`` through the level-1 ``wgrad_accum``
op when megatron fuses the accumulation, else ``main_grad += grad`` (megatron DDP's hook) or ``param.grad``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.pipeline.wgrad import accumulate_weight_grad
from hyper_adaptor.patch_manager import Patch

FEATURE = "pipeline"
TARGET = "megatron.core.tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication.backward"

# The queue the running BWD_INPUT step collects into. A module global, not a thread-local: autograd runs
# accelerator backward functions on its own device threads; one backward runs at a time per process.
_ACTIVE: list | None = None
_ABSENT = object()
DEFERRED_RUNS = [0]  # weight products computed in BWD_WEIGHT steps in this process (tests read it)


class DeferredWeightGrad:
    """One postponed ``grad_output^T @ input`` of one linear layer."""

    __slots__ = ("input", "weight", "grad_output", "sequence_parallel", "tp_group", "fused")

    def __init__(self, ctx, grad_output, fused: bool):
        # detached: the product needs the values only, not the graph the tensors belong to (the loss stage's
        # grad_output is megatron's cross entropy's softmax, computed in place in the logits: it carries the
        # output layer's own autograd node, and with it the whole micro-batch's graph)
        inp, self.weight = ctx.saved_tensors
        self.input = inp.detach()
        self.grad_output = grad_output.detach()
        self.sequence_parallel = ctx.sequence_parallel
        self.tp_group = ctx.tp_group
        self.fused = fused

    def run(self) -> None:
        inp = self.input
        if self.sequence_parallel:  # the product needs every tensor-parallel rank's sequence slice
            size = dist.get_world_size(self.tp_group)
            full = inp.new_empty((inp.shape[0] * size, *inp.shape[1:]))
            dist.all_gather_into_tensor(full, inp.contiguous(), group=self.tp_group)
            inp = full
        accumulate_weight_grad(inp, self.grad_output, self.weight, fused=self.fused)


@contextlib.contextmanager
def deferring(queue: list):
    """Collect the weight gradients of megatron's linear layers into ``queue`` instead of computing them."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, queue
    try:
        yield queue
    finally:
        _ACTIVE = previous


def run_deferred(queue: list) -> None:
    with torch.no_grad():  # the products are gradients, not part of any graph
        while queue:
            queue.pop(0).run()
            DEFERRED_RUNS[0] += 1


def _wrap_backward(original):
    def backward(ctx, grad_output):
        queue = _ACTIVE
        if queue is None or not ctx.needs_input_grad[1] or getattr(ctx, "gtp_remat_size", 1) > 1:
            return original(ctx, grad_output)
        _input, weight = ctx.saved_tensors
        fused = ctx.gradient_accumulation_fusion
        # megatron's deferral path: a grad_output buffer with room, and the fused-accumulation branch (which
        # then computes no weight gradient); megatron's writes to the weight's attributes are undone below
        had_main_grad = getattr(weight, "main_grad", _ABSENT)
        had_added = getattr(weight, "grad_added_to_main_grad", _ABSENT)
        ctx.grad_output_buffer, ctx.wgrad_deferral_limit = [], 0
        ctx.gradient_accumulation_fusion = True
        ctx.main_grad = None if had_main_grad is _ABSENT else had_main_grad
        try:
            grads = list(original(ctx, grad_output))
        finally:
            # megatron appended grad_output to the buffer on ctx; the queue below holds it. Left there it would
            # live as long as ctx, the autograd node: on the loss stage grad_output's own grad_fn is that node
            # (see DeferredWeightGrad), a reference cycle that kept every deferred micro-batch's graph, and
            # the grad_outputs on its nodes, alive until Python's cyclic collector happened to run
            ctx.grad_output_buffer = None
            for name, value in (("main_grad", had_main_grad), ("grad_added_to_main_grad", had_added)):
                if value is _ABSENT:
                    if hasattr(weight, name):
                        delattr(weight, name)
                else:
                    setattr(weight, name, value)
        # megatron-core main's backward casts grad_output to the input's dtype (ctx.input_dtype) first
        grad_output = grad_output.to(getattr(ctx, "input_dtype", grad_output.dtype))
        queue.append(DeferredWeightGrad(ctx, grad_output, fused))
        grads[1] = None  # the weight's gradient arrives in the BWD_WEIGHT step
        if ctx.use_bias:  # megatron sums the bias gradient over the 2-D view it builds only for the product
            grads[2] = grad_output.contiguous().view(-1, grad_output.shape[-1]).sum(dim=0)
        return tuple(grads)

    return backward  # the patch manager keeps the staticmethod wrapper


def patches() -> list[Patch]:
    return [Patch(TARGET, _wrap_backward, "wrap", FEATURE)]


__all__ = ["DeferredWeightGrad", "deferring", "run_deferred", "patches", "TARGET"]
