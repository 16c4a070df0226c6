"""The TE layer spec without TransformerEngine (patches/compat/te_spec.py), one process, TP1.

megatron-core's own unit-test style: a config, ``get_gpt_layer_with_transformer_engine_spec()``, a layer.
Each fix is shown needed (megatron's original fails without TE) and working. Training parity with the
local spec at TP1 / TP2 is tests/distributed/test_te_spec_parity.py.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import notice
from hyper_adaptor.patches.compat import te_spec

pytestmark = pytest.mark.skipif(te_spec.te_installed(), reason="served only where TE is not installed")
MANAGER = adaptor_module.ADAPTOR.manager

# The sharded_state_dict keys of one GPT layer built from TE's modules, read from
# megatron/core/extensions/transformer_engine.py: TELayerNormColumnParallelLinear (te LayerNormLinear:
# layer_norm_weight, layer_norm_bias with LayerNorm, weight, bias; weight/bias sharded on axis 0),
# TERowParallelLinear (weight on axis 1, bias), every TE linear's _extra_state, and
# TEDotProductAttention with nothing unless softmax_type == "learnable".
TE_DENSE_KEYS = sorted(
    [f"self_attention.linear_qkv.{k}"
     for k in ("layer_norm_weight", "layer_norm_bias", "weight", "bias", "_extra_state")]
    + [f"self_attention.linear_proj.{k}" for k in ("weight", "bias", "_extra_state")]
    + [f"mlp.linear_fc1.{k}" for k in ("layer_norm_weight", "layer_norm_bias", "weight", "bias", "_extra_state")]
    + [f"mlp.linear_fc2.{k}" for k in ("weight", "bias", "_extra_state")]
)
@pytest.fixture(scope="module")
def model_parallel():
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    yield
    ps.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**extra):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                  use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                  bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
                  gradient_accumulation_fusion=False, persist_layer_norm=False)
    kwargs.update(extra)
    return TransformerConfig(**kwargs)


def _layer(spec, config, seed=1234):
    from megatron.core import tensor_parallel
    from megatron.core.transformer.spec_utils import build_module

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return build_module(spec, config=config, layer_number=1)


def test_original_te_spec_fails_without_te(model_parallel, monkeypatch):
    from megatron.core.models.gpt import gpt_layer_specs

    monkeypatch.setattr(gpt_layer_specs, "TESpecProvider", MANAGER.original(f"{te_spec.SPECS}.TESpecProvider"))
    with pytest.raises(TypeError, match="NoneType"):
        gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()


def test_te_spec_layer_has_te_keys_and_runs(model_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    layer = _layer(get_gpt_layer_with_transformer_engine_spec(), _config())
    assert sorted(layer.state_dict()) == TE_DENSE_KEYS
    sharded = layer.sharded_state_dict(prefix="decoder.layers.0.")
    assert sorted(sharded) == sorted(f"decoder.layers.0.{k}" for k in TE_DENSE_KEYS)
    # the fused norm+linear shards as TE's does (ColumnParallelLinear's {"weight": 0, "bias": 0} map,
    # the norm replicated); at TP1 each is one whole tensor under its own key
    for key in TE_DENSE_KEYS:
        if not key.endswith("_extra_state"):
            value = sharded[f"decoder.layers.0.{key}"]
            assert value.key == f"decoder.layers.0.{key}" and value.data.shape == layer.state_dict()[key].shape
    out, _ = layer(torch.randn(8, 2, 32), attention_mask=None)
    assert out.shape == (8, 2, 32) and torch.isfinite(out).all()


def test_te_spec_checkpoint_loads_by_te_names(model_parallel):
    """A state dict written under TE's names (what a TE run saves) loads strictly and is used."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    spec, config = get_gpt_layer_with_transformer_engine_spec(), _config()
    saved, fresh = _layer(spec, config, seed=1), _layer(spec, config, seed=2)
    x = torch.randn(8, 2, 32)
    with torch.no_grad():
        saved.self_attention.linear_qkv.layer_norm_weight.mul_(1.5)  # the norm's weights travel too
    fresh.load_state_dict(saved.state_dict(), strict=True)
    torch.testing.assert_close(fresh(x, attention_mask=None)[0], saved(x, attention_mask=None)[0], rtol=0, atol=0)


