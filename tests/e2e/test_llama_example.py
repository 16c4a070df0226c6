"""End to end: examples/llama/train.py on 4 forked CPU ranks (torchrun's environment): TP2 x DP2 with HSDP level 3 for
two steps saving a torch.distributed.checkpoint, then resumed at TP1 x DP4 (level 1) for one more; every
printed loss equals the whole model trained in this process (the example's own batches). Bad flags are
usage errors naming the flag."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_adaptor.testing import free_port

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = "examples/llama/train.py"
STEP = re.compile(r"^step (\d+) loss ([0-9.]+)$", re.M)
SMALL = ["--batch", "4", "--seq", "8"]  # tests/distributed/one_mesh_checks.py's reference batch


def torchrun(*args, timeout=240):
    command = [sys.executable, "-m", "hyper_adaptor.testing.launch", "--nproc-per-node", "4",
               "--master-port", str(free_port()), SCRIPT, *SMALL, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return {int(i): float(v) for i, v in STEP.findall(result.stdout)}, output


def test_train_save_at_tp2_dp2_resume_at_tp1_dp4(tmp_path):
    from hyper_adaptor.testing.llama import LlamaConfig
    from tests.distributed.one_mesh_checks import reference

    ref = reference(LlamaConfig(), steps=3)["losses"]
    ckpt = str(tmp_path / "ckpt")
    first, _ = torchrun("--tp", "2", "--hsdp-level", "3", "--steps", "2", "--checkpoint-dir", ckpt)
    assert sorted(first) == [1, 2]
    second, output = torchrun("--tp", "1", "--hsdp-level", "1", "--steps", "1", "--checkpoint-dir", ckpt)
    assert "loaded" in output and sorted(second) == [3]
    for step, loss in {**first, **second}.items():
        assert abs(loss - ref[step - 1]) <= 2e-6 * max(1.0, ref[step - 1]), (step, loss, ref[step - 1])


def test_bad_flags_are_usage_errors():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, SCRIPT, "--tp", "3"], cwd=ROOT, capture_output=True, text=True,
                            timeout=120, env=dict(env, PYTHONPATH=str(ROOT)))
    assert result.returncode == 2 and "--tp 3 must equal the world size 1" in result.stderr, result.stderr[-2000:]


@pytest.mark.parametrize("changes, words", [
    (dict(tp=3), "--tp 3 must equal the world size 4"),
    (dict(tp=4, pp=1), "--tp 4 must divide --kv-heads 2"),
    (dict(hsdp_level=4), "--hsdp-level must be 0, 1, 2 or 3"),
    (dict(dp_shard=3), "--dp-shard must be -1 or a divisor of dp x cp = 4"),
    (dict(schedule="nope"), "--schedule must be one of"),
    (dict(memory="disk"), "--memory must be one of"),
    (dict(cp_algo="x"), "--cp-algo must be one of"),
    (dict(sequence_parallel=True), "--sequence-parallel needs --tp > 1"),
    (dict(pp=4, dp=1, schedule="interleaved"), "needs 8 stages; the model has 2 layers"),
    (dict(pp=2, dp=2, schedule="zbh1", hsdp_level=1), "--schedule zbh1 defers weight gradients"),
])
def test_bad_layouts_name_the_flag(changes, words):
    from hyper_adaptor.testing.llama import LlamaConfig
    from tests.distributed.one_mesh_checks import _example

    example = _example()
    layout = dict(dp=4)
    layout.update(changes)
    if "tp" in changes and "dp" not in changes:
        layout["dp"] = 4 // changes["tp"] if 4 % changes["tp"] == 0 else 1
    with pytest.raises(ValueError, match=re.escape(words)):
        example.ParallelConfig(**layout).validate(4, LlamaConfig())


def test_zero_bubble_v_schedule_under_tensor_parallel_trains_the_one_process_model():
    """PP2 x TP2 under ZBV (two stages per rank in a V, weight gradients deferred): every loss is the whole
    model's in one process (the one-mesh world checks 1F1B and interleaved the same way)."""
    from hyper_adaptor.testing.llama import LlamaConfig
    from tests.distributed.one_mesh_checks import reference

    ref = reference(LlamaConfig(n_layers=4), steps=2)["losses"]
    losses, _ = torchrun("--pp", "2", "--tp", "2", "--schedule", "zbv", "--layers", "4", "--steps", "2")
    assert sorted(losses) == [1, 2]
    for step, loss in losses.items():
        assert abs(loss - ref[step - 1]) <= 2e-6 * max(1.0, ref[step - 1]), (step, loss, ref[step - 1])
