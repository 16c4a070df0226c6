"""``python -m hyper_adaptor dry-run``: the table (one subprocess, as a user runs it), the step time and its
calibration, and bad input (in-process: each must end in one line naming the flag, exit status 2).

No test measures the machine: every one reads a fixed calibration from a temporary cache
(``HYPER_ADAPTOR_CACHE``), and ``calibrate.measure`` fails the test if called unless the test replaces it."""

import dataclasses
import os
import re
import socket
import subprocess
import sys

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401  (level 0 first: megatron imports on CPU)
from hyper_adaptor import cli
from hyper_adaptor.dryrun import calibrate, timing

REAL_MEASURE = calibrate.measure

MODEL = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 256 --seq-length 32 "
         "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 "
         "--tokenizer-type NullTokenizer --vocab-size 257").split()


def fixed_calibration(**changes) -> calibrate.Calibration:
    """This machine as a cache would describe it, with round figures: 10 GFLOP/s matmuls, 10 GB/s memory, a
    1 ms layer, a 100 us link of 1 GB/s, 64 cores (no ranks-per-core stretch)."""
    import torch

    cal = calibrate.Calibration(
        device="cpu", host=socket.gethostname(), machine=calibrate.machine_id("cpu"),
        torch_version=torch.__version__, threads=1, cores=64, matmul={"float32": [[16.0, 1e10], [512.0, 1e10]]},
        memory_bytes_per_s=1e10, layer_overhead_s=1e-3,
        collectives={op: {"latency_s": 1e-4, "bytes_per_s": 1e9} for op in calibrate.COLLECTIVES},
        created="2026-11-01T10:00:00Z", seconds=40.0)
    return dataclasses.replace(cal, **changes)


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """A temporary cache holding :func:`fixed_calibration`; measuring is an error."""
    monkeypatch.setenv(calibrate.CACHE_ENV, str(tmp_path))
    calibrate.save(fixed_calibration())

    def no_measuring(device, quick=False):
        raise AssertionError("a unit test measured the machine")

    monkeypatch.setattr(calibrate, "measure", no_measuring)
    return tmp_path


def step_table(out: str) -> dict[str, float]:
    """The step-time table of the report: part -> ms."""
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("step time (ms"))
    return dict(zip(lines[at + 1].split(), map(float, lines[at + 2].split()), strict=True))


def cli_args(flags):
    """The namespace the dry-run predicts from."""
    from hyper_adaptor.dryrun import parse

    return parse(flags)


def test_the_table_groups_ranks_and_says_what_to_cut(cache):
    flags = [*MODEL, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--world-size", "8",
             "--device-memory", "0.001"]
    result = subprocess.run([sys.executable, "-m", "hyper_adaptor", "dry-run", *flags], capture_output=True,
                            text=True, timeout=120, env={**os.environ, calibrate.CACHE_ENV: str(cache)})
    assert result.returncode == 1, result.stderr            # does not fit: exit status 1
    out = result.stdout
    assert "TP 2 x PP 2 x CP 1 x DP 2" in out and "megatron's 1F1B" in out
    lines = [line.split() for line in out.splitlines() if line.strip().startswith("ranks ")]
    assert [line[1] for line in lines[1:]] == ["0-3", "4-7"]   # header, then the two pipeline stages
    assert lines[0][1:] == ["params", "grads", "main", "optim", "activ", "logits", "comm", "transient", "peak",
                            "host"]
    assert "does not fit in 0.001 GiB" in out and "largest part is activations" in out
    assert "--recompute-granularity full" in out
    # then the step time, from the cached calibration (the subprocess measured nothing: no "calibrating" line)
    parts = step_table(out)
    assert list(parts) == [*timing.PARTS, "total"]
    assert parts["compute"] > 0 and parts["tp_comm"] > 0 and parts["bubble"] > 0 and parts["cp_comm"] == 0
    assert "bubble: 33.3% of the pipeline's time (1f1b)" in out    # (PP - 1) / (m + PP - 1), m = 2
    assert "calibration: measured on this machine" in out and "2026-11-01T10:00:00Z" in out
    assert str(cache) in out and "calibrating" not in out


