"""Level 0 on a machine without CUDA: Megatron's ``--moe-grouped-gemm`` is switched off before
megatron.training's ``validate_args`` asserts a CUDA compute capability >= 8 for it; from level 1
hyper_adaptor serves the flag (features/moe_grouped_gemm.py) and level 0 leaves it alone."""

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import features
from hyper_adaptor.features.base import RECORD, restore_hidden, taken
from hyper_adaptor.patches.compat.arguments import switch_unworkable_defaults
from tests.unit.test_adaptor import megatron_args

ADAPTOR = adaptor_module.ADAPTOR

MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1", "--num-experts", "4",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "128")


def _args(level, *flags):
    args = megatron_args(*MODEL, "--optimization-level", str(level), *flags)
    args.rank, args.world_size = 0, 1  # what megatron's parse_args adds from the environment
    return args


@pytest.mark.skipif(ADAPTOR.device_type == "cuda", reason="the switch is for machines without CUDA")
def test_level_0_switches_moe_grouped_gemm_off_before_megatrons_cuda_assert(capsys):
    from megatron.training.arguments import validate_args  # megatron's, wrapped by the adaptor

    args = _args(0, "--moe-grouped-gemm")
    capsys.readouterr()
    validate_args(args)  # without the switch: AssertionError "Unsupported compute capability ..."
    assert args.moe_grouped_gemm is False
    lines = [line for line in capsys.readouterr().out.splitlines() if "--moe-grouped-gemm" in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("[hyper_adaptor] --moe-grouped-gemm: True -> False")
    assert "SequentialMLP (per-expert loop) is used instead" in lines[0]
    assert "--optimization-level 1 provides a grouped GEMM" in lines[0]
    assert not features.get("moe_grouped_gemm").is_enabled(args)


def test_level_1_keeps_moe_grouped_gemm_on():
    args = _args(1, "--moe-grouped-gemm")
    assert [n for n in switch_unworkable_defaults(args, "cpu") if "moe-grouped-gemm" in n] == []
    assert args.moe_grouped_gemm is True
    # Through the adaptor: the level-1 feature, not the level-0 switch, takes the flag (its adjust
    # hides it from megatron's check; the adaptor puts it back after megatron's validate_args).
    args = _args(1, "--moe-grouped-gemm")
    ADAPTOR.prepare(args)
    assert args.moe_grouped_gemm is False and taken(args) == {"moe_grouped_gemm": True}
    assert features.get("moe_grouped_gemm").is_enabled(args)
    restore_hidden(args)
    assert args.moe_grouped_gemm is True and not hasattr(args, RECORD)


def test_level_0_on_cuda_is_megatrons_behaviour():
    args = _args(0, "--moe-grouped-gemm")
    assert [n for n in switch_unworkable_defaults(args, "cuda") if "moe-grouped-gemm" in n] == []
    assert args.moe_grouped_gemm is True
