"""Split a model's parameters between Muon (hidden matrices) and AdamW (everything else)."""

from __future__ import annotations

import torch
from torch import nn

from .chained import ChainedOptimizer
from .muon import Muon

# Substrings of a parameter's name that mark it as an embedding or output projection (AdamW).
EMBEDDING_NAME_HINTS = ("embed", "output_layer", "lm_head", "wte", "wpe")
QKV_NAME_HINTS = ("qkv",)


def _embedding_param_ids(model: nn.Module) -> set[int]:
    return {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}


def split_params(model: nn.Module, muon_filter=None, exclude=None):
    """``(muon, adamw)`` lists of ``(name, parameter)`` of the trainable parameters, each parameter once.

    Muon gets 2-D parameters that are not embeddings or the output layer. An embedding is a parameter of an
    ``nn.Embedding`` or one whose name contains any of ``EMBEDDING_NAME_HINTS`` ("embed", "output_layer",
    "lm_head", "wte", "wpe"); norms and biases are 1-D so they go to AdamW by shape. ``exclude(name, p)``
    returning True sends a parameter to AdamW; ``muon_filter(name, p)``, when given, replaces the default rule
    (its choice is still refused for non-2-D parameters by Muon).
    """
    embedding_ids = _embedding_param_ids(model)
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if exclude is not None and exclude(name, p):
            adamw.append((name, p))
            continue
        if muon_filter is not None:
            use_muon = bool(muon_filter(name, p))
        else:
            lowered = name.lower()
            use_muon = (p.dim() == 2 and id(p) not in embedding_ids
                        and not any(hint in lowered for hint in EMBEDDING_NAME_HINTS))
        (muon if use_muon else adamw).append((name, p))
    return muon, adamw


def get_hyper_optimizer(model: nn.Module, muon_params=None, adamw_params=None, muon_kwargs=None, adamw_kwargs=None,
                        *, lr: float | None = None, weight_decay: float = 0.0, muon_lr: float | None = None,
                        optimizer: str = "muon", momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                        adjust_lr: str = "original", betas=(0.9, 0.999), adam_eps: float = 1e-8,
                        num_heads: int | None = None, num_query_groups: int | None = None,
                        muon_filter=None, exclude=None):
    """Optimizer for ``model``: Muon on hidden matrices, AdamW on the rest (see ``split_params``).

    ``optimizer="adamw"`` puts every parameter on AdamW. ``muon_lr`` defaults to ``lr``. When ``num_heads`` is
    given, a 2-D Muon parameter whose name contains "qkv" (``linear_qkv``, ``qkv_proj``) is a fused Q/K/V
    weight: its rows are split into ``num_heads + 2 * num_query_groups`` equal blocks (``num_query_groups``
    defaults to ``num_heads``), one per Q, K or V head of ``head_dim`` rows, and each block is orthogonalised
    as its own matrix. The order of the blocks (Q heads then K then V, or megatron's per-group interleave)
    does not matter, only that each head's rows are contiguous.

    AdamW decays ``weight_decay`` on its 2-D and larger parameters and not on 1-D ones (norms, biases).

    HyperParallel's form, ``get_hyper_optimizer(model, muon_params, adamw_params, muon_kwargs, adamw_kwargs)``:
    the two parameter lists (parameters, or names in ``model.named_parameters()``) given, ``Muon(muon_params,
    **muon_kwargs)`` and ``AdamW(adamw_params, **adamw_kwargs)`` with their own defaults.

    Returns a ``ChainedOptimizer(Muon, AdamW)``; when one side has no parameters, the other optimizer alone.
    """
    if muon_params is not None or adamw_params is not None:
        return _from_lists(model, muon_params, adamw_params, muon_kwargs, adamw_kwargs)
    if lr is None:
        raise TypeError("get_hyper_optimizer: give muon_params / adamw_params (HyperParallel's form) or lr=")
    if optimizer not in ("muon", "adamw"):
        raise ValueError(f"optimizer must be 'muon' or 'adamw', got {optimizer!r}")
    if num_query_groups is not None and num_heads is None:
        raise ValueError("num_query_groups needs num_heads")
    if optimizer == "adamw":
        muon_named, adam_named = [], [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    else:
        muon_named, adam_named = split_params(model, muon_filter=muon_filter, exclude=exclude)
    if not muon_named and not adam_named:
        raise ValueError("get_hyper_optimizer: the model has no trainable parameters")

    optimizers = []
    if muon_named:
        plain, fused = [], []
        for n, p in muon_named:
            is_qkv = bool(num_heads) and any(h in n.lower() for h in QKV_NAME_HINTS)
            (fused if is_qkv else plain).append(p)
        groups = []
        if plain:
            groups.append({"params": plain})
        if fused:
            groups.append({"params": fused, "row_blocks": num_heads + 2 * (num_query_groups or num_heads)})
        optimizers.append(Muon(groups, lr=lr if muon_lr is None else muon_lr, momentum=momentum, nesterov=nesterov,
                               weight_decay=weight_decay, ns_steps=ns_steps, adjust_lr=adjust_lr))
    if adam_named:
        # Norms and biases (1-D) are not decayed, as in megatron's default grouping.
        decayed = [p for _, p in adam_named if p.dim() >= 2]
        undecayed = [p for _, p in adam_named if p.dim() < 2]
        groups = [g for g in ({"params": decayed}, {"params": undecayed, "weight_decay": 0.0}) if g["params"]]
        optimizers.append(torch.optim.AdamW(groups, lr=lr, betas=betas, eps=adam_eps, weight_decay=weight_decay))
    return optimizers[0] if len(optimizers) == 1 else ChainedOptimizer(optimizers)


def _from_lists(model, muon_params, adamw_params, muon_kwargs, adamw_kwargs):
    named = dict(model.named_parameters())

    def resolve(params, what):
        out = []
        for p in params or ():
            if isinstance(p, str):
                if p not in named:
                    raise ValueError(f"get_hyper_optimizer: {what} names {p!r}, not a parameter of the model")
                p = named[p]
            out.append(p)
        return out

    muon, adamw = resolve(muon_params, "muon_params"), resolve(adamw_params, "adamw_params")
    if not muon and not adamw:
        raise ValueError("get_hyper_optimizer: muon_params and adamw_params are both empty")
    optimizers = {}
    if muon:
        optimizers["muon"] = Muon(muon, **(muon_kwargs or {}))
    if adamw:
        optimizers["adamw"] = torch.optim.AdamW(adamw, **(adamw_kwargs or {}))
    return ChainedOptimizer(model, optimizers)
