"""Learning-rate multipliers (warmup, then constant / linear / cosine / WSD) on torch's ``LambdaLR``.

Only the multiplier functions are ours; stepping, state_dict and ``get_last_lr`` are torch's. Step ``s`` is
the number of scheduler steps taken, as in megatron's ``OptimizerParamScheduler``, and the WSD values equal
megatron's for the same settings (``1-sqrt`` is megatron's ``minus_sqrt``).
"""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR

from .chained import ChainedOptimizer

STYLES = ("constant", "linear", "cosine", "wsd")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "1-sqrt")


def _decay_coeff(style: str, ratio: float) -> float:
    if style == "linear":
        return 1.0 - ratio
    if style == "cosine":
        return 0.5 * (math.cos(math.pi * ratio) + 1.0)
    if style == "exponential":
        # Halves at mid-decay and reaches exactly 0 at the end (2 * 0.5**1 - 1).
        return 2.0 * 0.5 ** ratio - 1.0
    if style == "1-sqrt":
        return 1.0 - math.sqrt(ratio)
    raise ValueError(style)


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, style: str = "constant",
                  min_lr_ratio: float = 0.0, wsd_decay_steps: int | None = None,
                  wsd_decay_style: str = "linear") -> float:
    """Multiplier of the peak lr at ``step``.

    - warmup: ``step / warmup_steps`` while ``step <= warmup_steps`` (0 at step 0, 1 at the end of warmup);
    - constant: 1 afterwards;
    - past ``total_steps``: ``min_lr_ratio``;
    - linear / cosine: ``min_lr_ratio + (1 - min_lr_ratio) * coeff(r)``, ``r`` = steps since warmup over
      ``total_steps - warmup_steps``;
    - wsd: 1 until ``total_steps - wsd_decay_steps``, then ``coeff`` of the fraction of the decay steps taken,
      with ``wsd_decay_style`` linear ``1-r``, cosine ``(1+cos(pi r))/2``, exponential ``2*0.5**r - 1`` or
      1-sqrt ``1-sqrt(r)``.
    """
    if warmup_steps > 0 and step <= warmup_steps:
        return step / warmup_steps
    if style == "constant":
        return 1.0
    if step > total_steps:
        return min_lr_ratio
    if style == "wsd":
        anneal_start = total_steps - wsd_decay_steps
        coeff = 1.0 if step <= anneal_start else _decay_coeff(wsd_decay_style, (step - anneal_start) / wsd_decay_steps)
    else:
        coeff = _decay_coeff(style, (step - warmup_steps) / (total_steps - warmup_steps))
    return min_lr_ratio + coeff * (1.0 - min_lr_ratio)


def _check(warmup_steps, total_steps, style, min_lr_ratio, wsd_decay_steps, wsd_decay_style):
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    if not (isinstance(warmup_steps, int) and warmup_steps >= 0):
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if not (isinstance(total_steps, int) and total_steps > warmup_steps):
        raise ValueError(f"total_steps must be an int > warmup_steps={warmup_steps}, got {total_steps!r}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if style == "wsd":
        if wsd_decay_style not in WSD_DECAY_STYLES:
            raise ValueError(f"wsd_decay_style must be one of {WSD_DECAY_STYLES}, got {wsd_decay_style!r}")
        if not (isinstance(wsd_decay_steps, int) and 0 < wsd_decay_steps <= total_steps - warmup_steps):
            raise ValueError(f"wsd_decay_steps must be an int in (0, total_steps - warmup_steps = "
                             f"{total_steps - warmup_steps}], got {wsd_decay_steps!r}")


class ChainedLR:
    """One ``LambdaLR`` per member of a ``ChainedOptimizer``, stepped together (``LambdaLR`` takes only a
    ``torch.optim.Optimizer``)."""

    def __init__(self, schedulers):
        self.schedulers = list(schedulers)

    def step(self):
        for s in self.schedulers:
            s.step()

    def get_last_lr(self):
        return [lr for s in self.schedulers for lr in s.get_last_lr()]

    @property
    def last_epoch(self):
        return self.schedulers[0].last_epoch

    def state_dict(self):
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state_dict):
        for s, sd in zip(self.schedulers, state_dict["schedulers"], strict=True):
            s.load_state_dict(sd)


def get_hyper_lr_scheduler(optimizer, warmup_steps: int, total_steps: int, style: str = "constant",
                           min_lr_ratio: float = 0.0, wsd_decay_steps: int | None = None,
                           wsd_decay_style: str = "linear"):
    """``LambdaLR`` with ``lr_multiplier`` (see there for the curves) on every group of ``optimizer``.

    The peak lr of each group is its lr when the scheduler is built (Muon's and AdamW's may differ). For a
    ``ChainedOptimizer`` returns a ``ChainedLR`` (step / get_last_lr / state_dict / load_state_dict).
    """
    _check(warmup_steps, total_steps, style, min_lr_ratio, wsd_decay_steps, wsd_decay_style)

    def fn(step):
        return lr_multiplier(step, warmup_steps, total_steps, style, min_lr_ratio, wsd_decay_steps, wsd_decay_style)

    if isinstance(optimizer, ChainedOptimizer):
        return ChainedLR(LambdaLR(opt, fn) for opt in optimizer.optimizers)
    return LambdaLR(optimizer, fn)
