"""Rank code for test_hsdp_checkpoint.py: megatron torch_dist round trips of HSDP's localized
sharded state dicts (hyper_adaptor/patches/hsdp/checkpoint.py) on 3 gloo ranks, where every
awkward case of the row split happens: uneven rows (10 over 3: 4, 4, 2), a rank with no rows
(2 over 3), a layer-stacked key (prepended axis), SwiGLU's [W; V] factory with a rank whose rows
straddle the W/V boundary, and a replicated (below-threshold) tensor.

Each check saves one layout and loads another: HSDP -> whole tensors (megatron DDP's layout),
whole -> HSDP, HSDP -> HSDP; the loaded values must equal the saved ones exactly.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

ENTRIES = {  # name: (global shape, sharded?)
    "layer0": ((10, 4), True),
    "layer1": ((10, 4), True),
    "tiny": ((2, 3), True),
    "fc1": ((10, 4), True),
    "norm": ((4,), False),
}


def _full(name):
    shape, _ = ENTRIES[name]
    seed = sum(map(ord, name))
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) * 0.5 + seed


def _describe(values, rank):
    """megatron's descriptions (as a GPT model's sharded_state_dict writes them) of ``values``."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    replica = (0, 0, rank)
    sd = {}
    for i in (0, 1):  # one key for all layers, the layer index a prepended axis
        sd[f"layer{i}"] = ShardedTensor.from_rank_offsets(
            "decoder.layers.w", values[f"layer{i}"], (0, i, 2), replica_id=replica, prepend_axis_num=1)
    sd["tiny"] = ShardedTensor.from_rank_offsets("tiny", values["tiny"], replica_id=replica)
    sd["norm"] = ShardedTensor.from_rank_offsets("norm", values["norm"], replica_id=replica)
    fc1 = ShardedTensor.from_rank_offsets("fc1", values["fc1"], replica_id=replica)
    sd["fc1"] = apply_swiglu_sharded_factory(fc1, ())
    return sd


def _hsdp_values(mesh, fill=None):
    """HSDP's layout, as torch's own ``distribute_tensor`` splits: Shard(0) or Replicate."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out = {}
    for name, (shape, sharded) in ENTRIES.items():
        full = _full(name) if fill is None else torch.full(shape, fill)
        out[name] = distribute_tensor(full, mesh, [Shard(0) if sharded else Replicate()])
    return out


def _save(sd, path):
    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(sd, path)
    dist.barrier()


def _load(sd, path):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load(sd, path)


def roundtrips(rank, world_size, tmpdir):
    from torch.distributed.device_mesh import DeviceMesh

    from hyper_adaptor.patches.hsdp.checkpoint import localize_sharded_state_dict, row_split, to_dtensor_like

    dist.init_process_group("gloo")
    mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    problems = []
    whole = {name: _full(name) for name in ENTRIES}
    hsdp = _hsdp_values(mesh)
    layout = {name: row_split(t) for name, t in hsdp.items()}

    # HSDP -> whole tensors (what megatron's DDP run reads)
    _save(localize_sharded_state_dict(_describe(hsdp, rank)), f"{tmpdir}/from_hsdp")
    loaded = _load(_describe({n: torch.zeros_like(t) for n, t in whole.items()}, rank), f"{tmpdir}/from_hsdp")
    for name, want in whole.items():
        if not torch.equal(loaded[name], want):
            problems.append(f"hsdp->whole {name}: {loaded[name]} != {want}")

    # whole -> HSDP, and HSDP -> HSDP: each rank gets its rows, back as DTensors equal to the whole
    _save(_describe(whole, rank), f"{tmpdir}/from_whole")
    for source in ("from_whole", "from_hsdp"):
        target = _hsdp_values(mesh, fill=-1.0)
        loaded = _load(localize_sharded_state_dict(_describe(target, rank)), f"{tmpdir}/{source}")
        for name, want in whole.items():
            got = to_dtensor_like(loaded[name], target[name], name)
            split = layout[name]
            rows = want if split is None else want[split[0] : split[0] + split[1]]
            if not torch.equal(got._local_tensor, rows):
                problems.append(f"{source}->hsdp {name} rank {rank}: {got._local_tensor} != {rows}")
            if not torch.equal(got.full_tensor(), want):
                problems.append(f"{source}->hsdp {name}: gathered tensor differs")
    return {"problems": problems, "layout": layout}
