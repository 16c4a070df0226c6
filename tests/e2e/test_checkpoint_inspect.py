"""``python -m hyper_adaptor checkpoint inspect`` on a real checkpoint (the shared TP2 x PP2 run of
tests/e2e/conftest.py: megatron's DDP, saved at iterations 3 and 6), and a training run refused at
start-up, before it builds anything, for a transition that cannot work.

The transitions that do work are resumed and compared in the transition matrix; the rules themselves
are tests/unit/test_checkpoint_layout.py's."""

import io
import json
import subprocess
import sys

import pytest

from hyper_adaptor.testing import free_port
from tests.e2e.test_pretrain_gpt import MODEL, ROOT

pytestmark = pytest.mark.e2e


def test_inspect_the_tp2_pp2_checkpoint(tp2_pp2_run):
    ckpt, _, _ = tp2_pp2_run
    sidecar = json.loads((ckpt / "iter_0000006" / "hyper_adaptor.json").read_text())
    assert sidecar["versions"]["megatron_core"] == "0.19.2" and "determinism" in sidecar["features"]
    assert (ckpt / "iter_0000003" / "hyper_adaptor.json").is_file()

    # the command as a user runs it: the record, then the answer for another layout that can load it
    target = [*MODEL, "--tensor-model-parallel-size", "2", "--use-hsdp", "--hsdp-optimizer-level", "level3",
              "--world-size", "4"]
    done = subprocess.run([sys.executable, "-m", "hyper_adaptor", "checkpoint", "inspect", str(ckpt), "--", *target],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line.strip() for line in done.stdout.splitlines()]
    assert f"checkpoint {ckpt / 'iter_0000006'}" in lines
    assert "iteration        6" in lines
    assert "saved at         TP2 PP2 (1f1b) DP1 (world 4)" in lines
    assert "optimizer state  adam, held by megatron's DDP (model space)" in lines
    assert "versions         hyper_adaptor 0.1.0, megatron-core 0.19.2" in lines
    assert any(line.startswith("features") and "determinism" in line for line in lines), lines
    assert "this command line: TP2 PP1 DP2 with HSDP level3" in lines
    assert lines[-1] == "can load: yes (model and optimizer state)"

    # the same check, in process: another iteration, and a layout that cannot load it: at TP1 megatron pads
    # the vocabulary (257) to a multiple of 128, at TP2 of 256, so the embedding has another shape
    from hyper_adaptor import checkpoint_cli

    out = io.StringIO()
    assert checkpoint_cli.inspect([str(ckpt), "--ckpt-step", "3", "--", *MODEL, "--use-distributed-optimizer",
                                   "--world-size", "2"], out=out) == 2
    text = out.getvalue()
    assert "iteration        3" in text and "can load: no" in text
    assert (f"--make-vocab-size-divisible-by: checkpoint {ckpt / 'iter_0000003'} holds a vocabulary padded to 512 "
            f"rows (TP2), this run pads it to 384") in text


def test_a_run_that_cannot_load_the_checkpoint_is_refused_before_it_builds(tp2_pp2_run):
    ckpt, _, _ = tp2_pp2_run
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(free_port()), "examples/pretrain_gpt.py", *MODEL, "--mock-data", "--train-iters", "7",
               "--load", str(ckpt)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert (f"pretrain_gpt.py: error: --load: --make-vocab-size-divisible-by: checkpoint {ckpt / 'iter_0000006'} "
            f"holds a vocabulary padded to 512 rows (TP2), this run pads it to 384") in output, output
    # refused at the argument checks: no model was built, nothing was loaded, no traceback of a rank
    assert "number of parameters" not in output and "loading checkpoint" not in output.lower()
    assert "[rank0]: Traceback" not in output
