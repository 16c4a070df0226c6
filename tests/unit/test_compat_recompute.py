"""Level-0 mends of megatron's recompute helpers (patches/compat/megatron_core.py), each shown needed."""

import pytest
import torch

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor.patches.compat import megatron_core
from hyper_adaptor.patches.compat.arguments import have_transformer_engine

MANAGER = adaptor_module.ADAPTOR.manager


def _bias_module():
    weight = torch.nn.Parameter(torch.randn(4, 4))
    bias = torch.nn.Parameter(torch.randn(4))

    def forward(x):  # megatron's skip_bias_add modules: (output, bias Parameter)
        return x @ weight, bias

    return forward, bias


def test_checkpoint_hands_a_returned_bias_parameter_back_untouched():
    from megatron.core import tensor_parallel

    forward, bias = _bias_module()
    for _ in range(3):
        x = torch.randn(2, 4, requires_grad=True)
        out, returned = tensor_parallel.checkpoint(forward, False, x)
        assert returned is bias and bias.grad_fn is None  # still a leaf: the step's graph is not kept
        (out + returned).sum().backward()
    assert torch.allclose(bias.grad, torch.full((4,), 6.0))  # 2 rows x 3 steps


def test_megatron_checkpoint_turns_the_bias_parameter_into_a_graph_node():
    original = MANAGER.original(megatron_core.CHECKPOINT)
    forward, bias = _bias_module()
    x = torch.randn(2, 4, requires_grad=True)
    _, returned = original(forward, False, x)
    assert returned.grad_fn is not None  # what made every later backward walk the old graphs


@pytest.mark.skipif(have_transformer_engine(), reason="the mend applies only without TransformerEngine")
def test_checkpoint_without_output_runs_without_te():
    from megatron.core.tensor_parallel.random import CheckpointWithoutOutput

    norm = torch.nn.LayerNorm(4)
    x = torch.randn(2, 4, requires_grad=True)
    ckpt = CheckpointWithoutOutput()
    out = ckpt.checkpoint(norm, x)
    y = (out * 2).sum()
    ckpt.discard_output_and_register_recompute(y)
    y.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
