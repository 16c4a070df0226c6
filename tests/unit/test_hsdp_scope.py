"""What the HSDP engine leaves outside the objects it wraps (one process): no optimizer hook for the
process unless an HSDP module exists, gloo switches and buffer pools carried by each wrapped module,
and FSDP2's ``CPUOffloadPolicy(pin_memory=...)``."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn as nn

from hyper_adaptor.parallel.hsdp import CPUOffloadPolicy, HostBufferPool, OffloadPolicy, fully_shard, hsdp

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: this pytest process may have imported HSDP and may still hold wrapped
# modules from other tests, and both are what is measured.
HOOK_LIFECYCLE = r"""
import gc, json
import torch
import torch.distributed as dist
import torch.optim.optimizer as optimizer_module

def hooks():
    return {"post": dict(optimizer_module._global_optimizer_post_hooks),
            "pre": dict(optimizer_module._global_optimizer_pre_hooks)}

def marking():
    from hyper_adaptor.parallel.hsdp import _state
    return sum(h is _state._mark_stale for h in optimizer_module._global_optimizer_post_hooks.values())

out = {}
before = hooks()
import hyper_adaptor.parallel.hsdp as hsdp_module
out["import_unchanged"] = hooks() == before
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
first = hsdp_module.hsdp(torch.nn.Linear(4, 4))
second = hsdp_module.hsdp(torch.nn.Linear(4, 4))
out["while_wrapped"] = marking()
first(torch.ones(2, 4)).sum().backward()
opt = torch.optim.SGD(first.parameters(), lr=0.1, foreach=True)
out["stale_before_step"] = [p._hsdp_param.stale for p in first.parameters()]
opt.step()
out["stale_after_step"] = [p._hsdp_param.stale for p in first.parameters()]
del first, opt
gc.collect()
out["one_left"] = marking()
del second
gc.collect()
out["none_left"] = marking()
out["after_unchanged"] = hooks() == before
dist.destroy_process_group()
print(json.dumps(out))
"""


def test_optimizer_hook_only_while_hsdp_modules_exist():
    proc = subprocess.run([sys.executable, "-c", HOOK_LIFECYCLE], cwd=ROOT, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["import_unchanged"], "importing hyper_adaptor.parallel.hsdp registered an optimizer hook"
    assert out["while_wrapped"] == 1  # one hook for every wrapped module, not one each
    # a foreach step moves no version counter of a DTensor: the hook is what marks the shards
    assert out["stale_before_step"] == [False, False] and out["stale_after_step"] == [True, True]
    assert out["one_left"] == 1
    assert out["none_left"] == 0 and out["after_unchanged"]


def test_cpu_offload_policy_takes_pin_memory():
    assert CPUOffloadPolicy(pin_memory=False).pin_memory is False
    assert CPUOffloadPolicy().pin_memory is True
    assert isinstance(CPUOffloadPolicy(pin_memory=False), OffloadPolicy)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CPUOffloadPolicy().pin_memory = False


def test_cpu_offload_policy_without_pinning_wraps(world_of_one):
    model = fully_shard(nn.Linear(4, 4), offload_policy=CPUOffloadPolicy(pin_memory=False))
    assert model._hsdp_state.config.offload is True


def test_gloo_switches_and_pool_belong_to_the_wrapped_module(world_of_one):
    pool = HostBufferPool(keep=0)
    own = hsdp(nn.Linear(4, 4), gloo_reduce_scatter_as_all_to_all=False, buffer_pool=pool)
    fsdp = fully_shard(nn.Linear(4, 4), gloo_all_gather_as_all_to_all=False, buffer_pool=pool)
    plain_a, plain_b = hsdp(nn.Linear(4, 4)), hsdp(nn.Linear(4, 4))
    switches = lambda m: (m._hsdp_state.config.gloo_reduce_scatter_as_all_to_all,  # noqa: E731
                          m._hsdp_state.config.gloo_all_gather_as_all_to_all)
    assert switches(own) == (False, True) and switches(fsdp) == (True, False)
    assert switches(plain_a) == switches(plain_b) == (True, True)
    assert own._hsdp_state.pool is pool and fsdp._hsdp_state.pool is pool
    assert all(b.pool is pool for b in own._hsdp_state.buckets)
    # by default, modules wrapped over the same group share one pool (not a process-wide one)
    assert plain_a._hsdp_state.pool is plain_b._hsdp_state.pool is plain_a._hsdp_state.mesh.pool
    assert plain_a._hsdp_state.pool is not pool


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"buffer_pool": object()}, "buffer_pool must be None or a HostBufferPool"),
        ({"gloo_all_gather_as_all_to_all": "no"}, "gloo_all_gather_as_all_to_all must be a bool; got 'no'"),
        ({"gloo_reduce_scatter_as_all_to_all": 0}, "gloo_reduce_scatter_as_all_to_all must be a bool; got 0"),
    ],
)
def test_bad_per_module_settings_are_named(world_of_one, kwargs, message):
    with pytest.raises(ValueError, match=message):
        hsdp(nn.Linear(4, 4), **kwargs)
