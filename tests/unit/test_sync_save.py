"""A synchronous torch_dist save starts no process (hyper_adaptor/patches/checkpoint/sync_save.py): megatron's
writer would start a spawned multiprocessing Manager per rank, which imports the training script again.
One process, a one-rank gloo world: save and load back, unpatched and patched; with --async-save the patch
stays out."""

import subprocess
import sys
import textwrap
from argparse import Namespace

from hyper_adaptor.patches.checkpoint import sync_save

SCRIPT = textwrap.dedent("""
    import multiprocessing, os, sys
    from argparse import Namespace
    import torch, torch.distributed as dist
    import hyper_adaptor.megatron_adaptor  # level 0 (its import stand-ins) before megatron.core
    from hyper_adaptor.patch_manager import PatchManager
    from hyper_adaptor.patches.checkpoint import sync_save
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    root = sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    if sys.argv[1] == "patched":
        manager = PatchManager()
        manager.register_all(sync_save.patches(Namespace(async_save=False)))
        manager.apply()
    os.mkdir(f"{root}/ckpt")
    weights = torch.arange(12, dtype=torch.float32)
    dist_checkpointing.save({"w": ShardedTensor.from_rank_offsets("w", weights)}, f"{root}/ckpt")
    children = len(multiprocessing.active_children())
    loaded = dist_checkpointing.load({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(12))}, f"{root}/ckpt")
    assert torch.equal(loaded["w"], weights), loaded
    print("children", children, "manager", filesystem_async._results_queue is not None)
    dist.destroy_process_group()
""")


def _save(tmp_path, mode):
    (tmp_path / mode).mkdir()
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode, str(tmp_path / mode)], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_synchronous_save_starts_no_process_and_reads_back(tmp_path):
    # megatron's own writer: a Manager process per rank (what the patch removes)
    assert _save(tmp_path, "plain") == "children 1 manager True"
    assert _save(tmp_path, "patched") == "children 0 manager False"


def test_an_asynchronous_save_keeps_megatrons_queue():
    assert sync_save.patches(Namespace(async_save=True)) == []
    assert len(sync_save.patches(Namespace(async_save=False))) == 2
