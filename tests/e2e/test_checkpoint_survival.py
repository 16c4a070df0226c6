"""End to end: checkpoints survive failures (docs/features/checkpoints.md, "Restart and preemption" and
"Torn checkpoints"). DP2 on --mock-data, 8 iterations, through tests/e2e/checkpoint_faults.py, which
injects the faults and records every step's loss and grad norm exactly as computed.

Three launched worlds, shared by the tests below:

- the uninterrupted run (the reference);
- a preempted run: SIGTERM reaches rank 1 only, during step 3, under --exit-signal-handler: every rank
  saves iteration 3 and the job exits with 0;
- a restarted run on that checkpoint directory under ``torchrun --max-restarts 2``: it resumes from the
  preemption's checkpoint; in its first attempt rank 1 is SIGKILLed after iteration 5 (the restart
  resumes from iteration 4); in its second, rank 0 is SIGKILLed inside the save of iteration 6, after
  the shards and before metadata.json (the restart skips iter_0000006, says so, resumes from 4).

From each checkpoint on, every step's loss and grad norm equal the uninterrupted run's bitwise. The
logged "lm loss" differs at one place, the second iteration of every process: megatron.training's
training_log does not reset its loss sums after a process's first logged iteration, so the second
logged value is the mean of the first two (the uninterrupted run shows the same at iteration 2).
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hyper_adaptor.testing import free_port
from tests.e2e.test_pretrain_gpt import MODEL

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
LOGGED = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+) \|")
ITERS = 8
FLAGS = ["--mock-data", "--train-iters", str(ITERS)]


def launch(tmp, name, *args, faults="", restarts=0, timeout=300):
    """Start one torchrun world of checkpoint_faults.py; returns what ``finish`` waits on."""
    record, log = tmp / f"{name}.jsonl", tmp / f"{name}.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
               str(restarts), "--master-port", str(free_port()), "tests/e2e/checkpoint_faults.py", *MODEL,
               *FLAGS, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", HA_FAULTS=faults,
               HA_FAULTS_RECORD=str(record))
    # a file, not a pipe: a SIGKILLed rank's checkpoint-writer queue manager outlives it, holding its output
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    return proc, record, log, timeout


def _reap(record):
    """End what a world left behind (the orphaned manager processes of SIGKILLed ranks), found by the
    record path only this world's processes carry."""
    import psutil

    for process in psutil.process_iter():
        try:
            if process.environ().get("HA_FAULTS_RECORD") == str(record):
                process.kill()
        except psutil.Error:
            pass


def finish(started):
    proc, record, log, timeout = started
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"timed out after {timeout} s\n{log.read_text()[-6000:]}") from None
    finally:
        _reap(record)
    steps = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc.returncode, log.read_text(), steps


def by_iteration(steps):
    return {s["iteration"]: (s["loss"], s["grad_norm"]) for s in steps}


def logged(output):
    """The last logged lm loss of every iteration, as printed."""
    return dict((int(i), v) for i, v in LOGGED.findall(output))


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("survival")
    ckpt = tmp / "ckpt"
    # the reference and the preempted run share the two cores: neither waits on the other
    reference = launch(tmp, "reference")
    preempted = launch(tmp, "preempted", "--save", str(ckpt), "--save-interval", "2", "--exit-signal-handler",
                       faults="term:0:1:3")
    reference, preempted = finish(reference), finish(preempted)
    tracker_after_preemption = (ckpt / "latest_checkpointed_iteration.txt").read_text().strip()
    restarted = finish(launch(tmp, "restarted", "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "2",
                              faults="kill:0:1:5,killsave:1:0:6", restarts=2, timeout=420))
    return ckpt, reference, preempted, tracker_after_preemption, restarted


def test_preemption_saves_at_the_step_boundary_and_exits_cleanly(worlds):
    ckpt, reference, (rc, output, steps), tracker, _ = worlds
    assert reference[0] == 0, reference[1][-4000:]
    assert rc == 0, output[-4000:]
    assert "SIGTERM as step 3 begins" in output
    assert "exiting program after receiving SIGTERM" in output
    # step 3 ran to its end, was saved by every rank (only rank 1 got the signal), and nothing after it
    assert sorted(by_iteration(steps)) == [1, 2, 3]
    assert tracker == "3"
    assert re.search(r"saving checkpoint at iteration\s+3 ", output)
    assert by_iteration(steps) == {i: by_iteration(reference[2])[i] for i in (1, 2, 3)}


def test_restart_resumes_from_the_latest_complete_checkpoint_bitwise(worlds):
    ckpt, (_, ref_output, ref_steps), _, _, (rc, output, steps) = worlds
    assert rc == 0, output[-4000:]
    ref = by_iteration(ref_steps)
    attempts = {}
    for step in steps:
        attempts.setdefault(step["attempt"], []).append(step["iteration"])
    # attempt 0 resumes from the preemption's checkpoint, the next two from iteration 4
    assert attempts == {0: [4, 5], 1: [5, 6], 2: [5, 6, 7, 8]}, attempts
    assert re.search(r"loading distributed checkpoint from \S+ at iteration 3\b", output)
    assert len(re.findall(r"loading distributed checkpoint from \S+ at iteration 4\b", output)) == 2
    for step in steps:
        assert (step["loss"], step["grad_norm"]) == ref[step["iteration"]], step
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


def test_torn_save_is_skipped_with_a_notice(worlds):
    ckpt, *_, (rc, output, _) = worlds
    assert "SIGKILL inside the save of iter_0000006" in output
    notices = [line for line in output.splitlines() if line.startswith("[hyper_adaptor] checkpoint: ")]
    torn = ckpt / "iter_0000006"
    assert notices == [f"[hyper_adaptor] checkpoint: skipped {torn}: metadata.json is missing (the save did "
                       f"not finish); resuming from iteration 4 ({ckpt / 'iter_0000004'})"], notices
    # the finished run saved iteration 6 again, complete this time
    assert (torn / "metadata.json").is_file() and (torn / ".metadata").is_file()


def test_logged_loss_after_a_resume_is_megatrons_two_step_mean(worlds):
    _, (_, ref_output, ref_steps), _, _, (_, output, steps) = worlds
    import torch

    ref, ref_logged, resumed_logged = by_iteration(ref_steps), logged(ref_output), logged(output)

    def mean_of(first, second):
        total = torch.tensor([0.0]) + torch.tensor([ref[first][0]]) + torch.tensor([ref[second][0]])
        return f"{total.item() / 2:.6E}"

    # the uninterrupted run: iteration 2 is the mean of 1 and 2, every later one its own loss
    assert ref_logged[2] == mean_of(1, 2) != f"{ref[2][0]:.6E}"
    assert all(ref_logged[i] == f"{ref[i][0]:.6E}" for i in range(3, ITERS + 1))
    # the last attempt resumed from 4: its first iteration is exact, the second is the mean of the two,
    # and from then on the logged line is the uninterrupted run's
    assert resumed_logged[5] == ref_logged[5]
    assert resumed_logged[6] == mean_of(5, 6) != ref_logged[6]
    assert [resumed_logged[i] for i in (7, 8)] == [ref_logged[i] for i in (7, 8)]
