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

TARGET = "tests.distributed.test_te_spec_parity:train_runs"
EXACT = dict(loss_rtol=1e-6, grad_atol=1e-6, param_atol=1e-6)
_TE_TO_LOCAL = [
    (re.compile(r"self_attention\.linear_qkv\.layer_norm_(weight|bias)$"), r"input_layernorm.\1"),
    (re.compile(r"mlp\.linear_fc1\.layer_norm_(weight|bias)$"), r"pre_mlp_layernorm.\1"),
]


def _local_name(name: str) -> str:
    for pattern, local in _TE_TO_LOCAL:
        name = pattern.sub(local, name)
    return name


def _local_names(tensors: dict) -> dict:
    return {_local_name(name): value for name, value in tensors.items()}


# multi-latent attention (DeepSeek's MLA: low-rank q and kv, YaRN RoPE on a part of each head, key and
# value head sizes that differ) — small sizes, RMSNorm (MLATransformerConfig's default)
MLA = dict(config_class="MLATransformerConfig", spec={"multi_latent_attention": True},
           extra=dict(q_lora_rank=32, kv_lora_rank=32, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=12,
                      rotary_scaling_factor=4.0, original_max_position_embeddings=64))


class _LookedUpByTENames(dict):
    """A local-named full state that the TE-spec model's loader reads under its own names."""

    def __getitem__(self, name):
        return super().__getitem__(_local_name(name))


def train_both_specs(rank: int, world_size: int, tp: int, sequence_parallel: bool = False, mla: bool = False,
                     init_params: dict | None = None) -> dict:
    """Rank code: the local-spec GPT, then the TE-spec GPT, in one world (a world costs ~10 s)."""
    from tests.distributed import gpt_parity

    from megatron.core.models.gpt import gpt_layer_specs

    layout = dict(tp=tp, sequence_parallel=sequence_parallel, **(MLA if mla else {}))
    local = gpt_parity.train(rank, world_size, Layout(**layout), init_params)
    # gpt_parity builds its layers with gpt_layer_specs.get_gpt_layer_local_spec (looked up at build
    # time); pointing that name at the TE spec function builds the same GPT from the TE spec
    local_spec = gpt_layer_specs.get_gpt_layer_local_spec
    gpt_layer_specs.get_gpt_layer_local_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
    try:
        te = gpt_parity.train(rank, world_size, Layout(**layout),
                              None if init_params is None else _LookedUpByTENames(init_params))
    finally:
        gpt_layer_specs.get_gpt_layer_local_spec = local_spec
    if rank == 0:
        te["te_param_names"] = sorted(te["init"])
        te = dict(te, init=_local_names(te["init"]), grads=[_local_names(g) for g in te["grads"]],
                  params=[_local_names(p) for p in te["params"]])
    return {"local": local, "te": te}


def train_runs(rank: int, world_size: int, runs: dict) -> dict:
    """Several ``train_both_specs`` runs one after the other in one world (each world costs a start-up)."""
    return {name: train_both_specs(rank, world_size, **kwargs) for name, kwargs in runs.items()}



@pytest.fixture(scope="module")
def one_rank():
    return run_world(1, TARGET, timeout=600, runs={"TP1": dict(tp=1), "MLA-TP1": dict(tp=1, mla=True)})[0]


@pytest.fixture(scope="module")
def two_ranks(one_rank):
    # MLA at TP2 from the TP1 run's starting point (megatron draws TP-sharded weights differently at TP2)
    runs = {"TP2": dict(tp=2), "TP2+SP": dict(tp=2, sequence_parallel=True),
            "MLA-TP2": dict(tp=2, mla=True, init_params=one_rank["MLA-TP1"]["local"]["init"])}
    return run_world(2, TARGET, timeout=800, runs=runs)[0]


# TP2+SP: each rank normalises its own tokens, so the fused norm's gradients must be all-reduced over TP
# like the local norm's (its parameters carry megatron's sequence_parallel flag)
@pytest.mark.parametrize("name", ["TP1", "TP2", "TP2+SP"])
def test_te_spec_gpt_trains_like_the_local_spec_gpt(request, name):
    result = request.getfixturevalue("one_rank" if name == "TP1" else "two_ranks")[name]
    local, te = result["local"], result["te"]
    # the TE run really had TE's fused norm+linear parameters
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te["te_param_names"]
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in te["te_param_names"]
    assert set(te["init"]) == set(local["init"])
    assert compare(local, te, **EXACT) == []
    assert len(te["loss"]) == 3 and te["loss"][-1] < te["loss"][0]


def test_mla_gpt_trains_at_tp1_and_tp2_and_te_spec_matches_local(one_rank, two_ranks):
    """Multi-latent attention without TE: megatron's local spec (and so the TE spec's stand-in) could not
    build an MLA layer at all — its core attention refused MLA's key/value head sizes, and YaRN RoPE
    asked for an accelerator on CPU (patches/compat/megatron_core.py). Now: the TE-spec MLA GPT equals
    the local-spec MLA GPT (1e-6), and the TP2 run equals the TP1 run (losses and gradients of 3 steps,
    1e-5: TP splits the reductions)."""
    tp1, tp2 = one_rank["MLA-TP1"], two_ranks["MLA-TP2"]
    for result in (tp1, tp2):
        assert "decoder.layers.0.self_attention.linear_kv_down_proj.weight" in result["te"]["te_param_names"]
        assert compare(result["local"], result["te"], **EXACT) == []
    # parameters are not compared across TP sizes: MLA's kv_down_proj gradients are tiny (max ~6e-4),
    # and on elements near zero Adam turns the TP2 all-reduce's rounding (~1e-9) into a different
    # update sign (params differ by ~2 lr) — losses and gradients of every step are the check
    diffs = compare(tp1["local"], tp2["local"], loss_rtol=1e-5, grad_atol=1e-5)
    assert diffs == [], "\n".join(diffs[:40])
    assert len(tp2["local"]["loss"]) == 3 and tp2["local"]["loss"][-1] < tp2["local"]["loss"][0]
