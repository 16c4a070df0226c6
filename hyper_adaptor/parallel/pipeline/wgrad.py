"""Weight-gradient deferral for the zero-bubble schedules: the B of a Linear split into I (input gradient,
now) and W (weight gradient, later).

``enable_weight_deferral(module)`` routes every ``torch.nn.Linear`` under ``module`` through
:class:`_DeferrableLinear`, an autograd Function of ours; ``with defer_weight_grads(queue): loss.backward()``
then makes those layers compute only their input gradient and bias gradient, and append
``(input, grad_output, weight)`` to ``queue``; ``queue.run()`` later computes each weight gradient and
accumulates it — into ``weight.main_grad`` through :func:`hyper_adaptor.ops.wgrad_accum.wgrad_accum`
when the weight has one (megatron's fp32 gradient buffer), else into ``weight.grad``.

Why an autograd Function and not hooks: the decision (defer or not) is taken while backward runs, by
the code that runs it; a hook on a Linear's output sees ``grad_output`` but cannot stop torch's own
``AddmmBackward`` from computing the weight gradient in the same node, so a hook-based split would make
every caller restrict ``backward(inputs=...)`` to the non-deferred leaves itself. The Function owns the
backward of the layer and reads the active queue (a module-level stack, not thread-local: autograd runs
an accelerator's backward in its own device thread while the caller waits) when it runs.

Numerics: the forward is ``F.linear`` itself. The backward outside the context uses the formulas and
operand orders of torch's own derivative of ``addmm`` (what ``F.linear`` dispatches to for a row-major
input): ``dX = dY @ W``, ``dW = dY^T @ X``, ``db = dY.sum(0)`` on the flattened ``[tokens, features]``
views, so the gradients are those of a plain ``nn.Linear`` (tests/unit/pipeline/test_wgrad.py checks it
bitwise). Inside the context ``dX`` and ``db`` are the same; ``dW`` is computed in ``run()`` by the same
``mm`` and added to ``weight.grad`` as autograd's ``AccumulateGrad`` would (set when None, else ``+=``), so
deferred and immediate weight gradients are bitwise equal. Into ``main_grad`` it is ``wgrad_accum``'s fused
fp32 ``addmm`` (one rounding), as megatron's gradient-accumulation fusion does; ``weight.grad`` is then
left alone and ``weight.grad_added_to_main_grad`` set when the weight carries that flag.

Not done by the deferred path: ``AccumulateGrad``'s post-accumulate hooks (a weight's hooks run at I time
for nothing, never at W). Only ``nn.Linear`` defers; other parameters get their gradients at I time.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["WeightGradQueue", "accumulate_weight_grad", "defer_weight_grads", "enable_weight_deferral",
           "disable_weight_deferral", "deferrable_linear"]

_ACTIVE: list[WeightGradQueue] = []  # innermost active queue last


class WeightGradQueue:
    """Weight-gradient work deferred by :func:`defer_weight_grads`: ``(input, grad_output, weight)`` triples.

    Holding a queue keeps each layer's input and output gradient alive until :meth:`run`, and no longer:
    ``run`` (and ``clear``) drops them."""

    def __init__(self):
        self._items: list[tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter]] = []

    def append(self, total_input: torch.Tensor, grad_output: torch.Tensor, weight: torch.Tensor) -> None:
        self._items.append((total_input, grad_output, weight))

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()

    def run(self) -> None:
        """Compute and accumulate every queued weight gradient, in queue order; empties the queue."""
        items, self._items = self._items, []
        items.reverse()
        while items:
            x, g, weight = items.pop()
            accumulate_weight_grad(x, g, weight)
            del x, g  # each pair freed as soon as its gradient is in


def accumulate_weight_grad(x: torch.Tensor, g: torch.Tensor, weight: torch.Tensor, *, fused: bool = True) -> None:
    """Accumulate a deferred ``g^T @ x`` where the layer's own backward would have put it: into an fp32
    ``main_grad`` through ``ops.wgrad_accum`` (``fused``: megatron's gradient-accumulation fusion, which also
    marks the weight ``grad_added_to_main_grad``), into ``main_grad`` as a separate product (megatron DDP's
    hook adds ``param.grad`` so), or into ``weight.grad``. Also the W step of megatron's linear layers
    (patches/pipeline/wgrad.py)."""
    main_grad = getattr(weight, "main_grad", None)
    if main_grad is not None and fused:
        from hyper_adaptor.ops.wgrad_accum import wgrad_accum

        wgrad_accum(x, g, main_grad)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return
    dw = _weight_grad(x, g)
    if main_grad is not None:
        main_grad.add_(dw)
    elif weight.grad is None:
        weight.grad = dw
    else:
        weight.grad += dw


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _weight_grad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    # torch's mm_mat2_backward for the column-major mat2 = weight.t(): (dY^T @ X), already [out, in]
    return _flat(g).t().mm(_flat(x))


@contextlib.contextmanager
def defer_weight_grads(queue: WeightGradQueue):
    """Within this context, backward through a deferrable Linear queues its weight gradient in ``queue``."""
    _ACTIVE.append(queue)
    try:
        yield queue
    finally:
        _ACTIVE.remove(queue)


class _DeferrableLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        g2 = _flat(grad_output)
        dx = dw = db = None
        if need_x:
            dx = g2.mm(weight)
            dx = dx.view(*grad_output.shape[:-1], weight.shape[1]) if grad_output.dim() != 2 else dx
        if need_b and ctx.has_bias:
            db = g2.sum(0)
        if need_w:
            if _ACTIVE:
                _ACTIVE[-1].append(x.detach(), grad_output.detach(), weight)
            else:
                dw = _weight_grad(x, grad_output)
        return dx, dw, db


def deferrable_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose weight gradient a :func:`defer_weight_grads` context can defer."""
    if not torch.is_grad_enabled() or not weight.requires_grad:
        return F.linear(x, weight, bias)
    return _DeferrableLinear.apply(x, weight, bias)


def _linear_forward(self, x):
    return deferrable_linear(x, self.weight, self.bias)


def enable_weight_deferral(module: torch.nn.Module) -> int:
    """Route every ``nn.Linear`` under ``module`` through :func:`deferrable_linear` (an instance-level
    ``forward``; the class and other instances are untouched). Returns how many layers; idempotent."""
    count = 0
    for sub in module.modules():
        if type(sub) is torch.nn.Linear:  # subclasses may have forwards of their own: left alone
            if "forward" not in sub.__dict__:
                sub.forward = _linear_forward.__get__(sub)
            count += 1
    return count


def disable_weight_deferral(module: torch.nn.Module) -> None:
    for sub in module.modules():
        if type(sub) is torch.nn.Linear and sub.__dict__.get("forward") is not None \
                and getattr(sub.__dict__["forward"], "__func__", None) is _linear_forward:
            del sub.forward
