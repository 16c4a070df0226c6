"""One optimizer interface over several optimizers (Muon for matrices, AdamW for the rest)."""

from __future__ import annotations

import torch


class ChainedOptimizer:
    """``step`` / ``zero_grad`` / ``state_dict`` / ``load_state_dict`` / ``param_groups`` over ``optimizers``.

    ``param_groups`` is the concatenation of the members' groups (the same dict objects), so an LR scheduler
    that writes ``group["lr"]`` reaches every member.
    """

    def __init__(self, optimizers):
        self.optimizers = list(optimizers)
        if not self.optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        for opt in self.optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"ChainedOptimizer takes torch.optim.Optimizer instances, got {type(opt).__name__}")
        # LambdaLR stores initial_lr in the groups and reads .defaults nowhere, but some tools read it.
        self.defaults = {}

    @property
    def param_groups(self):
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self):
        merged = {}
        for opt in self.optimizers:
            merged.update(opt.state)
        return merged

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if saved is None or len(saved) != len(self.optimizers):
            got = "no 'optimizers' list" if saved is None else f"{len(saved)} optimizers"
            raise ValueError(f"ChainedOptimizer.load_state_dict: expected {len(self.optimizers)} optimizers, got {got}")
        for opt, sd in zip(self.optimizers, saved):
            opt.load_state_dict(sd)

    def __repr__(self):
        inner = ", ".join(type(opt).__name__ for opt in self.optimizers)
        return f"ChainedOptimizer({inner})"
