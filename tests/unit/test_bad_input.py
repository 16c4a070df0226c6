"""Bad input ends in one paragraph naming the flag or variable: non-zero exit, no traceback, and not
buried under megatron's usage line of every flag.

The command lines go through ``python -m hyper_adaptor describe``'s own code, many to one process
(importing megatron costs seconds; each describe call then costs little); what only the import line
sees (environment variables, ``--device-type``) gets a process each, and a real training script
(examples/pretrain_gpt.py) is run on a few lines as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
         "--micro-batch-size 1").split()
L1 = ("--optimization-level", "1")
# how argparse lists a flag in a usage line: present only when megatron's whole usage text is printed
FULL_USAGE_MARK = "[--num-layers NUM_LAYERS]"


def case(flags: str, named: str, *extra: str, env: dict | None = None):
    return pytest.param((*extra, *flags.split()), named, env or {}, id=flags or str(env))


BAD = [
    # wrong types and choices (argparse, with a one-line usage)
    case("--micro-batch-size x", "--micro-batch-size"),
    case("--tensor-model-parallel-size 1.5", "--tensor-model-parallel-size"),
    case("--optimization-level 9", "--optimization-level"),
    case("--optimization-level x", "--optimization-level"),
    case("--fused-backend cuda", "--fused-backend"),
    case("--pipeline-schedule bogus", "--pipeline-schedule"),
    case("--context-parallel-algo bogus", "--context-parallel-algo"),
    case("--normalization Foo", "--normalization"),
    case("--no-such-flag", "--no-such-flag"),
    case("--lr abc", "--lr"),
    case("--seq-length", "--seq-length"),
    case("--world-size 0", "--world-size"),
    case("--world-size x", "--world-size"),
    case("--profile --profile-ranks x", "--profile-ranks"),
    case("--hsdp-shard-size x", "--hsdp-shard-size"),
    # numbers out of range
    case("--micro-batch-size 0", "--micro-batch-size"),
    case("--micro-batch-size -1", "--micro-batch-size"),
    case("--tensor-model-parallel-size 0", "--tensor-model-parallel-size"),
    case("--pipeline-model-parallel-size 0 --pipeline-schedule 1f1b", "--pipeline-model-parallel-size"),
    case("--context-parallel-size 0", "--context-parallel-size"),
    case("--context-parallel-size -2", "--context-parallel-size"),
    case("--expert-model-parallel-size 0", "--expert-model-parallel-size"),
    case("--num-layers 0", "--num-layers"),
    case("--num-attention-heads 0", "--num-attention-heads"),
    case("--hidden-size 0", "--hidden-size", *MODEL),
    case("--seq-length 0", "--seq-length"),
    case("--global-batch-size 0", "--global-batch-size"),
    case("--train-iters 0", "--train-iters"),
    case("--log-interval 0", "--log-interval"),
    case("--eval-iters -1", "--eval-iters"),
    case("--seed -1", "--seed"),
    case("--lr nan", "--lr"),
    case("--lr inf", "--lr"),
    case("--lr -0.1", "--lr"),
    case("--min-lr nan", "--min-lr"),
    case("--clip-grad -1", "--clip-grad"),
    case("--weight-decay nan", "--weight-decay"),
    case("--adam-beta1 1.5", "--adam-beta1"),
    case("--adam-beta2 1", "--adam-beta2"),
    case("--adam-eps 0", "--adam-eps"),
    case("--hidden-dropout 1.5", "--hidden-dropout"),
    case("--attention-dropout -0.1", "--attention-dropout"),
    case("--init-method-std nan", "--init-method-std"),
    # sizes that do not divide (given, or the world describe assumes)
    case("--tensor-model-parallel-size 3", "--tensor-model-parallel-size", *MODEL),
    case("--num-layers 3 --pipeline-model-parallel-size 2", "--pipeline-model-parallel-size", *MODEL),
    case("--world-size 3 --tensor-model-parallel-size 2", "--world-size"),
    case("--global-batch-size 3 --world-size 2", "--global-batch-size", *MODEL),
    case("--global-batch-size 5 --micro-batch-size 2", "--global-batch-size", *MODEL),
    case("--group-query-attention --num-query-groups 3 --tensor-model-parallel-size 2", "--num-query-groups", *MODEL),
    case("--seq-length 33 --max-position-embeddings 33 --context-parallel-size 2", "--seq-length", *MODEL),
    case("--profile --profile-ranks 3", "--profile-ranks"),  # describe assumed one process, and says so
    case("--profile --profile-ranks 4 --world-size 4", "--profile-ranks"),
    case("--use-hsdp --hsdp-shard-size 3 --world-size 4", "--hsdp-shard-size"),
    case("--use-hsdp --hsdp-shard-size 0", "--hsdp-shard-size"),
    case("--num-experts 4 --moe-router-topk 5", "--moe-router-topk", *MODEL),
    case("--ffn-hidden-size 100 --tensor-model-parallel-size 8 --num-attention-heads 8", "--ffn-hidden-size", *MODEL),
    case("--sequence-parallel --tensor-model-parallel-size 2 --seq-length 33 --max-position-embeddings 33",
         "--seq-length", *MODEL),
    case("--num-experts 4 --expert-model-parallel-size 3 --world-size 3", "--expert-model-parallel-size", *MODEL),
    # megatron's own validate_args
    case("--seq-length 64", "--max-position-embeddings", *MODEL),
    case("--hidden-size 66", "--hidden-size", *MODEL),
    case("--fp16 --bf16", "--bf16", *MODEL),
    case("--lr 0.1 --min-lr 1", "--min-lr", *MODEL),
    case("--train-iters 10 --train-samples 100", "--train-samples", *MODEL),
    case("--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 3",
         "--num-layers-per-virtual-pipeline-stage", *MODEL),
    case("--use-distributed-optimizer --use-torch-fsdp2", "--use-distributed-optimizer", *MODEL),
    case("--fp16-lm-cross-entropy", "--fp16", *MODEL),
    case("--fp32-residual-connection", "--fp16", *MODEL),
    case("--encoder-num-layers 2", "--encoder-num-layers", *MODEL),
    case("--ckpt-convert-format torch", "--ckpt-convert-save", *MODEL),
    # conflicts the features refuse
    case("--use-fused-swiglu", "--use-fused-swiglu", *L1),
    case("--use-fused-rmsnorm", "--use-fused-rmsnorm", *L1),
    case("--use-fused-rotary-pos-emb --position-embedding-type learned_absolute", "--use-fused-rotary-pos-emb", *L1),
    case("--fused-backend npu", "--fused-backend", *L1),
    case("--profile --profile-step-start 5 --profile-step-end 3", "--profile-step-end"),
    case("--profile --profile-with-memory", "--profile-with-memory"),
    case("--use-hsdp --hsdp-threshold-kb -1", "--hsdp-threshold-kb"),
    case("--context-parallel-size 2 --context-parallel-algo hybrid --ulysses-degree-in-cp 3", "--ulysses-degree-in-cp"),
    case("--use-hsdp --hsdp-bucket-size-kb nan", "--hsdp-bucket-size-kb"),
    case("--use-hsdp --hsdp-bucket-size-kb inf", "--hsdp-bucket-size-kb"),
    case("--use-hsdp --hsdp-threshold-kb nan", "--hsdp-threshold-kb"),
    case("--fine-grained-activation-offloading", "--offload-modules"),
    case("--moe-dispatcher-engine bogus", "--moe-dispatcher-engine"),
    case("--moe-dispatch-chunks x", "--moe-dispatch-chunks"),
    case("--num-experts 4 --moe-dispatcher-engine hyper", "--moe-token-dispatcher-type", *MODEL),
    case("--num-experts 4 --moe-token-dispatcher-type alltoall --moe-dispatcher-engine hyper "
         "--moe-dispatch-chunks 2 --overlap-moe-expert-parallel-comm", "--overlap-moe-expert-parallel-comm", *MODEL),
    case("--num-experts 4 --moe-token-dispatcher-type alltoall --moe-dispatcher-engine hyper --moe-dispatch-chunks 0",
         "--moe-dispatch-chunks", *MODEL),
    # environment variables describe reads when it runs
    case("--profile --profile-ranks 5", "--profile-ranks", env={"WORLD_SIZE": "4"}),
    case("--tensor-model-parallel-size 2", "WORLD_SIZE", env={"WORLD_SIZE": "3"}),
]
GOOD = [
    case("", ""),
    case("--help", ""),  # megatron 0.19's own help texts hold a bare "%", which argparse formats
    case("--profile --profile-ranks 3 --world-size 4", ""),
    case("--profile --profile-ranks 3", "", env={"WORLD_SIZE": "4"}),
    case("--tensor-model-parallel-size 2 --world-size 4", "", *MODEL),
    case("--use-hsdp --hsdp-shard-size 2 --world-size 4", "", *MODEL),
    case("--pipeline-model-parallel-size 2 --pipeline-schedule 1f1b --world-size 2", "", *MODEL),
    case("--global-batch-size 8 --world-size 2 --context-parallel-size 2 --attention-dropout 0", "", *MODEL),
    case("--num-experts 4 --moe-token-dispatcher-type alltoall --moe-dispatcher-engine hyper "
         "--expert-model-parallel-size 2 --world-size 2", "", *MODEL),
]

# One process runs every describe line: exit status and output of each, as JSON on the last line.
RUNNER = r"""
import contextlib, io, json, os, sys, traceback
import torch
from hyper_adaptor import cli
results = []
for flags, env in json.loads(sys.stdin.read()):
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(["describe", *flags])
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""