def test_step_time_is_the_models_with_its_parts(capsys):
    flags = [*MODEL, "--world-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
    assert cli.main(["dry-run", *flags]) == 0
    out = capsys.readouterr().out
    parts = step_table(out)
    expected = timing.predict_time(cli_args(flags), fixed_calibration())
    assert parts["total"] == pytest.approx(expected.total * 1e3, abs=0.01)
    assert parts["recompute"] == pytest.approx(expected.parts["recompute"] * 1e3, abs=0.01) and parts["recompute"] > 0
    assert parts["dp_comm"] > 0
    assert sum(v for k, v in parts.items() if k != "total") == pytest.approx(parts["total"], abs=0.1)
    assert "bubble: none (one pipeline stage)" in out
    assert "step time (ms; predicted for the slowest pipeline rank, 2 micro-batches)" in out


def test_no_time_prints_memory_only_and_measures_nothing(capsys, cache):
    (cache / calibrate.cache_path("cpu").name).unlink()   # no cache: anything but --no-time would measure
    assert cli.main(["dry-run", *MODEL, "--world-size", "1", "--no-time"]) == 0
    out = capsys.readouterr().out
    assert "memory per rank" in out
    assert "step time" not in out and "calibrat" not in out


def test_first_run_says_it_calibrates_before_measuring_then_reads_the_cache(capsys, cache, monkeypatch):
    path = calibrate.cache_path("cpu")
    path.unlink()
    printed_before = []

    def measuring(device, quick=False):
        printed_before.append(capsys.readouterr().out)
        return fixed_calibration(created="2026-11-27T14:00:00Z")

    monkeypatch.setattr(calibrate, "measure", measuring)
    assert cli.main(["dry-run", *MODEL, "--world-size", "1"]) == 0
    assert len(printed_before) == 1
    assert f"calibrating this machine's cpu once (about a minute; --no-time skips it), cached in " \
           f"{path}" in printed_before[0]
    assert path.exists() and "2026-11-27T14:00:00Z" in capsys.readouterr().out
    assert cli.main(["dry-run", *MODEL, "--world-size", "1"]) == 0   # cached: not measured, nothing said
    assert len(printed_before) == 1 and "calibrating" not in capsys.readouterr().out


def test_an_absent_accelerator_is_priced_on_assumed_figures_and_says_so(capsys, monkeypatch):
    # the real measure, on a machine without the device: it refuses before measuring anything
    monkeypatch.setattr(calibrate, "measure", REAL_MEASURE)
    monkeypatch.setattr(calibrate, "available", lambda device: device == "cpu")
    assert cli.main(["dry-run", *MODEL, "--world-size", "2", "--device", "cuda", "--bf16"]) == 0
    out = capsys.readouterr().out
    assert "calibrating" not in out
    assert "calibration: ASSUMED, not measured: this machine has no cuda device" in out
    nominal = timing.predict_time(cli_args([*MODEL, "--world-size", "2", "--bf16"]), calibrate.nominal("cuda"))
    assert step_table(out)["total"] == pytest.approx(nominal.total * 1e3, abs=0.01)


def test_a_calibration_that_fails_leaves_the_memory_report(capsys, cache, monkeypatch):
    (cache / calibrate.cache_path("cpu").name).unlink()

    def failing(device, quick=False):
        raise RuntimeError("the calibration world did not start")

    monkeypatch.setattr(calibrate, "measure", failing)
    assert cli.main(["dry-run", *MODEL, "--world-size", "1", "--device-memory", "1"]) == 0
    out = capsys.readouterr().out
    assert "fits in 1 GiB" in out
    assert re.search(r"^step time: not predicted \(the calibration world did not start\)", out, re.M)


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
