"""examples/hyperparallel/: HyperParallel's usage examples run as written, on 2 forked CPU ranks with
torchrun's environment (hyper_adaptor/testing/launch.py)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_adaptor.testing import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step (\d+) loss ([0-9.eE+-]+)(?: single-process ([0-9.eE+-]+))?$", re.M)


def run_example(name: str, *args: str, nproc: int = 2, timeout: int = 240) -> list[tuple]:
    command = [sys.executable, "-m", "hyper_adaptor.testing.launch", "--nproc-per-node", str(nproc),
               "--master-port", str(free_port()), f"examples/hyperparallel/{name}", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} did not finish in {timeout} s:\n{(e.stdout or b'')[-3000:]}\n{(e.stderr or b'')[-3000:]}")
    assert done.returncode == 0, f"{name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    steps = [(int(s), float(a), float(b) if b else None) for s, a, b in STEP.findall(done.stdout)]
    assert steps, f"{name} printed no losses:\n{done.stdout[-3000:]}"
    return steps


def test_hsdp_example_trains():
    steps = run_example("hsdp_example.py", "--steps", "4")
    losses = [loss for _, loss, _ in steps]
    assert [s for s, _, _ in steps] == [0, 1, 2, 3]
    assert losses[-1] < 0.8 * losses[0], losses


def test_pipeline_example_trains_with_1f1b_and_gpipe_alike():
    one_f_one_b = run_example("pipeline_example.py", "--steps", "3")
    gpipe = run_example("pipeline_example.py", "--steps", "3", "--schedule", "gpipe")
    losses = [loss for _, loss, _ in one_f_one_b]
    assert len(losses) == 3 and losses[-1] < losses[0], losses
    # the schedule orders the same computations differently: the losses agree
    assert losses == pytest.approx([loss for _, loss, _ in gpipe], rel=1e-5)


def test_layout_example_matches_one_process():
    steps = run_example("layout_example.py", "--steps", "3")
    assert len(steps) == 3
    for _, sharded, single in steps:
        assert sharded == pytest.approx(single, rel=1e-5, abs=1e-6)