@pytest.mark.parametrize("normalization,zero_centered", [("LayerNorm", False), ("RMSNorm", False), ("RMSNorm", True)])
def test_fused_norm_linear_computes_what_the_local_norm_then_linear_does(model_parallel, normalization, zero_centered):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    config = _config(normalization=normalization, layernorm_zero_centered_gamma=zero_centered)
    te_layer = _layer(get_gpt_layer_with_transformer_engine_spec(), config)
    # (megatron's local norm has no zero-centered gamma: it gets the plain gamma, see below)
    local_config = _config(normalization=normalization)
    local_layer = _layer(get_gpt_layer_local_spec(normalization=normalization), local_config)
    te_state = te_layer.state_dict()
    with torch.no_grad():  # non-trivial norm weights, the same in both
        for key in [k for k in te_state if "layer_norm_weight" in k]:
            te_state[key].uniform_(-0.5, 0.5)
    renamed = {k.replace("self_attention.linear_qkv.layer_norm_", "input_layernorm.")
                .replace("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."): v for k, v in te_state.items()}
    if zero_centered:  # the local norm keeps the plain gamma; TE's is stored minus one
        renamed = {k: (v + 1 if k.endswith("layernorm.weight") else v) for k, v in renamed.items()}
    local_layer.load_state_dict(renamed, strict=False)
    x = torch.randn(8, 2, 32)
    torch.testing.assert_close(te_layer(x, attention_mask=None)[0], local_layer(x, attention_mask=None)[0],
                               rtol=1e-6, atol=1e-6)


def test_moe_variant_builds_and_runs(model_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    config = _config(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False, moe_ffn_hidden_size=32)
    layer = _layer(get_gpt_layer_with_transformer_engine_spec(num_experts=4), config)
    keys = set(layer.sharded_state_dict(prefix=""))
    assert {"self_attention.linear_qkv.layer_norm_weight", "pre_mlp_layernorm.weight",
            "mlp.router.weight", "mlp.experts.local_experts.3.linear_fc2.weight"} <= keys
    out, _ = layer(torch.randn(8, 2, 32), attention_mask=None)
    assert out.shape == (8, 2, 32) and torch.isfinite(out).all()


@pytest.mark.parametrize("option", te_spec.TE_ONLY_SPEC_OPTIONS)
def test_te_only_spec_options_are_refused_by_name(model_parallel, option):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    with pytest.raises(te_spec.TEOnlyOptionError, match=option):
        get_gpt_layer_with_transformer_engine_spec(**{option: True})


def test_fp8_is_refused_by_name(model_parallel):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    config = dataclasses.replace(_config())
    object.__setattr__(config, "fp8", "hybrid")  # set after __post_init__, as a trainer's recipe would
    with pytest.raises(te_spec.TEOnlyOptionError, match="fp8"):
        _layer(get_gpt_layer_with_transformer_engine_spec(), config)


def test_one_notice(model_parallel, capsys):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    notice.forget()
    get_gpt_layer_with_transformer_engine_spec()
    get_gpt_layer_with_transformer_engine_spec(num_experts=2)
    assert capsys.readouterr().out.count(te_spec.NOTICE) == 1


def _gpt(spec, config, seed):
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16,
                    position_embedding_type="rope")


