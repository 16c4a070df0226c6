"""Spawn a real gloo world on CPU with a free port and a hard timeout.

Each rank imports the one-line adaptor first (as a pretrain script would), then runs
``module:function(rank, world_size, **kwargs)``; rank results come back to the parent. A rank that
raises fails the world with its traceback; a world that does not finish in ``timeout`` seconds is
killed and reported as a hang — never a stuck CI.

Used by the distributed tests and by the benchmarks. Importing this module imports neither torch nor
megatron: only the spawned ranks do (the parent needs torch only to read their results back).
"""

from __future__ import annotations

import importlib
import io
import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback

_next_port = [0]  # the next offset in this xdist worker's block of ports (free_port)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for MASTER_PORT / torchrun).

    Under pytest-xdist (``PYTEST_XDIST_WORKER`` = ``gwN``) each worker takes ports from its own block below
    the kernel's ephemeral range, in turn: two workers asking the kernel for a free port could both be given
    the same one between one's check and its use (rank 0 binds it seconds later)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        base = 20000 + 1000 * (int(worker[2:]) % 12)
        for _ in range(1000):
            port = base + _next_port[0] % 1000
            _next_port[0] += 1
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What a forkserver imports once, before it forks the ranks: torch and the parts of it megatron-core and the
# engines import anyway: DTensor, and what ``torch.compile`` imports when it is called (dynamo, inductor's
# compile_fx, aot_autograd: megatron-core decorates some 40 functions with it at import). That is most of a
# rank's start-up, paid once per test session instead of once per rank. Nothing of hyper_adaptor or megatron
# is preloaded: the one line still runs in every rank, before megatron, as in a pretrain script.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "torch._inductor.compile_fx",
           "torch._dynamo.backends.debugging")
START_METHOD_ENV = "HYPER_ADAPTOR_WORLD_START_METHOD"


def _context():
    """The multiprocessing context of the ranks: forkserver where the platform has it (POSIX), spawn
    otherwise or when ``HYPER_ADAPTOR_WORLD_START_METHOD=spawn`` asks for a fresh interpreter per rank."""
    method = os.environ.get(START_METHOD_ENV) or ("forkserver" if "forkserver" in mp.get_all_start_methods()
                                                   else "spawn")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def _rank_main(rank, world_size, port, target, kwargs, queue, environ=None):
    if environ is not None:
        # a forkserver's ranks would otherwise see the server's environment, not the caller's of now
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    try:
        import torch

        torch.set_num_threads(1)
        import hyper_adaptor.megatron_adaptor  # noqa: F401  (the one line, before megatron)

        module_name, fn_name = target.split(":")
        fn = getattr(importlib.import_module(module_name), fn_name)
        result = fn(rank, world_size, **kwargs)
        # serialise to bytes: tensors sent as-is would be shared through file descriptors that
        # vanish when this process exits
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


class WorldError(RuntimeError):
    """A rank raised, every rank exited without a result, or the world hung past its timeout."""


def run_world(world_size: int, target: str, timeout: float = 300, daemon: bool = True, **kwargs) -> list:
    """Run ``target`` (``"package.module:function"``, importable by the spawned ranks) on
    ``world_size`` spawned ranks; returns the per-rank results in rank order.

    Each rank gets MASTER_ADDR / MASTER_PORT / RANK / WORLD_SIZE in its environment and one torch
    thread; ``target`` is called as ``function(rank, world_size, **kwargs)`` and initialises its
    process group itself. ``daemon=False`` for rank code that starts processes of its own (megatron's
    checkpoint writer does); the ranks are killed at the end either way."""
    ctx = _context()
    queue = ctx.Queue()
    port = free_port()
    environ = dict(os.environ)
    procs = [
        ctx.Process(target=_rank_main, args=(r, world_size, port, target, kwargs, queue, environ), daemon=daemon)
        for r in range(world_size)
    ]
    # the forkserver starts with the first rank and keeps the environment of that moment: the ranks take the
    # caller's (environ, above); torch in the server is loaded with one OpenMP thread, as every rank runs
    omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        for p in procs:
            p.start()
    finally:
        if omp is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    results, errors = {}, []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise WorldError(
                    f"world of {world_size} running {target} hung: no result after {timeout:.0f}s "
                    f"from ranks {sorted(set(range(world_size)) - set(results))}"
                )
            try:
                rank, status, payload = queue.get(timeout=min(remaining, 5))
            except queue_module.Empty:
                if all(p.exitcode is not None for p in procs) and queue.empty():
                    codes = [p.exitcode for p in procs]
                    raise WorldError(f"{target}: ranks exited (codes {codes}) without a result") from None
                continue
            if status == "ok":
                import torch

                results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{payload}")
                break  # one failure is enough; the others may be waiting on it
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 1)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise WorldError(f"{target} failed on a rank:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
