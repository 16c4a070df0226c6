"""One optimizer interface over several optimizers (Muon for matrices, AdamW for the rest)."""

from __future__ import annotations

import torch


class ChainedOptimizer:
    """``step`` / ``zero_grad`` / ``state_dict`` / ``load_state_dict`` / ``param_groups`` over ``optimizers``.

    ``param_groups`` is the concatenation of the members' groups (the same dict objects), so an LR scheduler
    that writes ``group["lr"]`` reaches every member.
    """

    def __init__(self, model, optimizers=None, flatten: bool = False):
        # HyperParallel's form is (model, {name: optimizer}); this package's earlier one is (optimizers,), a
        # list, with no model. Both are served: a first argument that is not a Module is the list.
        if optimizers is None and not isinstance(model, torch.nn.Module):
            model, optimizers = None, model
        if flatten:
            raise ValueError("ChainedOptimizer: flatten=True (one flat buffer for all parameters) is not served; "
                             "HSDP (hyper_adaptor.parallel.hsdp) already keeps the parameters in flat buckets")
        self.model = model
        if isinstance(optimizers, dict):
            self.named_optimizers = dict(optimizers)
        else:
            self.named_optimizers = {str(i): opt for i, opt in enumerate(optimizers or ())}
        self.optimizers = list(self.named_optimizers.values())
        if not self.optimizers:
            raise ValueError("ChainedOptimizer needs at least one optimizer")
        for opt in self.optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"ChainedOptimizer takes torch.optim.Optimizer instances, got {type(opt).__name__}")
        # LambdaLR stores initial_lr in the groups and reads .defaults nowhere, but some tools read it.
        self.defaults = {}

    def __iter__(self):
        return iter(self.optimizers)

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
