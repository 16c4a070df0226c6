"""examples/pretrain_gpt.py with faults injected for tests/e2e/test_checkpoint_survival.py.

``HA_FAULTS``: comma-separated ``KIND:ATTEMPT:RANK:ITERATION``; each acts only in torchrun's attempt
ATTEMPT (``TORCHELASTIC_RESTART_COUNT``) on global rank RANK:

- ``kill``: SIGKILL once iteration ITERATION is logged, before its checkpoint;
- ``killsave``: SIGKILL inside the save of iteration ITERATION, after every shard and DCP's ``.metadata``
  are written and before megatron's ``metadata.json`` (rank 0 writes it, so RANK should be 0);
- ``term``: SIGTERM to itself as step ITERATION begins (a scheduler's preemption, seen mid-step).

``HA_FAULTS_RECORD``: a file rank 0 appends one JSON line per logged iteration to, with the loss and the
grad norm exactly as the step produced them (megatron's log line rounds, and after a restart averages).
"""

import json
import os
import runpy
import signal
import sys
from pathlib import Path

import hyper_adaptor.megatron_adaptor  # noqa: F401  (before megatron, as in the example)

import megatron.core.dist_checkpointing.serialization as serialization
import megatron.training.training as training
from megatron.training import get_args

ROOT = Path(__file__).resolve().parents[2]
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
RANK = int(os.environ.get("RANK", "0"))


def _faults(kind):
    found = set()
    for item in filter(None, os.environ.get("HA_FAULTS", "").split(",")):
        name, attempt, rank, iteration = item.split(":")
        if name == kind and int(attempt) == ATTEMPT and int(rank) == RANK:
            found.add(int(iteration))
    return found


KILL_AT, TERM_AT, KILL_IN_SAVE = _faults("kill"), _faults("term"), _faults("killsave")
RECORD = os.environ.get("HA_FAULTS_RECORD")


def _die(sig, why):
    print(f"[checkpoint_faults] attempt {ATTEMPT} rank {RANK}: {why}", flush=True)
    os.kill(os.getpid(), sig)


def _hook_log(training_log):
    def logged(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs):
        if RECORD and RANK == 0 and "lm loss" in loss_dict:
            grad_norm = rest[3] if len(rest) > 3 else kwargs.get("grad_norm")
            with open(RECORD, "a") as f:
                f.write(json.dumps({"attempt": ATTEMPT, "iteration": iteration,
                                    "loss": float(loss_dict["lm loss"].float().sum().item()),
                                    "grad_norm": None if grad_norm is None else float(grad_norm)}) + "\n")
        result = training_log(loss_dict, total_loss_dict, learning_rate, iteration, *rest, **kwargs)
        if iteration in KILL_AT:
            sys.stdout.flush()
            _die(signal.SIGKILL, f"SIGKILL after iteration {iteration}")
        return result

    return logged


def _hook_step(train_step):
    def step(*args, **kwargs):
        if get_args().curr_iteration + 1 in TERM_AT:
            _die(signal.SIGTERM, f"SIGTERM as step {get_args().curr_iteration + 1} begins")
        return train_step(*args, **kwargs)

    return step


def _hook_save_config(save_config):
    def save(config, checkpoint_dir):
        name = os.path.basename(os.path.normpath(str(checkpoint_dir)))
        if name.startswith("iter_") and int(name[5:]) in KILL_IN_SAVE:
            _die(signal.SIGKILL, f"SIGKILL inside the save of {name}, before metadata.json")
        return save_config(config, checkpoint_dir)

    return save


training.training_log = _hook_log(training.training_log)
training.train_step = _hook_step(training.train_step)
serialization.save_config = _hook_save_config(serialization.save_config)
sys.argv[0] = str(ROOT / "examples" / "pretrain_gpt.py")
runpy.run_path(sys.argv[0], run_name="__main__")
