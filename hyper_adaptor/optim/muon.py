"""Muon: momentum, then an orthogonalised update for 2-D hidden matrices.

Single process. ``newton_schulz`` is public so a distributed owner rank can call it on a gathered matrix.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# Quintic Newton-Schulz coefficients tuned so five steps push every singular value into roughly [0.7, 1.2];
# exact orthogonality is not needed for the update, speed is.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
ADJUST_LR_CHOICES = ("original", "match_rms_adamw")

# Named coefficient schedules, as megatron's --muon-coefficient-type names them (published values: Keller
# Jordan's single triple; the per-step quintic of modded-nanogpt; Polar Express, arXiv 2505.16932, its
# 1.01 safety factor folded in; CANS, arXiv 2506.10935; AOL; DeepSeek-V4's two-phase schedule). "cycle"
# schedules repeat from the start when there are more steps than triples, "last" ones repeat their
# last triple.
COEFFICIENT_SETS = {
    "simple": ("cycle", ((3.4445, -4.7750, 2.0315),)),
    "quintic": ("cycle", ((4.0848, -6.8946, 2.9270), (3.9505, -6.3029, 2.6377), (3.7418, -5.5913, 2.3037),
                          (2.8769, -3.1427, 1.2046), (2.8366, -3.0525, 1.2012))),
    "polar_express": ("last", ((8.2051, -22.9019, 16.4607), (4.0664, -2.8612, 0.5184), (3.9096, -2.8234, 0.5250),
                               (3.2856, -2.4153, 0.4853), (2.2779, -1.6198, 0.3985), (1.8726, -1.2307, 0.3585),
                               (1.8564, -1.2132, 0.3568), (1.8750, -1.2500, 0.3750))),
    "cans": ("last", ((8.4703, -25.1081, 18.6293), (4.1828, -3.1087, 0.5806), (3.9619, -2.9541, 0.5630),
                      (3.2866, -2.4647, 0.5074), (2.2737, -1.6447, 0.4162))),
    "aol": ("cycle", ((4.0098, -7.0585, 2.4635), (3.4585, -5.5479, 2.5959), (2.7573, -3.2939, 1.4254),
                      (2.7215, -3.0494, 1.3169))),
    "deepseekv4": ("last", ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2),
}


def coefficient_schedule(coefficients, steps: int) -> list[tuple[float, float, float]]:
    """The ``steps`` (a, b, c) triples: ``coefficients`` is one triple or a name of ``COEFFICIENT_SETS``."""
    if isinstance(coefficients, str):
        if coefficients not in COEFFICIENT_SETS:
            raise ValueError(f"unknown Newton-Schulz coefficient type {coefficients!r}; "
                             f"known: {', '.join(COEFFICIENT_SETS)}")
        mode, triples = COEFFICIENT_SETS[coefficients]
        if mode == "cycle":
            return [triples[i % len(triples)] for i in range(steps)]
        return [triples[min(i, len(triples) - 1)] for i in range(steps)]
    return [tuple(coefficients)] * steps


def newton_schulz(grad: torch.Tensor, steps: int = 5, eps: float = 1e-7, coefficients=NS_COEFFICIENTS,
                  low_precision: bool = False, transpose: bool | None = None, group=None) -> torch.Tensor:
    """Approximate ``U V^T`` of ``grad = U S V^T`` with ``steps`` quintic Newton-Schulz iterations.

    ``coefficients``: one (a, b, c) triple or a name of ``COEFFICIENT_SETS``. Normalises and returns in
    float32 whatever the input dtype, then casts back to it; ``low_precision`` runs the iterations in
    bfloat16 (megatron's ``--muon-fp32-matmul-prec medium``). ``transpose`` (default: when rows >
    columns) iterates on the transposed matrix, so that the Gram matrix is the small one.

    ``group``: ``grad`` is this rank's shard of a matrix split along the dimension the Gram matrix
    contracts over (columns after the transpose): the norm and every Gram matrix are summed over
    ``group`` and each rank iterates on its shard (tensor parallel ``distributed`` mode).
    """
    if grad.dim() != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(grad.shape)}")
    schedule = coefficient_schedule(coefficients, steps)
    x = grad.float()
    if transpose is None:
        transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    # Frobenius norm bounds the spectral norm, so after this every singular value is <= 1 and the
    # iteration converges.
    if group is None:
        norm = torch.linalg.vector_norm(x)
    else:
        sq = (x * x).sum()
        dist.all_reduce(sq, group=group)
        norm = sq.sqrt()
    x = x / norm.clamp(min=eps)
    if low_precision:
        x = x.to(torch.bfloat16)
    for a, b, c in schedule:
        gram = x @ x.T
        if group is not None:
            dist.all_reduce(gram, group=group)
        # b G + c G^2, then a X + (b G + c G^2) X, each as one addmm: in bfloat16 every product is
        # rounded once, as in megatron's iteration (measured: separate products drift ~1e-5 in 4 steps)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a, alpha=1.0)
    x = x.float()
    if transpose:
        x = x.T
    return x.to(grad.dtype)


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """megatron's ``--muon-scale-mode`` factor for an update of ``rows`` x ``cols``."""
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    if mode == "unit_rms_norm":
        return math.sqrt(rows / cols)
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    raise ValueError(f"muon scale mode must be one of {SCALE_MODES}, got {mode!r}")


SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")


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


def run_closure(closure):
    """torch's optimizer contract: re-evaluate the loss with gradients on when a closure is given."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


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
    matrix (a fused QKV weight, one block per head). Defaults (``lr=0.02``, ``weight_decay=0.1``) are
    HyperParallel's.
    """

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.1, ns_steps: int = 5, adjust_lr: str = "original", eps: float = 1e-7):
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
        loss = run_closure(closure)
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
