"""Muon: momentum, then an orthogonalised update for 2-D hidden matrices.

Single process. ``newton_schulz`` is public so a distributed owner rank can call it on a gathered matrix.
"""

from __future__ import annotations

import math

import torch

# Quintic Newton-Schulz coefficients tuned so five steps push every singular value into roughly [0.7, 1.2];
# exact orthogonality is not needed for the update, speed is.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_CHOICES = ("original", "match_rms_adamw")


def newton_schulz(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS) -> torch.Tensor:
    """Approximate ``U V^T`` of ``grad = U S V^T`` with ``steps`` quintic Newton-Schulz iterations.

    Runs in float32 whatever the input dtype and returns the input's dtype.
    """
    if grad.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(grad.shape)}")
    a, b, c = coefficients
    x = grad.float()
    # Iterate on the wide orientation so the Gram matrix is the small one.
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    # Frobenius norm bounds the spectral norm, so after this every singular value is <= 1 and the
    # iteration converges.
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        poly = b * gram + c * (gram @ gram)
        x = a * x + poly @ x
    if tall:
        x = x.T
    return x.to(grad.dtype)


def adjusted_lr(lr: float, shape: tuple[int, int], mode: str) -> float:
    """Learning rate for a matrix of ``shape`` (A rows, B columns) under ``mode``."""
    rows, cols = shape
    if mode == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if mode == "match_rms_adamw":
        # An orthogonal A x B matrix has RMS 1/sqrt(max(A, B)); 0.2 is AdamW's typical update RMS.
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr must be one of {ADJUST_LR_CHOICES}, got {mode!r}")


def orthogonalise_blocks(update: torch.Tensor, row_blocks: int, steps: int, eps: float) -> torch.Tensor:
    """Orthogonalise each of ``row_blocks`` equal row blocks of ``update`` on its own (fused Q/K/V)."""
    if row_blocks == 1:
        return newton_schulz(update, steps, eps)
    rows = update.shape[0]
    if rows % row_blocks:
        raise ValueError(
            f"row_blocks={row_blocks} does not divide the {rows} rows of a matrix of shape {tuple(update.shape)}")
    return torch.cat([newton_schulz(block, steps, eps) for block in update.chunk(row_blocks, dim=0)], dim=0)


class Muon(torch.optim.Optimizer):
    """Momentum + Newton-Schulz orthogonalised update, for 2-D parameters only.

    Per step, with gradient ``g`` and momentum buffer ``B`` (zero at first)::

        B = momentum * B + g
        u = g + momentum * B          if nesterov else B
        O = newton_schulz(u, ns_steps) (per row block when the group sets ``row_blocks``)
        p = p * (1 - lr * weight_decay)
        p = p - adjusted_lr(lr, block shape, adjust_lr) * O

    ``adjust_lr``: ``"original"`` scales lr by ``sqrt(max(1, A/B))``; ``"match_rms_adamw"`` by
    ``0.2 * sqrt(max(A, B))`` so AdamW's lr and weight decay carry over. A group may set ``row_blocks`` (int):
    the matrix's rows are split into that many equal blocks, each orthogonalised and lr-adjusted as its own
    matrix (a fused QKV weight, one block per head).
    """

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.0, ns_steps: int = 5, adjust_lr: str = "original", eps: float = 1e-7):
        if not lr >= 0.0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"Muon: momentum must be in [0, 1), got {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if not (isinstance(ns_steps, int) and ns_steps >= 1):
            raise ValueError(f"Muon: ns_steps must be a positive int, got {ns_steps!r}")
        if adjust_lr not in ADJUST_LR_CHOICES:
            raise ValueError(f"Muon: adjust_lr must be one of {ADJUST_LR_CHOICES}, got {adjust_lr!r}")
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, adjust_lr=adjust_lr, eps=eps, row_blocks=1)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(
                        f"Muon only takes 2-D matrices; got a parameter of shape {tuple(p.shape)} "
                        "(give embeddings, norms, biases and other non-2-D parameters to AdamW)")
                if p.shape[0] % group["row_blocks"]:
                    raise ValueError(f"Muon: row_blocks={group['row_blocks']} does not divide the rows of a "
                                     f"parameter of shape {tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            blocks = group["row_blocks"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.mul_(mu).add_(g)
                update = g.add(buf, alpha=mu) if group["nesterov"] else buf
                ortho = orthogonalise_blocks(update, blocks, group["ns_steps"], group["eps"])
                block_shape = (p.shape[0] // blocks, p.shape[1])
                p.mul_(1.0 - lr * wd)
                p.add_(ortho, alpha=-adjusted_lr(lr, block_shape, group["adjust_lr"]))
        return loss