@pytest.mark.parametrize("direction", ["local->te", "te->local"])
def test_torch_dist_checkpoint_moves_between_te_spec_and_local_spec(model_parallel, tmp_path, direction):
    """A megatron distributed checkpoint (torch_dist) saved by a GPT of one spec loads into a GPT of the
    other: the stand-in's sharded keys are TE's, which megatron's local spec maps its norms onto; the
    stand-in's per-linear ``_extra_state`` (TE's fp8 metadata, empty here) is not needed by the local
    spec and is optional to the stand-in. The loaded model computes what the saved one did."""
    from megatron.core import dist_checkpointing
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    config = _config(num_layers=2, normalization="RMSNorm")
    specs = {"local": get_gpt_layer_local_spec(normalization="RMSNorm"),
             "te": get_gpt_layer_with_transformer_engine_spec()}
    source, target = direction.split("->")
    saved, loaded = _gpt(specs[source], config, seed=1), _gpt(specs[target], config, seed=2)
    with torch.no_grad():  # norm weights that differ from their initial ones, so that they must travel
        for name, param in saved.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    dist_checkpointing.save(saved.sharded_state_dict(), str(tmp_path))
    state = dist_checkpointing.load(loaded.sharded_state_dict(), str(tmp_path))
    missing, unexpected = loaded.load_state_dict(state, strict=False)
    assert [k for k in missing if not k.endswith("_extra_state")] == [] and unexpected == []
    tokens = torch.randint(0, 64, (2, 16))
    position_ids = torch.arange(16).expand(2, 16)
    saved.eval(), loaded.eval()
    torch.testing.assert_close(loaded(tokens, position_ids, None), saved(tokens, position_ids, None),
                               rtol=0, atol=0)


def test_level_1_fused_rmsnorm_serves_the_stand_in_norm(model_parallel):
    """With level 1's fused RMSNorm feature applied, the TE spec's fused norm + linear normalises
    through hyper_adaptor's rms_norm op (two per layer: before qkv and before fc1), with the result of
    torch's RMSNorm; undone, it is torch's again."""
    from hyper_adaptor.ops import backend
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.fused import rms_norm as fused_rms_norm

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    layer = _layer(get_gpt_layer_with_transformer_engine_spec(), _config(normalization="RMSNorm"))
    with torch.no_grad():
        layer.self_attention.linear_qkv.layer_norm_weight.uniform_(0.5, 1.5)
    x = torch.randn(8, 2, 32)
    want = layer(x, attention_mask=None)[0]

    def op_calls():
        return sum(backend.call_counts().get("rms_norm", {}).values())

    manager = PatchManager()
    manager.register_all(fused_rms_norm.patches(None))
    with manager.applied():
        before = op_calls()
        got = layer(x, attention_mask=None)[0]
        assert op_calls() - before == 2
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    before = op_calls()
    layer(x, attention_mask=None)
    assert op_calls() == before


def test_decoder_block_and_mtp_specs_with_te_build_a_moe_gpt_that_trains(model_parallel):
    """The block-level entry points a library user reaches for a MoE model with multi-token prediction:
    ``get_gpt_decoder_block_spec(config, use_transformer_engine=True)`` (a dense layer, then a MoE layer)
    and ``get_gpt_mtp_block_spec`` — each reads TESpecProvider, so each failed without TE."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

    config = _config(num_layers=2, num_moe_experts=4, moe_router_topk=2, add_bias_linear=False,
                     moe_layer_freq=[0, 1], mtp_num_layers=1, normalization="RMSNorm")
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    mtp = get_gpt_mtp_block_spec(config, block.layer_specs[-1], use_transformer_engine=True)
    from megatron.core import tensor_parallel
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(3)
    tensor_parallel.model_parallel_cuda_manual_seed(3)
    model = GPTModel(config, block, vocab_size=64, max_sequence_length=16, position_embedding_type="rope",
                     mtp_block_spec=mtp)
    names = set(dict(model.named_parameters()))
    assert {"decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "decoder.layers.1.mlp.router.weight",
            "mtp.layers.0.mtp_model_layer.self_attention.linear_qkv.layer_norm_weight",
            "mtp.layers.0.eh_proj.weight"} <= names
    tokens = torch.randint(0, 64, (2, 8))
    loss = model(tokens, torch.arange(8).expand(2, 8), None, labels=tokens).float().mean()
    loss.backward()
    assert torch.isfinite(loss) and model.decoder.layers[1].mlp.router.weight.grad.abs().sum() > 0
