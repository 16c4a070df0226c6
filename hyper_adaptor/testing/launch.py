"""``python -m hyper_adaptor.testing.launch --nproc-per-node N --master-port P script.py [args]``: the
test suite's stand-in for ``torchrun --nproc-per-node N`` on one node, which forks the ranks from one
process that has already imported torch.

Why not torchrun for every end-to-end test: on this project's 2-core CI machine a rank of a small GPT run
spends most of its life starting up, and most of that is importing torch (with DTensor and dynamo, which
megatron-core imports at once). torchrun starts each rank as a new interpreter; forking them from one
that has imported torch pays that once per run instead of once per rank (and torchrun's own start-up not
at all). Everything else is what a torchrun rank sees: the environment variables torchrun sets, the
script run as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python script.py`` would give,
hyper_adaptor's one line and megatron imported fresh in every rank (neither is preloaded), one
interpreter exit per rank (the interpreter's own: thread pools shut down, non-daemon threads joined, atexit
handlers run). A rank that fails ends the
run, the others are stopped, and the exit status is the failed rank's, as torchrun's is.

Not a torchrun replacement for users: no restarts, no rendezvous, one node. The tests of what torchrun
itself does (restarts after a failure, the README's demo, Megatron-LM's own scripts) launch torchrun.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import sys
import time
import traceback

from hyper_adaptor.testing.world import PRELOAD


def _parse(argv):
    parser = argparse.ArgumentParser(prog="python -m hyper_adaptor.testing.launch", allow_abbrev=False)
    parser.add_argument("--nproc-per-node", "--nproc_per_node", type=int, required=True)
    parser.add_argument("--master-port", "--master_port", type=int, required=True)
    parser.add_argument("--master-addr", "--master_addr", default="127.0.0.1")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    return parser.parse_args(argv)


def _rank_environment(rank: int, world_size: int, addr: str, port: int) -> dict:
    # the variables torchrun's agent gives a worker of a one-node job (its run id is "none" for the
    # default static rendezvous), but one: no agent hosts a store here, so TORCHELASTIC_USE_AGENT_STORE is
    # False and rank 0's env:// process group hosts it, as without torchrun
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size), "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": addr,
        "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": "none", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message") prints it and exits 1, as the interpreter does
    return 1


def _run_rank(rank: int, options) -> int:
    """The forked child: run the script as ``python script.py`` would and return its exit status, which
    ``main`` returns at once, so that the rank ends through the interpreter's own exit and no launcher code
    after the fork runs in it. The interpreter's exit, not a hand-made one: it shuts down every
    ``concurrent.futures`` pool (whose idle workers are non-daemon threads that wait for that signal) before
    it joins the non-daemon threads, then runs the atexit handlers. Joining those threads by hand hung a rank
    whose pool was still referenced (torch inductor's compile pool, for one, lives as long as the process)."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ.update(_rank_environment(rank, options.nproc_per_node, options.master_addr, options.master_port))
        # one whole line per write, so the ranks' lines interleave but never mix (torchrun passes -u)
        sys.stdout.reconfigure(line_buffering=True)
        sys.stderr.reconfigure(line_buffering=True)
        script = os.path.abspath(options.script)
        sys.argv = [options.script, *options.script_args]
        sys.path[0] = os.path.dirname(script)
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as stop:
        return _exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        return 1


def _stop(children: dict, grace: float = 10.0) -> None:
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while children and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid:
            children.pop(pid, None)
        else:
            time.sleep(0.05)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def main(argv=None) -> int:
    options = _parse(sys.argv[1:] if argv is None else argv)
    if options.nproc_per_node < 1:
        raise SystemExit(f"--nproc-per-node must be >= 1; got {options.nproc_per_node}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads, as torchrun sets it for its workers
    for module in PRELOAD:
        __import__(module)
    sys.stdout.flush()
    sys.stderr.flush()
    children = {}
    for rank in range(options.nproc_per_node):
        pid = os.fork()
        if pid == 0:
            return _run_rank(rank, options)  # the rank leaves main() here and exits as an interpreter does
        children[pid] = rank

    def forward(signum, frame):
        _stop(children)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    while children:
        pid, wait_status = os.waitpid(-1, 0)
        rank = children.pop(pid, None)
        if rank is None:
            continue
        code = os.waitstatus_to_exitcode(wait_status)
        if code != 0:
            print(f"[launch] rank {rank} (pid {pid}) exited with {code}; stopping the others", file=sys.stderr)
            _stop(children)
            status = code if code > 0 else 128 - code
    return status


if __name__ == "__main__":
    sys.exit(main())
