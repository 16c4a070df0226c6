"""Section 4 of bench/optimizers.py: megatron's GPT (the demo's, one process) trained with ``--optimizer muon``
and with ``--optimizer adam`` side by side on the embedded corpus; logged loss at equal iterations and at equal
wall time, and the table of it."""

from __future__ import annotations

import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hyper_adaptor.testing.measure import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent

# The demo's GPT (examples/run_demo.sh) on one process; dropout off so the two runs differ by the optimizer only.
DEMO_GPT = ("--num-layers 4 --hidden-size 128 --num-attention-heads 4 --ffn-hidden-size 512 --seq-length 128 "
            "--max-position-embeddings 128 --position-embedding-type rope --normalization RMSNorm --swiglu "
            "--disable-bias-linear --untie-embeddings-and-output-weights --attention-dropout 0.0 "
            "--hidden-dropout 0.0 --tokenizer-type NullTokenizer --vocab-size 257 --micro-batch-size 4 "
            "--global-batch-size 16 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --weight-decay 0.1 "
            "--clip-grad 1.0 --seed 1234 --use-cpu-initialization --log-interval 1 --num-workers 0 "
            "--split 98,2,0").split()
# Megatron has one --lr for the Muon matrices and for the Adam that takes the rest, so Muon runs in the
# scale mode that makes its update RMS match AdamW's (spectral: sqrt(max(A, B)), times 0.2) at AdamW's lr.
TRAIN_RUNS = {
    "muon": ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov", "--muon-scale-mode", "spectral",
             "--muon-extra-scale-factor", "0.2"],
    "adam": ["--optimizer", "adam", "--adam-beta1", "0.9", "--adam-beta2", "0.95"],
}
DATA_PREFIX = REPO_ROOT / "data-cache" / "stdlib_text_document"
ITERATION_LINE = re.compile(r"\[([0-9-]+ [0-9:.]+)\] iteration +(\d+)/ *\d+ \|.*?"
                            r"elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.E+-]+)")
VALIDATION_LINE = re.compile(r"validation loss at iteration (\d+) on validation set \| lm loss value: ([0-9.E+-]+)")


def parse_training_log(text: str) -> dict:
    """Iterations, their logged losses, and the wall time since iteration 1 was logged (from the log lines'
    timestamps, so compilation and data setup before the first step stay out); the final validation loss."""
    iters, losses, stamps = [], [], []
    for stamp, it, _, loss in ITERATION_LINE.findall(text):
        iters.append(int(it))
        losses.append(float(loss))
        stamps.append(datetime.datetime.fromisoformat(stamp).timestamp())
    validation = VALIDATION_LINE.findall(text)
    return {"iterations": iters, "losses": losses, "wall_s": [s - stamps[0] for s in stamps] if stamps else [],
            "validation_loss": float(validation[-1][1]) if validation else None}


def _smoothed(losses: list[float], end: int, window: int = 10) -> float:
    """Mean of the ``window`` logged losses up to and including index ``end`` (one batch's loss is noisy)."""
    chunk = losses[max(0, end - window + 1):end + 1]
    return sum(chunk) / len(chunk)


def _launch(name: str, iters: int, log):
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(free_port()), "examples/pretrain_gpt.py", *DEMO_GPT, "--train-iters", str(iters),
               "--lr-warmup-iters", str(max(1, iters // 20)), "--eval-interval", str(iters), "--eval-iters", "10",
               "--data-path", str(DATA_PREFIX), *TRAIN_RUNS[name]]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)


def _collect(name: str, proc, log, iters: int, deadline: float, start: float) -> dict:
    try:
        returncode = proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return {"optimizer": name, "ok": False, "error": "timed out (--timeout)", "flags": TRAIN_RUNS[name]}
    log.seek(0)
    output = log.read()
    if returncode != 0:
        # the rank's own exception, not torchrun's ChildFailedError wrapped around it
        errors = [m.group(1) for m in re.finditer(r"^(?:\[rank\d+\]: )?(\w+(?:Error|Exception): .+)$", output, re.M)
                  if not m.group(1).startswith("ChildFailedError")]
        return {"optimizer": name, "ok": False, "error": errors[-1] if errors else output[-500:],
                "flags": TRAIN_RUNS[name]}
    parsed = parse_training_log(output)
    if len(parsed["iterations"]) < iters:
        return {"optimizer": name, "ok": False, "error": f"{len(parsed['iterations'])} of {iters} iterations logged",
                "flags": TRAIN_RUNS[name]}
    served = [line.split("] ", 1)[1] for line in output.splitlines() if line.startswith("[hyper_adaptor] --optimizer")]
    return {"optimizer": name, "ok": True, "flags": TRAIN_RUNS[name], "process_s": time.time() - start,
            "served_by": served[0] if served else "megatron", **parsed}


