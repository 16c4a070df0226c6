"""HSDP bad input: the library's ValueErrors and --use-hsdp's flag errors (one process)."""


import pytest
import torch
import torch.nn as nn

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.parallel.hsdp import hsdp
from tests.unit.test_adaptor import megatron_args

ADAPTOR = adaptor_module.ADAPTOR



@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"optimizer_level": "level4"}, "optimizer_level must be one of 'level1', 'level2', 'level3'; got 'level4'"),
        ({"shard_size": 3}, "shard_size must be -1 or a positive divisor of the data-parallel size 1; got 3"),
        ({"shard_size": 0}, "shard_size must be -1 or a positive divisor of the data-parallel size 1; got 0"),
        ({"shard_size": 1.0}, "shard_size must be an int"),
        ({"threshold": -1}, "threshold must be a size in KB >= 0; got -1"),
        ({"bucket_size": -2}, "bucket_size must be -1, 0 or a positive size in KB; got -2"),
        ({"grad_scale": 0}, "grad_scale must be a number > 0; got 0"),
        ({"comm_async": "yes"}, "comm_async must be a bool; got 'yes'"),
        ({"reduce_dtype": torch.int32}, "reduce_dtype must be None or a floating torch.dtype; got torch.int32"),
        ({"use_eager_hook": False}, "use_eager_hook must be True"),
    ],
)
def test_invalid_arguments_name_argument_and_value(world_of_one, kwargs, message):
    with pytest.raises(ValueError, match="hsdp: " + message.replace("(", r"\(").replace(")", r"\)")):
        hsdp(nn.Linear(4, 4), **kwargs)


def test_grad_sync_off_needs_grad_accumulation(world_of_one):
    model = hsdp(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="set_requires_grad_sync\\(False\\) needs enable_grad_accumulation=True"):
        model.set_requires_grad_sync(False)
    with pytest.raises(ValueError, match="already wrapped"):
        hsdp(model)


def _prepare(*flags, world=4):
    args = megatron_args(*flags)
    args.world_size = world
    ADAPTOR.prepare(args)
    return args


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--use-distributed-optimizer",), "--use-hsdp cannot be combined with --use-distributed-optimizer"),
        (("--use-torch-fsdp2",), "--use-hsdp cannot be combined with --use-torch-fsdp2"),
        (("--overlap-grad-reduce",), "--use-hsdp cannot be combined with --overlap-grad-reduce"),
        (("--hsdp-shard-size", "3"), "--hsdp-shard-size 3 must be -1 or divide the data-parallel size 4"),
        (("--tensor-model-parallel-size", "2", "--hsdp-shard-size", "4"),
         "--hsdp-shard-size 4 must be -1 or divide the data-parallel size 2"),
        (("--save", "/tmp/x", "--ckpt-format", "torch"),
         "--use-hsdp checkpoints need --ckpt-format torch_dist \\(the default\\); got --ckpt-format torch"),
        (("--hsdp-threshold-kb", "-1"), "--hsdp-threshold-kb must be a finite number >= 0; got -1.0"),
        (("--hsdp-threshold-kb", "nan"), "--hsdp-threshold-kb must be a finite number >= 0; got nan"),
        (("--hsdp-threshold-kb", "inf"), "--hsdp-threshold-kb must be a finite number >= 0; got inf"),
        (("--hsdp-bucket-size-kb", "nan"), "--hsdp-bucket-size-kb must be -1, 0 or a finite number > 0; got nan"),
        (("--hsdp-bucket-size-kb", "inf"), "--hsdp-bucket-size-kb must be -1, 0 or a finite number > 0; got inf"),
        (("--hsdp-bucket-size-kb", "-2"), "--hsdp-bucket-size-kb must be -1, 0 or a finite number > 0; got -2.0"),
        (("--hsdp-shard-size", "0"), "--hsdp-shard-size must be -1 .* or a number of ranks >= 1; got 0"),
        (("--hsdp-shard-size", "-2"), "--hsdp-shard-size must be -1 .* or a number of ranks >= 1; got -2"),
    ],
)
def test_conflicting_megatron_flags_are_errors_naming_them(flags, message):
    with pytest.raises(FeatureConfigError, match=message):
        _prepare("--use-hsdp", *flags)


@pytest.mark.parametrize("flags, world", [
    (("--expert-model-parallel-size", "2"), 4),
    (("--expert-model-parallel-size", "2", "--hsdp-shard-size", "2"), 8),
    # a shard size at least the expert-DP size (2 here) shards the experts over that whole group
    (("--expert-model-parallel-size", "2", "--hsdp-shard-size", "4"), 4),
    (("--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"), 4),
    (("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"),
     8),
])
def test_expert_parallelism_is_served(flags, world):
    args = _prepare("--use-hsdp", "--num-experts", "4", *flags, world=world)
    assert args.use_hsdp


def test_a_shard_size_that_splits_the_expert_data_parallel_group_unevenly_is_refused():
    # world 12, EP 2: data parallel 12 (4 divides it), expert data parallel 6 (4 does not)
    with pytest.raises(FeatureConfigError, match="--hsdp-shard-size 4 must be -1, at least, or divide the expert "
                                                 "data-parallel size 6 .*--expert-model-parallel-size 2"):
        _prepare("--use-hsdp", "--num-experts", "4", "--expert-model-parallel-size", "2", "--hsdp-shard-size", "4",
                 world=12)


