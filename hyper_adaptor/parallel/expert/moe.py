"""A plain-torch mixture-of-experts block: router, routed experts, optional shared expert.

Single-process by default; ``ExpertParallel`` / ``ExpertTensorParallel`` (style.py) shard it in place,
or it is built sharded from the start by passing ``ep_group`` (and ``etp_group``): then only the local
experts (and their ffn shard) are ever allocated, which is what a model too big for one rank needs
(their initial values then come from each rank's own RNG, not from slicing one full initialisation).
Both cases run the same code: the block always goes through an ``AllToAllDispatcher`` — without a
process group it exchanges nothing — so the single-process block is the exact reference of the
sharded one (same permutation, same capacity decisions, same sums in the same order per token).

Routing: ``softmax`` scores then top-k (megatron's default; the chosen probabilities are not
renormalised unless ``normalize_topk``), or ``sigmoid`` scores then top-k, renormalised by default (the
DeepSeek-V3 choice: sigmoid scores do not sum to one). The auxiliary load-balancing loss (the Switch
Transformer form, ``coeff * E * sum_e f_e * P_e``, f_e the fraction of routed copies and P_e the mean
score of expert e) is computed from this call's tokens when ``aux_loss_coeff > 0``; it is stored on
``self.aux_loss`` and returned by ``forward(x, return_aux_loss=True)``. Under expert parallel each rank
computes it from its own tokens (a per-micro-batch loss, as megatron's default ``aux_loss`` is).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from hyper_adaptor.parallel.expert._dispatcher import AllToAllDispatcher
from hyper_adaptor.parallel.expert._experts import FeedForward, GroupedExperts

SCORE_FUNCTIONS = ("softmax", "sigmoid")


class MoE(nn.Module):
    """``MoE(hidden, ffn, num_experts, topk, shared_ffn=None, activation="swiglu", ...)``.

    ``forward(x [..., hidden])`` returns the same shape: the routed experts' outputs weighted by their
    router probabilities, plus the shared expert's output when ``shared_ffn`` is given. Capacity
    options (``capacity_factor``, ``pad_to_capacity``, ``drop_policy``) go to the dispatcher.

    Submodules: ``router`` (``nn.Linear(hidden, num_experts)``, no bias), ``experts``
    (``GroupedExperts``), ``shared_expert`` (``FeedForward`` or None), and the attribute
    ``dispatcher``, which the styles replace with one bound to their process groups.
    ``ep_group`` / ``etp_group`` / ``placement``: build the block already sharded (see the module doc).
    """

    def __init__(self, hidden: int, ffn: int, num_experts: int, topk: int, shared_ffn: int | None = None,
                 activation: str = "swiglu", *, score_function: str = "softmax", normalize_topk: bool | None = None,
                 aux_loss_coeff: float = 0.0, capacity_factor: float | None = None, pad_to_capacity: bool = False,
                 drop_policy: str = "probs", ep_group=None, etp_group=None, placement: list[int] | None = None,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk must be in 1..num_experts={num_experts}, got {topk}")
        if aux_loss_coeff < 0:
            raise ValueError(f"aux_loss_coeff must be >= 0, got {aux_loss_coeff}")
        self.hidden, self.num_experts, self.topk = hidden, num_experts, topk
        self.score_function = score_function
        self.normalize_topk = (score_function == "sigmoid") if normalize_topk is None else normalize_topk
        self.aux_loss_coeff = aux_loss_coeff
        self.dispatcher = AllToAllDispatcher(num_experts, ep_group, etp_group=etp_group,
                                             capacity_factor=capacity_factor, pad_to_capacity=pad_to_capacity,
                                             drop_policy=drop_policy, topk=topk, placement=placement)
        shards = 1 if etp_group is None else dist.get_world_size(etp_group)
        if ffn % shards:
            raise ValueError(f"MoE: ffn={ffn} does not divide over the expert tensor parallel group of {shards}")
        factory = dict(dtype=dtype, device=device)
        self.router = nn.Linear(hidden, num_experts, bias=False, **factory)
        self.experts = GroupedExperts(self.dispatcher.local_experts, hidden, ffn // shards, activation, **factory)
        self.experts.first_expert = self.dispatcher.first_expert
        self.shared_expert = FeedForward(hidden, shared_ffn, activation, **factory) if shared_ffn else None
        self.aux_loss: torch.Tensor | None = None

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """tokens [T, H] -> (routing_map [T, E] bool, probs [T, E] zero off the map, scores [T, E])."""
        logits = self.router(tokens)
        scores = logits.softmax(dim=-1) if self.score_function == "softmax" else logits.sigmoid()
        top, chosen = scores.topk(self.topk, dim=-1)
        if self.normalize_topk:
            top = top / top.sum(dim=-1, keepdim=True)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True)
        probs = torch.zeros_like(scores).scatter(-1, chosen, top)
        return routing_map, probs, scores

    def load_balancing_loss(self, routing_map: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.score_function == "sigmoid":
            scores = scores / scores.sum(dim=-1, keepdim=True)
        tokens = max(routing_map.shape[0], 1)
        fraction = routing_map.sum(dim=0).to(scores.dtype) / (tokens * self.topk)
        return self.aux_loss_coeff * self.num_experts * (fraction * scores.mean(dim=0)).sum()

    def forward(self, x: torch.Tensor, return_aux_loss: bool = False):
        if x.shape[-1] != self.hidden:
            raise ValueError(f"MoE: input's last dimension is {x.shape[-1]}, expected hidden={self.hidden}")
        tokens = x.reshape(-1, self.hidden)
        routing_map, probs, scores = self.route(tokens)
        self.aux_loss = self.load_balancing_loss(routing_map, scores) if self.aux_loss_coeff > 0 else None
        expert_in, tokens_per_expert = self.dispatcher.dispatch(tokens, routing_map, probs)
        out = self.dispatcher.combine(self.experts(expert_in, tokens_per_expert))
        if self.shared_expert is not None:
            out = out + self.shared_expert(tokens)
        out = out.view(x.shape)
        if return_aux_loss:
            return out, self.aux_loss
        return out