def training_section(iters: int, timeout: float) -> dict:
    if not DATA_PREFIX.with_suffix(".bin").exists():
        subprocess.run([sys.executable, "examples/corpus.py", "--output-prefix", str(DATA_PREFIX)], cwd=REPO_ROOT,
                       check=True, capture_output=True)
    section = {"iterations": iters, "model_flags": " ".join(DEMO_GPT), "runs": {},
               "schedule": "both runs at the same time, one process and one thread each"}
    # Side by side rather than one after the other: load from other work on the machine then falls on both.
    start, deadline = time.time(), time.time() + timeout
    with tempfile.TemporaryFile("w+") as muon_log, tempfile.TemporaryFile("w+") as adam_log:
        logs = {"muon": muon_log, "adam": adam_log}
        procs = {name: _launch(name, iters, logs[name]) for name in TRAIN_RUNS}
        for name, proc in procs.items():
            run = _collect(name, proc, logs[name], iters, deadline, start)
            section["runs"][name] = run
            print(f"  training {name}: " + (f"{run['process_s']:.0f} s, last loss {run['losses'][-1]:.3f}"
                                            if run["ok"] else f"FAILED: {run['error']}"), flush=True)
    failed = [run for run in section["runs"].values() if not run["ok"]]
    if failed:
        section["not_run"] = "; ".join(f"--optimizer {r['optimizer']} did not train: {r['error']}" for r in failed)
        return section
    muon, adam = section["runs"]["muon"], section["runs"]["adam"]
    checkpoints = sorted({i for i in (iters // 4, iters // 2, 3 * iters // 4, iters) if i >= 1})
    section["equal_iterations"] = [
        {"iteration": i, "muon_loss": _smoothed(muon["losses"], i - 1), "adam_loss": _smoothed(adam["losses"], i - 1),
         "muon_wall_s": muon["wall_s"][i - 1], "adam_wall_s": adam["wall_s"][i - 1]} for i in checkpoints]
    budget = min(muon["wall_s"][-1], adam["wall_s"][-1])
    equal_time = []
    for fraction in (0.25, 0.5, 0.75, 1.0):
        t = budget * fraction
        at = {}
        for name, run in (("muon", muon), ("adam", adam)):
            index = max(i for i, s in enumerate(run["wall_s"]) if s <= t + 1e-9)
            at[name] = (run["iterations"][index], _smoothed(run["losses"], index))
        equal_time.append({"wall_s": t, "muon_iteration": at["muon"][0], "muon_loss": at["muon"][1],
                           "adam_iteration": at["adam"][0], "adam_loss": at["adam"][1]})
    section["equal_time"] = equal_time
    section["ms_per_iteration_median"] = {name: 1e3 * statistics.median(
        [b - a for a, b in zip(run["wall_s"][1:], run["wall_s"][2:], strict=False)]) for name, run in
        (("muon", muon), ("adam", adam))}
    return section


def training_table(training) -> list[str]:
    head = "4. The demo's GPT on the embedded corpus, one process, megatron --optimizer muon vs adam"
    if training is None:
        return [head, "   skipped (--skip-training)"]
    if training.get("not_run"):
        return [head, f"   NOT RUN: {training['not_run']}"]
    ms = training["ms_per_iteration_median"]
    lines = [head, f"   {training['iterations']} iterations each; loss = mean of the 10 logged losses up to that "
             f"point; median ms/iteration: muon {ms['muon']:.0f}, adam {ms['adam']:.0f}", "",
             "   equal iterations:", f"{'iteration':>12}{'muon loss':>11}{'adam loss':>11}{'muon s':>9}{'adam s':>9}"]
    for r in training["equal_iterations"]:
        lines.append(f"{r['iteration']:>12}{r['muon_loss']:>11.3f}{r['adam_loss']:>11.3f}{r['muon_wall_s']:>9.1f}"
                     f"{r['adam_wall_s']:>9.1f}")
    lines += ["", "   equal wall time (since iteration 1 was logged):",
              f"{'seconds':>12}{'muon iter':>11}{'muon loss':>11}{'adam iter':>11}{'adam loss':>11}"]
    for r in training["equal_time"]:
        lines.append(f"{r['wall_s']:>12.1f}{r['muon_iteration']:>11}{r['muon_loss']:>11.3f}{r['adam_iteration']:>11}"
                     f"{r['adam_loss']:>11.3f}")
    runs = training["runs"]
    lines.append(f"   validation loss at the end: muon {runs['muon']['validation_loss']}, "
                 f"adam {runs['adam']['validation_loss']}")
    lines.append(f"   muon flags: {' '.join(runs['muon']['flags'])} ({runs['muon']['served_by']})")
    lines.append(f"   adam flags: {' '.join(runs['adam']['flags'])}")
    return lines
