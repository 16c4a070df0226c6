"""The suite's fork launcher (hyper_adaptor/testing/launch.py) gives a rank what torchrun gives it: the same
environment variables, the script as ``__main__`` with its argv and path, an interpreter's exit; a failing rank
ends the run with its status and stops the others."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hyper_adaptor.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
PROBE = textwrap.dedent("""
    import atexit, os, sys
    AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"
    keys = sorted(k for k in os.environ if k in {NAMES})
    skip = ("MASTER_PORT", "TORCHELASTIC_RUN_ID", AGENT_STORE)
    line = "|".join(f"{k}={os.environ[k]}" for k in keys if k not in skip)
    atexit.register(print, "exit", os.environ["RANK"], flush=True)
    # a thread pool that lives as long as the process (as torch inductor's compile pool does): its idle
    # worker is a non-daemon thread that ends only when the interpreter's exit shuts the pool down
    import concurrent.futures
    concurrent.futures.pool_kept_by_probe = concurrent.futures.ThreadPoolExecutor(1)
    concurrent.futures.pool_kept_by_probe.submit(int).result()
    print("store", os.environ[AGENT_STORE], flush=True)
    print("rank", os.environ["RANK"], __name__, sys.argv[1:], os.path.basename(sys.path[0]), line, flush=True)
    if "--fail" in sys.argv and os.environ["RANK"] == "1":
        sys.exit(3)
    if "--fail" in sys.argv:
        import time
        time.sleep(120)
""")
NAMES = {"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
         "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT",
         "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS"}


def _launch(module, script, *args, timeout=120):
    command = [sys.executable, "-m", module, "--nproc-per-node", "2", "--master-port", str(free_port()),
               str(script), *args]
    env = {k: v for k, v in os.environ.items() if k not in NAMES}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(env, PYTHONPATH=str(ROOT)))


def _lines(output, word):
    return sorted(line for line in output.splitlines() if line.startswith(word + " "))


def test_a_rank_sees_what_a_torchrun_rank_sees(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace("{NAMES}", repr(NAMES)))
    forked = _launch("hyper_adaptor.testing.launch", script, "--flag", "x")
    torchrun = _launch("torch.distributed.run", script, "--flag", "x")
    assert forked.returncode == 0 and torchrun.returncode == 0, forked.stderr + torchrun.stderr
    ranks = _lines(forked.stdout, "rank")
    assert len(ranks) == 2 and ranks == _lines(torchrun.stdout, "rank"), (ranks, torchrun.stdout)
    assert "__main__ ['--flag', 'x']" in ranks[0] and f" {tmp_path.name} " in ranks[0]
    # atexit ran in each rank, after the interpreter's exit shut down the probe's pool (a hand-made exit that
    # joined the non-daemon threads first waited for its worker forever: the launch timed out)
    assert _lines(forked.stdout, "exit") == ["exit 0", "exit 1"]
    # the one difference: no agent hosts the rendezvous store, rank 0's process group does (env:// as without
    # torchrun)
    assert _lines(torchrun.stdout, "store") == ["store True"] * 2
    assert _lines(forked.stdout, "store") == ["store False"] * 2


def test_a_failing_rank_ends_the_run_with_its_status_and_stops_the_others(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace("{NAMES}", repr(NAMES)))
    start = time.monotonic()
    done = _launch("hyper_adaptor.testing.launch", script, "--fail")
    assert done.returncode == 3, done.stderr
    assert "rank 1" in done.stderr and "stopping the others" in done.stderr
    assert time.monotonic() - start < 60  # rank 0 sleeps 120 s unless stopped
