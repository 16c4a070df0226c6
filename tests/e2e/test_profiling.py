"""End to end: ``--profile`` on forked ranks of examples/pretrain_gpt.py (mock data, the tiny MODEL).

MindSpeed's spelling on 4 ranks (TP2 x PP2): one trace for each chosen rank only, holding exactly the
steps [start, end) (torch's ``ProfilerStep#<step>`` markers), with shapes; the summary printed by each
profiled rank. Megatron's spelling (``--profile --use-pytorch-profiler`` with its shape flag and
``--tensorboard-dir``): the same profiler, in megatron's place. Without ``--profile`` nothing is
written; a bad flag stops the run before its first iteration.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.e2e.test_pretrain_gpt import pretrain

pytestmark = pytest.mark.e2e
DATA = ("--mock-data", "--num-workers", "0")


def trace(path: Path) -> list[dict]:
    return json.loads(path.read_text())["traceEvents"]


def steps(events) -> list[str]:
    return sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})


def test_mindspeed_flags_tp2_pp2_profile_ranks_0_and_2_steps_2_and_3(tmp_path):
    save = tmp_path / "profile"
    _, output = pretrain(
        4, "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *DATA,
        "--train-iters", "5", "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
        "--profile-ranks", "0", "2", "--profile-level", "level1", "--profile-record-shapes",
        "--profile-save-path", str(save),
    )
    assert sorted(p.name for p in save.iterdir()) == ["rank0.steps2-3.pt.trace.json", "rank2.steps2-3.pt.trace.json"]
    for rank in (0, 2):
        events = trace(save / f"rank{rank}.steps2-3.pt.trace.json")
        assert steps(events) == ["ProfilerStep#2", "ProfilerStep#3"]  # exactly iterations 2 and 3
        ops = [e for e in events if e.get("cat") == "cpu_op"]
        assert any(e["name"] == "aten::mm" for e in ops)
        assert any(e.get("args", {}).get("Input Dims") for e in ops if e["name"] == "aten::mm")  # shapes
        # one summary per profiled rank: communication share and the top operators
        share = re.search(rf"\[profile\] rank {rank}: communication ([0-9.]+) ms = [0-9.]+% of the window", output)
        assert share and float(share.group(1)) > 0  # TP all-reduces and PP send / recv
        assert re.search(rf"\[profile\] rank {rank}: top host self time: ", output)
    assert "[profile] rank 1" not in output and "[profile] rank 3" not in output
    # one profiler: megatron's own (nsys / its torch.profiler) is off, and the notice says so
    assert "--profile: True -> False (hyper_adaptor's profiler records steps [2, 4) on ranks 0, 2" in output


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The module's one-process runs, started together (each is mostly megatron's start-up, on one core):
    name -> (directory, (losses, output) or the AssertionError of a run that failed)."""
    root = tmp_path_factory.mktemp("one_process")
    runs = {
        "megatron": (root / "megatron", [
            *DATA, "--train-iters", "3", "--profile", "--use-pytorch-profiler", "--pytorch-profiler-collect-shapes",
            "--profile-step-start", "1", "--profile-step-end", "3",
            "--tensorboard-dir", str(root / "megatron" / "tb")]),
        # megatron's loader workers on (no --num-workers 0): this is also the suite's plain one-process
        # --mock-data run
        "without": (root / "without", ["--mock-data", "--train-iters", "2", "--profile-save-path",
                                       str(root / "without"), "--profile-level", "level2"]),
        "bad": (root / "bad", [*DATA, "--train-iters", "2", "--profile", "--profile-step-start", "0",
                               "--profile-step-end", "1", "--profile-ranks", "3", "--profile-save-path",
                               str(root / "bad")]),
    }

    def launch(args):
        try:
            return pretrain(1, *args)
        except AssertionError as failed:
            return failed

    with ThreadPoolExecutor(len(runs)) as pool:
        futures = {name: (path, pool.submit(launch, args)) for name, (path, args) in runs.items()}
        return {name: (path, future.result()) for name, (path, future) in futures.items()}


def test_megatron_flags_use_pytorch_profiler_writes_where_megatron_does(one_process):
    path, run = one_process["megatron"]
    assert not isinstance(run, AssertionError), str(run)[-3000:]
    _, output = run
    written = sorted((path / "torch_profile").iterdir())
    assert [p.name for p in written] == ["rank0.steps1-2.pt.trace.json"]
    events = trace(written[0])
    assert steps(events) == ["ProfilerStep#1", "ProfilerStep#2"]
    assert any(e.get("args", {}).get("Input Dims") for e in events if e.get("name") == "aten::mm")
    assert "[profile] rank 0: steps 1-2" in output


def test_without_profile_nothing_is_written_and_bad_input_stops_before_training(one_process):
    save, run = one_process["without"]
    assert not isinstance(run, AssertionError), str(run)[-3000:]
    losses, output = run
    assert sorted(losses) == [1, 2] and not save.exists() and "[profile]" not in output

    save, failed = one_process["bad"]
    assert isinstance(failed, AssertionError), failed[1][-3000:]
    assert "--profile-ranks 3: outside the world of 1 processes" in str(failed)
    assert not re.search(r"iteration\s+1/", str(failed)) and not save.exists()
