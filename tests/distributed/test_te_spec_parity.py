"""The TE layer spec without TE trains like the local spec: a GPT built from
``get_gpt_layer_with_transformer_engine_spec()`` (served by patches/compat/te_spec.py on a process without
TransformerEngine) against the same GPT from ``get_gpt_layer_local_spec()``, same seed, 3 Adam steps on
CPU/gloo, TP1, TP2 and TP2 with sequence parallel: losses, gradients and parameters equal to 1e-6.

The two specs name the norms differently (TE fuses them into the following linear), so the TE run's
names are mapped to the local ones before comparing: ``...linear_qkv.layer_norm_weight`` is the local
``...input_layernorm.weight``, ``mlp.linear_fc1.layer_norm_*`` the local ``pre_mlp_layernorm.*``.
"""

import re

import pytest

from hyper_adaptor.testing import run_world
from tests.distributed.gpt_parity import Layout, compare

pytestmark = pytest.mark.distributed

TARGET = "tests.distributed.test_te_spec_parity:train_both_specs"
EXACT = dict(loss_rtol=1e-6, grad_atol=1e-6, param_atol=1e-6)
_TE_TO_LOCAL = [
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r"input_layernorm.\1"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"pre_mlp_layernorm.\1"),
]


def _local_names(tensors: dict) -> dict:
    out = {}
    for name, value in tensors.items():
        for pattern, local in _TE_TO_LOCAL:
            name = pattern.sub(local, name)
        out[name] = value
    return out


def train_both_specs(rank: int, world_size: int, tp: int, sequence_parallel: bool = False) -> dict:
    """Rank code: the local-spec GPT, then the TE-spec GPT, in one world (a world costs ~10 s)."""
    from megatron.core.models.gpt import gpt_layer_specs
    from tests.distributed import gpt_parity

    local = gpt_parity.train(rank, world_size, Layout(tp=tp, sequence_parallel=sequence_parallel))
    # gpt_parity builds its layers with gpt_layer_specs.get_gpt_layer_local_spec (looked up at build
    # time); pointing that name at the TE spec function builds the same GPT from the TE spec
    local_spec = gpt_layer_specs.get_gpt_layer_local_spec
    gpt_layer_specs.get_gpt_layer_local_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    try:
        te = gpt_parity.train(rank, world_size, Layout(tp=tp, sequence_parallel=sequence_parallel))
    finally:
        gpt_layer_specs.get_gpt_layer_local_spec = local_spec
    if rank == 0:
        te["te_param_names"] = sorted(te["init"])
        te = dict(te, init=_local_names(te["init"]), grads=[_local_names(g) for g in te["grads"]],
                  params=[_local_names(p) for p in te["params"]])
    return {"local": local, "te": te}


# TP2+SP: each rank normalises its own tokens, so the fused norm's gradients must be all-reduced over TP
# like the local norm's (its parameters carry megatron's sequence_parallel flag)
@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)], ids=["TP1", "TP2", "TP2+SP"])
def test_te_spec_gpt_trains_like_the_local_spec_gpt(tp, sequence_parallel):
    result = run_world(tp, TARGET, timeout=400, tp=tp, sequence_parallel=sequence_parallel)[0]
    local, te = result["local"], result["te"]
    # the TE run really had TE's fused norm+linear parameters
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te["te_param_names"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te["te_param_names"]
    assert set(te["init"]) == set(local["init"])
    assert compare(local, te, **EXACT) == []
    assert len(te["loss"]) == 3 and te["loss"][-1] < te["loss"][0]
