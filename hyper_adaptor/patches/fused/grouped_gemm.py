"""Level 1 — ``--moe-grouped-gemm`` for megatron's local spec: the MoE experts' GEMMs as grouped GEMMs.

What megatron-core 0.19.2 does without TransformerEngine: the local spec's
``LocalSpecProvider.grouped_mlp_modules(moe_use_grouped_gemm)`` ignores its argument and always builds
``SequentialMLP`` (one ``MLP`` per local expert, run one after the other), so the flag changes
nothing in the model; megatron.training's ``validate_args`` meanwhile asserts a CUDA compute
capability >= 8 for it (the CPU platform reports (0, 0), so the flag is refused there).

The seam: a wrap of ``SequentialMLP.forward``. Once applied (the feature applies it when
``--moe-grouped-gemm`` is given at level >= 1; like every patch it is process-wide), the experts'
fc1 and fc2 run as two calls of :func:`hyper_adaptor.ops.grouped_gemm.grouped_gemm` over all local
tokens (sorted by expert, as the token dispatcher hands them over), with every expert's own
``linear_fc1.weight`` / ``linear_fc2.weight`` as that expert's group weight. Chosen over a new
experts module in the spec because the module, its parameters, their names
(``mlp.experts.local_experts.<i>.linear_fc{1,2}.weight``), ``state_dict`` and ``sharded_state_dict``
stay megatron's own: checkpoints are the same files with and without the flag, and either can be
loaded by the other (a grouped module would need a second checkpoint layout or a conversion).

The activation between the two GEMMs is megatron's own code: ``MLP.forward`` of expert 0 is called
once for all tokens with its ``linear_fc1`` / ``linear_fc2`` seen as the grouped GEMMs (a view
object; the module is not modified). So SwiGLU / GeLU, fused or not, the per-token routing
probabilities, clamps and TE activations are computed exactly as megatron computes them per expert;
expert biases become per-token rows of the right expert's bias (fc2's, scaled by the token's
probability, is added here, as megatron's MLP adds it).

Expert linears never communicate (the token dispatcher does: ``explicit_expert_comm``), so expert
tensor parallelism and expert parallelism need nothing here. With ``gradient_accumulation_fusion``
the weight gradients go into each weight's ``main_grad`` with fp32 accumulation
(``ops.wgrad_accum``), as megatron's linear layers do.

Megatron's own forward runs instead (one notice per reason) for: fp8 / fp4, ``moe_apply_probs_on_input``,
delayed weight-gradient computation, GTP weight rematerialisation, CPU offloading, Megatron-FSDP
parameters, and expert modules other than megatron's ``MLP`` with ``ColumnParallelLinear`` /
``RowParallelLinear``. With one local expert there is nothing to group and megatron's forward runs.
"""

from __future__ import annotations

import functools

import torch

from hyper_adaptor.ops.backend import notice
from hyper_adaptor.ops.grouped_gemm import grouped_gemm
from hyper_adaptor.patch_manager import Patch

FEATURE = "moe_grouped_gemm"
TARGET = "megatron.core.transformer.moe.experts.SequentialMLP.forward"


def _unsupported(module) -> str | None:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP

    config = module.config
    if config.fp8 or getattr(config, "fp4", None):
        return "fp8/fp4 experts"
    if config.moe_apply_probs_on_input:
        return "moe_apply_probs_on_input"
    if getattr(config, "delay_wgrad_compute", False):
        return "delay_wgrad_compute"
    if getattr(config, "gtp_weight_remat_size", 1) > 1:
        return "GTP weight rematerialisation"
    if getattr(config, "cpu_offloading", False):
        return "CPU offloading"
    for expert in module.local_experts:
        if type(expert) is not MLP:
            return f"expert module {type(expert).__name__}"
        fc1, fc2 = expert.linear_fc1, expert.linear_fc2
        if type(fc1) is not ColumnParallelLinear or type(fc2) is not RowParallelLinear:
            return f"expert linears {type(fc1).__name__} / {type(fc2).__name__}"
        if fc1.weight is None or fc2.weight is None:
            return "expert linears without their own weight"
        if hasattr(fc1.weight, "__fsdp_param__") or hasattr(fc2.weight, "__fsdp_param__"):
            return "Megatron-FSDP expert parameters"
    return None


def _main_grads(linears) -> list[torch.Tensor | None] | None:
    """Each weight's ``main_grad`` where megatron would accumulate into it (gradient accumulation
    fusion); marks those weights as megatron's linear does, so DDP does not add the zero grad."""
    buffers = []
    for linear in linears:
        weight = linear.weight
        use = linear.gradient_accumulation_fusion and hasattr(weight, "main_grad") and torch.is_grad_enabled()
        buffers.append(weight.main_grad if use else None)
        if use and hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
    return buffers if any(b is not None for b in buffers) else None


def _per_token(vectors, counts: torch.Tensor) -> torch.Tensor:
    """Row t is the vector of token t's expert."""
    return torch.repeat_interleave(torch.stack(vectors), counts, dim=0)


class _GroupedLinear(torch.nn.Module):
    """The experts' fc1 (or fc2) as one module over all tokens, called like megatron's linear:
    ``(output, bias)``. Holds the expert linears without registering them (no parameters here)."""

    def __init__(self, linears, counts: list[int], probs: torch.Tensor | None):
        super().__init__()
        self._linears, self._counts, self._probs = list(linears), counts, probs

    def forward(self, x):
        linears, counts = self._linears, self._counts
        out = grouped_gemm(x, [lin.weight for lin in linears], counts, main_grads=_main_grads(linears))
        if linears[0].bias is None:
            return out, None
        bias = _per_token([lin.bias for lin in linears], torch.tensor(counts, device=x.device))
        if self._probs is None:
            return out, bias  # fc1: added by megatron's activation code, as its own bias is
        # fc2: megatron's MLP adds an expert's bias scaled by each token's probability
        out += bias * self._probs.unsqueeze(-1)
        return out, None


class _ExpertsAsOneMLP:
    """What megatron's ``MLP.forward`` sees as ``self``: expert 0, but with the grouped linears."""

    def __init__(self, expert, fc1: _GroupedLinear, fc2: _GroupedLinear):
        self._expert, self.linear_fc1, self.linear_fc2 = expert, fc1, fc2

    def __getattr__(self, name):
        return getattr(self._expert, name)


def grouped_experts_forward(module, hidden, tokens_per_expert, probs):
    """SequentialMLP's result, computed with two grouped GEMMs (the module is megatron's, unchanged)."""
    counts = tokens_per_expert.tolist() if isinstance(tokens_per_expert, torch.Tensor) else list(tokens_per_expert)
    experts = module.local_experts
    fc1 = _GroupedLinear([e.linear_fc1 for e in experts], counts, None)
    fc2 = _GroupedLinear([e.linear_fc2 for e in experts], counts, probs)
    view = _ExpertsAsOneMLP(experts[0], fc1, fc2)
    output, _ = type(experts[0]).forward(view, hidden, probs)
    return output, None  # expert biases are already in the output, as in megatron's SequentialMLP


def _wrap_forward(original):
    @functools.wraps(original)
    def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
        if self.num_local_experts == 1:
            return original(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        reason = _unsupported(self)
        if reason is not None:
            notice(FEATURE, "hyper_adaptor", reason, "megatron's SequentialMLP")
            return original(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        return grouped_experts_forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs)

    return forward


def patches(args) -> list[Patch]:
    return [Patch(TARGET, _wrap_forward, "wrap", FEATURE)]
