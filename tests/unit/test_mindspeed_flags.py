"""MindSpeed's flags, each answered (hyper_adaptor/mindspeed_flags.py): every row of the table parsed with
megatron's own parser, the table against the flags MindSpeed's feature pages name, the generated migration
guide, and one process that runs describe and a training script on MindSpeed lines."""

import argparse
import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import mindspeed_flags, mindspeed_guide
from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.features.base import asked
from hyper_adaptor.mindspeed_flag_list import NOT_TRAINING_FLAGS, feature_doc_flags
from hyper_adaptor.mindspeed_flags import MAPPED, MEGATRON_FLAGS, NOOP, REFUSED, ROWS, SAME
from tests.unit.test_bad_input import MODEL, SCRIPT_RUNNER, _environment, assert_refused

ROOT = Path(__file__).resolve().parents[2]
ADAPTOR = adaptor_module.ADAPTOR

# what each mapped row must set, written out here rather than read from the table under test: (flags the
# line needs besides the row's own, {dest: value})
MAPPED_TO = {
    "--use-fusion-attn-v2": ((), {"use_flash_attn": True}),
    "--gemm-gradient-accumulation-fusion": (("--no-gradient-accumulation-fusion",),
                                            {"gradient_accumulation_fusion": True}),
    "--context-parallel-algo": ((), {"context_parallel_algo": "allgather"}),
    "--schedules-method": ((), {"pipeline_schedule": "zbv", "num_virtual_stages_per_pipeline_rank": 2}),
    "--swap-modules": ((), {"swap_modules": ["layernorm", "self_attn"]}),
    "--swap-optimizer": ((), {"optimizer_cpu_offload": True}),
    "--layerzero": ((), {"use_hsdp": True, "hsdp_optimizer_level": "level3"}),
    "--use-custom-fsdp": ((), {"use_megatron_fsdp": True}),
    "--disable-gloo-group": ((), {"use_gloo_process_groups": False}),
    "--npu-deterministic": ((), {"deterministic_mode": True}),
    "--moe-tp-extend-ep": (("--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
                           {"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 1,
                            "moe_tp_extend_ep": False}),
    "--moe-fb-overlap": ((), {"overlap_moe_expert_parallel_comm": True}),
    "--n-shared-experts": (("--ffn-hidden-size", "96"), {"moe_shared_expert_intermediate_size": 192}),
    "--balanced-moe-experts": ((), {"moe_dispatcher_engine": "hyper", "moe_hot_expert_replicas": 3}),
    "--balanced-moe-hot-expert-num": ((), {"moe_hot_expert_replicas": 2}),
    "--op-cal-tflops": ((), {"log_throughput": True}),
    "--tokenizer-type": ((), {"tokenizer_type": "HuggingFaceTokenizer"}),
    "--tokenizer-name-or-path": ((), {"tokenizer_model": "./tokenizer"}),
}


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """megatron.training's parser as the adaptor extends it (building one takes a while: one for all)."""
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def megatron_args(*flags: str) -> argparse.Namespace:
    return _parser().parse_args(list(flags))


def _line(row) -> list[str]:
    """The row's flag as a launch line gives it: a switch alone, a value flag with a value it answers."""
    action = _parser()._option_string_actions[row.flag]
    if action.nargs == 0:
        return [row.flag]
    return [row.flag, row.example or row.value]


def _id(row) -> str:
    return row.flag + (f"={row.value}" if row.value else "")


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_every_row_parses_to_its_answer(row):
    extra, expected = MAPPED_TO.get(row.flag, ((), {})) if row.disposition == MAPPED else ((), {})
    args = megatron_args(*extra, *_line(row))
    answered = mindspeed_flags.given(args)
    if row.disposition == SAME:  # hyper_adaptor's own flag: answered as ours, nothing changed, nothing said
        assert answered == [(row, getattr(args, row.dest))]
        before = vars(args).copy()
        assert mindspeed_flags.apply(args) == [] and vars(args) == before
        return
    assert [r for r, _ in answered] == [row]
    if row.disposition == REFUSED:
        with pytest.raises(FeatureConfigError, match=f"^{row.flag}") as refused:
            mindspeed_flags.apply(args)
        assert "cannot run here" in str(refused.value)
        return
    before = vars(args).copy()
    notices = mindspeed_flags.apply(args)
    assert len(notices) == 1 and notices[0].startswith(row.flag), notices
    changed = {dest: value for dest, value in vars(args).items() if before.get(dest, object()) != value}
    if row.disposition == NOOP:
        assert "accepted, nothing to do here" in notices[0] and changed == {}
    else:
        assert row.flag in MAPPED_TO, f"write down what {row.flag} must set in MAPPED_TO"
        assert row.target.split()[0] in notices[0]  # one notice naming both flags
        assert {dest: changed[dest] for dest in expected if dest in changed} == expected, changed
        assert set(changed) == set(expected), changed


def test_the_table_answers_every_flag_mindspeeds_pages_name():
    rows = {row.flag for row in ROWS}
    named = set(feature_doc_flags())
    assert not rows & set(MEGATRON_FLAGS) and not rows & set(NOT_TRAINING_FLAGS)
    assert named == rows | set(MEGATRON_FLAGS) | set(NOT_TRAINING_FLAGS)
    assert all(row.disposition in mindspeed_flags.DISPOSITIONS for row in ROWS)


def test_each_flag_is_registered_once_in_mindspeeds_shape_or_is_already_megatrons_or_ours():
    bare = argparse.ArgumentParser(allow_abbrev=False)
    adaptor_module.ADAPTOR.manager.original("megatron.training.arguments.add_megatron_arguments")(bare)
    megatrons = bare._option_string_actions
    parser = _parser()
    for flag in MEGATRON_FLAGS:
        assert flag in megatrons, f"{flag} is not megatron's"
    for row in ROWS:
        action = parser._option_string_actions[row.flag]
        if row.shape is None:  # ours or megatron's, never registered again; MindSpeed's values let through
            assert action.choices is None or row.value is None or row.value in action.choices
        else:
            assert row.flag not in megatrons, f"{row.flag} is megatron's: its row needs no shape"
            assert action.dest == row.dest and action.default == row.shape.get("default", action.default)
            assert action.choices == row.shape.get("choices")
    dests = [a.dest for a in parser._actions if a.option_strings]
    registered = {row.dest for row in ROWS if row.shape is not None}
    assert all(dests.count(dest) == 1 for dest in registered), "a MindSpeed flag shares a dest"


@pytest.mark.parametrize("line", [
    ("--tp-x", "1"), ("--sparse-mode", "0"), ("--moe-zero-memory", "disable"), ("--optimizer-selection",
    "fused_adamw"), ("--attention-mask-type", "causal"), ("--swap-optimizer-times", "16"), ("--cp-window-size", "1"),
    ("--context-parallel-algo", "ring"), ("--swap-modules", "self_attn", "mlp"), (),
])
def test_mindspeeds_defaults_and_our_own_values_ask_for_nothing(line):
    args = megatron_args(*line)
    assert mindspeed_flags.given(args) == [] and mindspeed_flags.apply(args) == []


def test_a_value_no_row_answers_is_argparses_error_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        megatron_args("--swap-modules", "input_norm,decoder")
    assert "--swap-modules" in capsys.readouterr().err


def test_the_adaptor_answers_them_before_any_feature_and_refuses_first():
    args = megatron_args("--npu-deterministic", "--use-ascend-mc2", "--swap-optimizer")
    args.rank, args.world_size = 0, 1
    ADAPTOR.prepare(args, say=False)
    assert asked(args, "deterministic_mode") and asked(args, "optimizer_cpu_offload")
    # a refused flag ends the checks before a mapped one changes anything
    args = megatron_args("--swap-optimizer", "--reuse-fp32-param")
    with pytest.raises(FeatureConfigError, match="--reuse-fp32-param"):
        ADAPTOR.prepare(args, say=False)
    assert not args.optimizer_cpu_offload
    # preparing a namespace twice (adapt() is idempotent) maps once
    args = megatron_args("--moe-tp-extend-ep", "--tensor-model-parallel-size", "2", "--expert-model-parallel-size",
                         "2")
    mindspeed_flags.apply(args)
    mindspeed_flags.apply(args)
    assert args.expert_model_parallel_size == 4


def test_the_migration_guide_is_generated_from_the_table():
    committed = (ROOT / mindspeed_flags.DOC).read_text()
    assert committed == mindspeed_guide.markdown(), \
        "regenerate: python -m hyper_adaptor mindspeed-flags --markdown > docs/migrating-from-mindspeed.md"
    for row in ROWS:
        assert f"| `{row.flag}` |" in committed


ACCEPTED = ("--use-ascend-mc2", "--npu-deterministic", "--swap-attention", "--swap-modules",
            "input_norm,self_attention", "--context-parallel-algo", "megatron_cp_algo")
REFUSED_LINE = ("--use-ascend-mc2", "--reuse-fp32-param")


@pytest.fixture(scope="module")
def ran():
    """describe on an accepted and a refused MindSpeed line, and a training script on the refused one: one
    process (a training script refused in its argument checks starts no process group and trains nothing)."""
    runs = [("describe", [*MODEL, *ACCEPTED]), ("describe", list(REFUSED_LINE)),
            ("script", [*MODEL, "--mock-data", "--train-iters", "1", *REFUSED_LINE])]
    result = subprocess.run([sys.executable, "-c", SCRIPT_RUNNER], input=json.dumps(runs), capture_output=True,
                            text=True, timeout=300, env=_environment(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_describe_lists_each_mindspeed_flag_with_its_answer(ran):
    accepted = ran[0]
    assert accepted["code"] == 0, accepted["stderr"][-3000:]
    section = accepted["stdout"].split("MindSpeed's flags")[1].split("\n\n")[0]
    assert "noop    --use-ascend-mc2 (MindSpeed's): accepted" in section
    assert "mapped  --npu-deterministic (MindSpeed's) -> --deterministic-mode" in section
    assert "mapped  --swap-modules input_norm,self_attention (MindSpeed's) -> --swap-modules layernorm self_attn" \
        in section
    assert "same    --swap-attention" in section and "same    --context-parallel-algo megatron_cp_algo" in section
    assert "megatron's own argument checks (validate_args): passed" in accepted["stdout"]


def test_a_refused_flag_ends_describe_and_a_training_run_alike(ran):
    for outcome in ran[1:]:
        assert outcome["code"] == 2, outcome
        assert_refused(outcome["code"], outcome["stdout"], outcome["stderr"], "--reuse-fp32-param")
        assert "unrecognized arguments" not in outcome["stderr"]
    assert "pretrain_gpt.py: error: --reuse-fp32-param (MindSpeed's) cannot run here" in ran[2]["stderr"]