def _environment(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYPER_ADAPTOR_")
           and k not in ("WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def described():
    """{(flags, env): result} for every line of BAD and GOOD, from one process."""
    lines = [p.values[0] for p in BAD + GOOD]
    envs = [p.values[2] for p in BAD + GOOD]
    result = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(list(zip(lines, envs, strict=True))),
                            capture_output=True, text=True, timeout=300, env=_environment(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    results = json.loads(result.stdout.strip().splitlines()[-1])
    return {(line, json.dumps(env)): r for line, env, r in zip(lines, envs, results, strict=True)}


def assert_refused(code, stdout: str, stderr: str, named: str) -> None:
    both = stdout + stderr
    assert code not in (0, None), both[-2000:]
    assert "Traceback" not in both and code != "raised", both[-3000:]
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, stderr[-2000:]
    assert named in errors[0], errors[0]
    assert FULL_USAGE_MARK not in stderr, "megatron's whole usage text precedes the error"
    assert all(len(line) < 200 for line in stderr.splitlines() if line.startswith("usage:")), stderr[:2000]


@pytest.mark.parametrize("flags, named, env", BAD)
def test_a_bad_line_ends_in_one_error_naming_the_flag(described, flags, named, env):
    result = described[(flags, json.dumps(env))]
    assert_refused(result["code"], result["stdout"], result["stderr"], named)


@pytest.mark.parametrize("flags, named, env", GOOD)
def test_a_good_line_is_described(described, flags, named, env):
    result = described[(flags, json.dumps(env))]
    assert result["code"] == 0, result["stderr"][-3000:]
    assert "Traceback" not in result["stderr"]


def test_there_are_enough_lines():
    assert len(BAD) >= 60 and len(GOOD) >= 5


def test_describe_says_which_world_it_checked(described):
    given = described[((*MODEL, "--tensor-model-parallel-size", "2", "--world-size", "4"), "{}")]["stdout"]
    assert "world size 4 (--world-size), data-parallel size 2" in given
    assert "megatron's own argument checks (validate_args): passed" in given
    bare = described[((), "{}")]["stdout"]
    assert "world size 1 assumed" in bare and "--profile-ranks" in bare
    assert "validate_args): not made, they need --micro-batch-size" in bare
    refused = described[(("--profile", "--profile-ranks", "3"), "{}")]["stderr"]
    assert "describe assumed a world size of 1" in refused and "--world-size N" in refused


# ------------------------------------------------ what only the import line sees: a process each

# a process each (the device is chosen, and the variables read, once per process): through describe
# and through the one-line import of a script
IMPORT_LINE = [
    (("-m", "hyper_adaptor", "describe", "--device-type", "tpu"), {}, "--device-type"),
    (("-m", "hyper_adaptor", "describe"), {"HYPER_ADAPTOR_DEVICE": "tpu"}, "HYPER_ADAPTOR_DEVICE"),
    (("-m", "hyper_adaptor", "describe"), {"HYPER_ADAPTOR_OPS_BACKEND": "npu"}, "HYPER_ADAPTOR_OPS_BACKEND"),
    (("-m", "hyper_adaptor", "describe"), {"HYPER_ADAPTOR_OPTIMIZATION_LEVEL": "9"},
     "HYPER_ADAPTOR_OPTIMIZATION_LEVEL"),
    (("-m", "hyper_adaptor", "describe"), {"WORLD_SIZE": "abc"}, "WORLD_SIZE"),
    (("-c", "import torch, hyper_adaptor.megatron_adaptor", "--device-type", "CPU"), {}, "--device-type"),
    (("-c", "import torch, hyper_adaptor.megatron_adaptor"), {"HYPER_ADAPTOR_OPS_BACKEND": "bogus"},
     "HYPER_ADAPTOR_OPS_BACKEND"),
]
if not torch.cuda.is_available():
    IMPORT_LINE.append((("-m", "hyper_adaptor", "describe", "--device-type", "cuda"), {}, "--device-type"))


def _run(argv, env):
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=180,
                          env=_environment(**env), cwd=ROOT)


def test_the_import_line_refuses_bad_variables_and_devices():
    """Exit status 2 and one paragraph, as argparse's, before megatron is imported."""
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda run: _run(run[0], run[1]), IMPORT_LINE))
    for (argv, env, named), result in zip(IMPORT_LINE, results, strict=True):
        assert result.returncode == 2, (argv, env, result.stderr[-2000:])
        assert_refused(result.returncode, result.stdout, result.stderr, named)
        assert "megatron" not in result.stderr.lower(), result.stderr  # refused before it was imported


