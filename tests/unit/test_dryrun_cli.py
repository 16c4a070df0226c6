"""``python -m hyper_adaptor dry-run``: the table (one subprocess, as a user runs it) and bad input (in-process:
each must end in one line naming the flag, exit status 2)."""

import subprocess
import sys

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)
from hyper_adaptor import cli

MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 "
         "--tokenizer-type NullTokenizer --vocab-size 257").split()


def test_the_table_groups_ranks_and_says_what_to_cut():
    flags = [*MODEL, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--world-size", "8",
             "--device-memory", "0.001"]
    result = subprocess.run([sys.executable, "-m", "hyper_adaptor", "dry-run", *flags], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 1, result.stderr            # does not fit: exit status 1
    out = result.stdout
    assert "TP 2 x PP 2 x CP 1 x DP 2" in out and "megatron's 1F1B" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("ranks ")]
    assert [line[1] for line in lines[1:]] == ["0-3", "4-7"]   # header, then the two pipeline stages
    assert lines[0][1:] == ["params", "grads", "main", "optim", "activ", "logits", "comm", "transient", "peak",
                            "host"]
    assert "does not fit in 0.001 GiB" in out and "largest part is activations" in out
    assert "--recompute-granularity full" in out


def test_it_fits(capsys):
    assert cli.main(["dry-run", *MODEL, "--world-size", "1", "--device-memory", "1"]) == 0
    assert "fits in 1 GiB" in capsys.readouterr().out


@pytest.mark.parametrize("flags, named", [
    (["--world-size", "3", "--tensor-model-parallel-size", "2"], "world size 3"),
    (["--world-size", "2", "--device", "tpu"], "--device"),
    (["--world-size", "2", "--device-memory", "-1"], "--device-memory"),
    (["--tensor-model-parallel-size", "2"], "--world-size"),
    (["--world-size", "2", "--no-such-flag"], "--no-such-flag"),
])
def test_bad_input_is_one_line_naming_it(capsys, flags, named):
    with pytest.raises(SystemExit) as ended:
        cli.main(["dry-run", *MODEL, *flags])
    assert ended.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("hyper_adaptor dry-run: error:") and named in err
    assert "Traceback" not in err


def test_missing_model_flags_are_named(capsys):
    with pytest.raises(SystemExit) as ended:
        cli.main(["dry-run", "--num-layers", "2", "--world-size", "1"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "--hidden-size" in err and "--num-attention-heads" in err


def test_help_lists_dry_run(capsys):
    assert cli.main(["--help"]) == 0
    assert "dry-run" in capsys.readouterr().out