def test_expert_units_scale_like_megatron_ddp(monkeypatch):
    """Experts: summed over the expert-DP group, divided by the data-parallel size (the engine averages
    over a unit's own group, so grad_scale = expert-DP / DP); the shard size is capped at that group."""
    from hyper_adaptor.patches.hsdp import data_parallel

    monkeypatch.setattr(data_parallel.dist, "get_world_size", lambda group: group)  # "groups" are their sizes
    kwargs = {"shard_size": -1, "threshold": 0.0}
    assert data_parallel._expert_kwargs(kwargs, 2, 4) == {"shard_size": -1, "threshold": 0.0, "grad_scale": 0.5}
    assert data_parallel._expert_kwargs({**kwargs, "shard_size": 4}, 2, 8)["shard_size"] == -1
    assert data_parallel._expert_kwargs({**kwargs, "shard_size": 2}, 4, 8)["shard_size"] == 2
    with pytest.raises(ValueError, match="--hsdp-shard-size 4 must be -1 or divide the expert data-parallel size 6"):
        data_parallel._expert_kwargs({**kwargs, "shard_size": 4}, 6, 12)


@pytest.mark.parametrize("shard", ["0", "-3"])
def test_shard_size_is_refused_by_name_without_a_world_size(shard):
    # describe and hyper_adaptor.adapt(args) may have no world size: the range check needs none
    args = megatron_args("--use-hsdp", "--hsdp-shard-size", shard)
    assert not hasattr(args, "world_size")
    with pytest.raises(FeatureConfigError, match=f"--hsdp-shard-size must be -1 .*; got {shard}"):
        ADAPTOR.prepare(args, say=False)
    ADAPTOR.prepare(megatron_args("--use-hsdp", "--hsdp-shard-size", "3"), say=False)  # divisibility: needs a world


def test_hsdp_flags_switch_off_grad_accumulation_fusion_and_map_to_the_engine(capsys):
    from hyper_adaptor.patches.hsdp.patches import hsdp_kwargs

    args = _prepare("--use-hsdp", "--hsdp-optimizer-level", "level3", "--hsdp-shard-size", "2",
                    "--hsdp-bucket-size-kb", "0", "--hsdp-reduce-dtype", "fp32")
    assert args.gradient_accumulation_fusion is False
    assert ("--gradient-accumulation-fusion: True -> False (--use-hsdp reduces gradients from .grad)"
            in capsys.readouterr().out)
    kw = hsdp_kwargs(args)
    assert kw["optimizer_level"] == "level3" and kw["shard_size"] == 2
    assert kw["comm_fusion"] is False and kw["reduce_dtype"] is torch.float32


def test_use_hsdp_below_level_2_is_a_notice_not_applied(capsys):
    args = _prepare("--use-hsdp", "--optimization-level", "1")
    assert "--use-hsdp" in capsys.readouterr().out
    from hyper_adaptor import features

    assert not features.get("hsdp").is_enabled(args)


def test_fp16_reduces_in_fp32_unless_told(capsys):
    from hyper_adaptor.patches.hsdp.patches import hsdp_kwargs

    args = _prepare("--use-hsdp", "--fp16")
    assert hsdp_kwargs(args)["reduce_dtype"] is torch.float32
    assert ("--hsdp-reduce-dtype: None -> 'fp32' (--use-hsdp with --fp16 reduces gradients in fp32"
            in capsys.readouterr().out)
    args = _prepare("--use-hsdp", "--fp16", "--hsdp-reduce-dtype", "fp16")
    assert hsdp_kwargs(args)["reduce_dtype"] is torch.float16


def test_nested_units_prefetch_and_keep_in_backward_order(world_of_one):
    """Level 3's default schedule with a unit nested in each layer (megatron's experts, wrapped over
    their own group): backward begins with the last layer, then its nested unit, then the layer before;
    the root and the last layer stay gathered. Without nesting, the same rule is reverse module order."""

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.experts = nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4))

        def forward(self, x):
            return self.experts(self.attn(x))

    model = nn.Sequential(nn.Linear(4, 4), Layer(), Layer())
    for layer in model[1:]:
        hsdp(layer.experts, optimizer_level="level3", threshold=0)
    for layer in model[1:]:
        hsdp(layer, optimizer_level="level3", threshold=0)
    hsdp(model, optimizer_level="level3", threshold=0)
    model(torch.ones(2, 4)).sum().backward()  # the first forward sets the defaults
    root, (l1, e1, l2, e2) = model._hsdp_state, [m._hsdp_state for m in (model[1], model[1].experts, model[2],
                                                                         model[2].experts)]
    assert root._backward_order() == [l2, e2, l1, e1]
    assert [s.backward_prefetch for s in (root, l2, e2, l1, e1)] == [[l2], [e2], [l1], [e1], []]
    assert [s.forward_prefetch for s in (root, l1, e1, l2, e2)] == [[l1], [e1], [l2], [e2], []]
    assert [s.reshard_after_forward for s in (root, l1, e1, l2, e2)] == [False, True, True, False, True]
