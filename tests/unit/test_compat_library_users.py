"""For megatron-core library users (no megatron.training command line): process groups
requested with "nccl" and the fusion switches set on a TransformerConfig directly. Each fix is shown
needed (the original fails) and working. The 2-rank world is in tests/distributed/test_nccl_request.py.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import platform
from hyper_adaptor.patches.compat import backends, fusion_switches
from hyper_adaptor.testing.world import free_port

pytestmark = pytest.mark.skipif(platform.device_type() != "cpu", reason="the CPU platform's decisions")
MANAGER = adaptor_module.ADAPTOR.manager
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_nccl_requests_name_gloo_on_cpu_and_nothing_else_changes():
    assert backends.platform_backend("nccl", "gloo") == "gloo"
    assert backends.platform_backend("NCCL", "gloo") == "gloo"
    assert backends.platform_backend("cpu:gloo,cuda:nccl", "gloo") == "cpu:gloo,cuda:gloo"
    for kept in (None, "gloo", "cpu:gloo", "ucc"):
        assert backends.platform_backend(kept, "gloo") == kept
    # registered only where torch itself has no mapping: torch_npu maps nccl on NPU, CUDA has nccl
    assert backends.patches("npu") == [] and backends.patches("cuda") == []
    assert {p.target for p in backends.patches("cpu")} == set(backends.ENTRY_POINTS)


def _config(**switches):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, **switches)


def test_megatron_refuses_apply_rope_fusion_without_te():
    config = _config()
    config.apply_rope_fusion = True
    with pytest.raises(ValueError, match="apply_rope_fusion is not available"):
        MANAGER.original(fusion_switches.CONFIG_POST_INIT)(config)


def test_one_decision_table_for_command_line_and_config():
    at = lambda name, level, **kw: fusion_switches.decide(name, "cpu", level, **kw)  # noqa: E731
    for name in fusion_switches.SWITCHES:
        assert at(name, 0).value is False and at(name, 0).why
    assert at("gradient_accumulation_fusion", 1) == fusion_switches.Decision(True, "grad_accum_fusion", None)
    rope = at("apply_rope_fusion", 1)
    assert (rope.value, rope.served_by) == (False, "fused_rope") and "served by" in rope.why
    # on the command line the serving feature must itself be enabled (--use-fused-rotary-pos-emb)
    assert at("apply_rope_fusion", 1, feature_available=False).served_by is None
    assert at("masked_softmax_fusion", 2).value is False  # no level-1 stand-in: off at every level


PROBE = r"""
import json, sys
import torch
import hyper_adaptor.megatron_adaptor  # noqa: F401  (the one line)
import torch.distributed as dist

dist.init_process_group(backend="nccl", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{sys.argv[1]}")
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from hyper_adaptor.ops import backend

ps.initialize_model_parallel(tensor_model_parallel_size=1)
model_parallel_cuda_manual_seed(1)
config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, apply_rope_fusion=True,
                           masked_softmax_fusion=True, persist_layer_norm=True, bias_activation_fusion=True,
                           use_cpu_initialization=True)
model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                 position_embedding_type="rope")
# with this switch megatron sends weight gradients to main_grad, which its DDP wrapper provides:
# shown here is that the config and a linear layer build
gaf = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, gradient_accumulation_fusion=True)
ColumnParallelLinear(32, 32, config=gaf, init_method=torch.nn.init.xavier_normal_)
before = sum(backend.call_counts().get("rope", {}).values())
tokens = torch.randint(0, 64, (2, 8))
mask = torch.ones(2, 1, 8, 8, dtype=torch.bool).tril().logical_not()
loss = model(tokens, torch.arange(8).expand(2, 8), mask, labels=tokens).float().mean()
loss.backward()
result = {name: getattr(config, name) for name in (
    "apply_rope_fusion", "masked_softmax_fusion", "persist_layer_norm", "bias_activation_fusion")}
result.update(gradient_accumulation_fusion=gaf.gradient_accumulation_fusion, loss=loss.item(),
              rope_calls=sum(backend.call_counts().get("rope", {}).values()) - before)

# gradient_accumulation_fusion on a GPT under megatron's DDP (which gives main_grad): the weight
# gradients accumulated into main_grad equal the plain model's .grad from the same seed
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


def gpt(**switches):
    torch.manual_seed(7)
    model_parallel_cuda_manual_seed(7)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            **switches)
    return cfg, GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=16,
                         position_embedding_type="rope")


def step(model):
    model(tokens, torch.arange(8).expand(2, 8), mask, labels=tokens).float().mean().backward()


_, plain = gpt()
step(plain)
cfg, inner = gpt(gradient_accumulation_fusion=True)
fused = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), inner)
wgrad_before = sum(backend.call_counts().get("wgrad_accum", {}).values())
step(fused)
fused.finish_grad_sync()
main_grads = dict(inner.named_parameters())
result.update(
    wgrad_calls=sum(backend.call_counts().get("wgrad_accum", {}).values()) - wgrad_before,
    gaf_on_ddp_model=cfg.gradient_accumulation_fusion,
    gaf_max_diff=max((main_grads[n].main_grad - p.grad).abs().max().item() for n, p in plain.named_parameters()),
)
print("RESULT " + json.dumps(result))
"""


def _library_user_run(level: int):
    """A megatron-core user's script (its own nccl process group, a config with fusion switches, a
    GPT trained one step) in a fresh process at ``level`` set from the environment."""
    env = dict(os.environ, HYPER_ADAPTOR_OPTIMIZATION_LEVEL=str(level), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    run = subprocess.run([sys.executable, "-c", PROBE, str(free_port())], capture_output=True, text=True,
                         timeout=240, env=env, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    return result, run.stdout


def test_level_0_switches_the_config_fusions_off_with_one_notice_each():
    result, out = _library_user_run(0)
    assert not any(result[n] for n in ("apply_rope_fusion", "masked_softmax_fusion", "persist_layer_norm",
                                       "gradient_accumulation_fusion"))
    assert result["bias_activation_fusion"] is True  # megatron's own torch code serves it everywhere
    assert result["rope_calls"] == 0
    assert result["gaf_on_ddp_model"] is False and result["wgrad_calls"] == 0 and result["gaf_max_diff"] < 1e-6
    for name in ("apply_rope_fusion", "masked_softmax_fusion", "persist_layer_norm", "gradient_accumulation_fusion"):
        assert out.count(f"TransformerConfig.{name}: True -> False") == 1, out
    assert out.count('backend "nccl" use "gloo"') == 1


def test_level_1_serves_rope_and_grad_accum_fusion_with_the_level_1_ops():
    result, out = _library_user_run(1)
    assert result["rope_calls"] == 2  # query and key of the one layer, through hyper_adaptor's fused op
    assert result["gradient_accumulation_fusion"] is True
    # under megatron's DDP the weight gradients went through the level-1 op into main_grad, and equal
    # the plain model's (qkv, proj, fc1, fc2 and the output layer of the one-layer GPT)
    assert result["gaf_on_ddp_model"] is True and result["wgrad_calls"] >= 4
    assert result["gaf_max_diff"] < 1e-6
    assert "fused_rope (level 1) applied" in out and "grad_accum_fusion (level 1) applied" in out
    assert torch.isfinite(torch.tensor(result["loss"]))