@pytest.mark.parametrize("env, named", [
    ({"HYPER_ADAPTOR_DEVICE": "GPU"}, "HYPER_ADAPTOR_DEVICE"),
    ({"HYPER_ADAPTOR_OPS_BACKEND": "Fast"}, "HYPER_ADAPTOR_OPS_BACKEND"),
    ({"HYPER_ADAPTOR_OPTIMIZATION_LEVEL": "two"}, "HYPER_ADAPTOR_OPTIMIZATION_LEVEL"),
    ({"HYPER_ADAPTOR_ALLOW_MEGATRON_VERSION": ""}, "HYPER_ADAPTOR_ALLOW_MEGATRON_VERSION"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE"),
    ({"RANK": "-1"}, "RANK"),
    ({"WORLD_SIZE": "2", "RANK": "4"}, "RANK"),
])
def test_every_variable_is_checked(env, named):
    """The same check the import line runs (a process each is what the test above pays for)."""
    from hyper_adaptor import environment

    with pytest.raises(environment.EnvironmentConfigError, match=named):
        environment.check(env)


def test_good_variables_pass_and_an_unread_one_is_said():
    from hyper_adaptor import environment

    good = {"HYPER_ADAPTOR_DEVICE": "cpu", "HYPER_ADAPTOR_OPS_BACKEND": "eager", "WORLD_SIZE": "4", "RANK": "3",
            "HYPER_ADAPTOR_OPTIMIZATION_LEVEL": "0", "HYPER_ADAPTOR_ALLOW_MEGATRON_VERSION": "any"}
    assert environment.check(good) == []
    said = environment.check({"HYPER_ADAPTOR_DEVCE": "cpu"})
    assert len(said) == 1 and "HYPER_ADAPTOR_DEVCE is not a variable hyper_adaptor reads" in said[0]
    with pytest.raises(environment.EnvironmentConfigError, match="HYPER_ADAPTOR_OPS_BACKEND=npu"):
        environment.check_for_device("cpu", {"HYPER_ADAPTOR_OPS_BACKEND": "npu"})


# ------------------------------------------------ a real training script: the same errors, before any process group

SCRIPT_RUNNER = r"""
# items: ("script", flags) runs examples/pretrain_gpt.py, ("describe", flags) python -m hyper_adaptor describe
import contextlib, io, json, runpy, sys, traceback
import torch
import hyper_adaptor.megatron_adaptor
from hyper_adaptor import cli
results = []
for kind, flags in json.loads(sys.stdin.read()):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if kind == "describe":
                code = cli.main(["describe", *flags])
            else:
                sys.argv = ["pretrain_gpt.py", *flags]
                runpy.run_path("examples/pretrain_gpt.py", run_name="__main__")
                code = 0
        except SystemExit as exit:
            code = exit.code
        except BaseException:
            traceback.print_exc()
            code = "raised"
    results.append({"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()})
print(json.dumps(results))
"""
SCRIPT_LINES = [
    (("--micro-batch-size", "x"), "--micro-batch-size"),
    (("--micro-batch-size", "0"), "--micro-batch-size"),
    (("--num-layers", "3", "--pipeline-model-parallel-size", "2"), "--pipeline-model-parallel-size"),
    (("--tensor-model-parallel-size", "3"), "--tensor-model-parallel-size"),
    (("--use-fused-swiglu", "--optimization-level", "1"), "--use-fused-swiglu"),
    (("--lr", "nan"), "--lr"),
]


def test_a_training_script_refuses_the_same_lines():
    lines = [("script", [*MODEL, "--mock-data", "--train-iters", "1", *flags]) for flags, _ in SCRIPT_LINES]
    result = subprocess.run([sys.executable, "-c", SCRIPT_RUNNER], input=json.dumps(lines), capture_output=True,
                            text=True, timeout=300, env=_environment(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    outcomes = json.loads(result.stdout.strip().splitlines()[-1])
    for (flags, named), outcome in zip(SCRIPT_LINES, outcomes, strict=True):
        assert outcome["code"] == 2, (flags, outcome)
        assert_refused(outcome["code"], "", outcome["stderr"], named)
        assert "pretrain_gpt.py: error:" in outcome["stderr"]
