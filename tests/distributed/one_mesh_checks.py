"""One mesh, every dimension: the Llama example's compositions on 4 gloo ranks against one process.

Each check builds the small Llama (hyper_adaptor.testing.llama) with the example's ``parallelize``
(examples/llama/parallelize.py) on a layout, trains it a few Adam steps and compares with the whole
model trained in one process on the whole global batch (every rank computes that reference itself):
the loss of every step and every gradient of the first step. Results are lists of mismatches (empty:
equal within the tolerance) or numbers the test asserts on.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from hyper_adaptor.testing.llama import LlamaConfig, build_llama, loss_fn

TOL = 1e-5
BATCH, SEQ, STEPS, LR = 4, 8, 3, 1e-2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _example():
    """examples/llama/train.py (which imports its parallelize.py) as a module."""
    if "llama_train" not in sys.modules:
        path = os.path.join(ROOT, "examples", "llama", "train.py")
        spec = importlib.util.spec_from_file_location("llama_train", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["llama_train"] = module
        spec.loader.exec_module(module)
    return sys.modules["llama_train"]


def _batch(step: int, cfg: LlamaConfig) -> torch.Tensor:
    return _example().global_batch(step, cfg, BATCH, SEQ)


def reference(cfg: LlamaConfig, steps: int = STEPS) -> dict:
    """The whole model in this process: the loss of each step, the gradients of the first."""
    model = build_llama(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    losses, grads = [], {}
    for step in range(steps):
        tokens = _batch(step, cfg)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        if step == 0:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
            grads["__norm__"] = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    return {"losses": losses, "grads": grads}


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, errors: list) -> None:
    if got.shape != want.shape:
        errors.append(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
        return
    diff = float((got - want).abs().max()) if got.numel() else 0.0
    if diff > TOL * max(1.0, float(want.abs().max())):
        errors.append(f"{name}: max diff {diff:.3g}")


def _grads(run) -> dict:
    """Every gradient of this rank's stages as the whole tensor (collectives: the same order on every rank
    of a stage)."""
    out = {}
    for _, module in run.stages:
        for name, p in module.named_parameters():
            out[name] = None if p.grad is None else _full(p.grad).detach().clone()
    return out


def train_and_compare(run, ref: dict, steps: int = STEPS, first_step: int = 0) -> list:
    example = _example()
    cfg = run.stages[0][1].cfg
    errors = []
    for step in range(first_step, first_step + steps):
        loss = example.forward_backward(run, _batch(step, cfg))
        if step == 0:
            for name, grad in _grads(run).items():
                if grad is None:
                    errors.append(f"{name}: no gradient")
                else:
                    _compare(f"grad {name}", grad, ref["grads"][name], errors)
        for optimizer in run.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if abs(loss - ref["losses"][step]) > TOL * max(1.0, abs(ref["losses"][step])):
            errors.append(f"step {step + 1}: loss {loss:.8f} != {ref['losses'][step]:.8f}")
    return errors


def _setup(**layout):
    example = _example()
    cfg = layout.pop("model", LlamaConfig())
    return example.setup(example.ParallelConfig(**layout), cfg, lr=LR)


def _placements(run) -> dict:
    out = {}
    for _, module in run.stages:
        for name, p in module.named_parameters():
            if isinstance(p, DTensor):
                out[name] = (tuple(p.placements), tuple(p.device_mesh.mesh.shape))
    return out


def _clip(run, ref_norm: float) -> dict:
    """HSDP's clip_grad_norm_ and torch's on the (dp, tp) shards, after one backward."""
    from hyper_adaptor.parallel.hsdp import clip_grad_norm_

    example = _example()
    module = run.stages[0][1]
    example.forward_backward(run, _batch(0, module.cfg))
    ours = float(clip_grad_norm_(module, max_norm=1e9))
    grads = [p.grad for p in module.parameters()]
    theirs = float(_full(torch.nn.utils.get_total_norm(grads)))
    for optimizer in run.optimizers:
        optimizer.zero_grad(set_to_none=True)
    return {"ours": ours, "torch": theirs, "ref": ref_norm}


def compositions(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo")
    ref = reference(LlamaConfig())
    out: dict = {}
    for level in (1, 2, 3):
        run = _setup(tp=2, dp=2, hsdp_level=level)
        if level == 3:
            out["placements"] = _placements(run)
            out["clip"] = _clip(run, float(ref["grads"]["__norm__"]))
        out[f"tp2-dp2-level{level}"] = train_and_compare(run, ref)
    out["tp2-hsdp-replicate"] = train_and_compare(_setup(tp=2, dp=2, hsdp_level=2, dp_shard=1), ref)
    for level in (1, 3):  # (level 1 keeps the full gradients, which sequence parallel leaves Partial over tp)
        out[f"tp2-sp-dp2-level{level}"] = train_and_compare(
            _setup(tp=2, dp=2, hsdp_level=level, sequence_parallel=True), ref)
    out["tp2-dp2-level3-swap"] = train_and_compare(_setup(tp=2, dp=2, hsdp_level=3, memory="swap"), ref)
    out["tp2-dp2-level2-checkpoint"] = train_and_compare(_setup(tp=2, dp=2, hsdp_level=2, memory="checkpoint"), ref)
    out["pp2-dp2-level3"] = train_and_compare(_setup(pp=2, dp=2, hsdp_level=3), ref)
    out["tp2-cp2"] = train_and_compare(_setup(tp=2, cp=2), ref)
    out["tp2-cp2-level2"] = train_and_compare(_setup(tp=2, cp=2, hsdp_level=2, cp_algo="allgather"), ref)
    out["pp2-tp2-1f1b"] = train_and_compare(_setup(pp=2, tp=2, schedule="1f1b"), ref)
    deep = LlamaConfig(n_layers=4)
    out["pp2-tp2-interleaved"] = train_and_compare(
        _setup(pp=2, tp=2, schedule="interleaved", model=deep), reference(deep))
    out.update(fully_shard_meshes(ref))
    out.update(checkpoint_reshard(ref))
    out["refusals"] = refusals()
    return out


def refusals() -> dict:
    """Bad meshes and groups: the ValueError's message (None: nothing was raised)."""
    from torch.distributed.tensor import distribute_tensor

    from hyper_adaptor.parallel.hsdp import fully_shard, hsdp

    example = _example()
    world = example.build_mesh(example.ParallelConfig(tp=2, dp=2))

    def message(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    def tp_model():
        return sys.modules["parallelize"].apply_tp(build_llama(LlamaConfig()), world["tp"])

    def two_d_param():
        layer = torch.nn.Linear(4, 4)
        layer.weight = torch.nn.Parameter(distribute_tensor(layer.weight.detach(), world["dp", "tp"],
                                                            [Replicate(), Shard(0)]))
        fully_shard(layer, world["dp"])

    three_d = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("a", "b", "c"))
    return {
        "dp-overlaps-tp": message(lambda: hsdp(tp_model(), group=dist.group.WORLD)),
        "tp-on-2d-mesh": message(two_d_param),
        "3d-without-tp": message(lambda: fully_shard(build_llama(LlamaConfig()), three_d)),
        "not-a-mesh": message(lambda: fully_shard(build_llama(LlamaConfig()), [0, 1])),
        "zero-copy-not-bool": message(lambda: fully_shard(build_llama(LlamaConfig()), comm_fusion_zero_copy="yes")),
    }


def _fully_shard_run(mesh, world_mesh, reshard_after_forward: bool):
    """The example's Run, built by hand around ``fully_shard(module, mesh)``; TP on ``world_mesh['tp']``
    first when ``world_mesh`` is given."""
    from hyper_adaptor.parallel.hsdp import fully_shard

    example = _example()
    tp = world_mesh["tp"].size() if world_mesh is not None else 1
    cfg = example.ParallelConfig(tp=tp, dp=dist.get_world_size() // tp, hsdp_level=3 if reshard_after_forward else 2)
    model = build_llama(LlamaConfig())
    if world_mesh is not None:
        sys.modules["parallelize"].apply_tp(model, world_mesh["tp"])
    else:
        world_mesh = example.build_mesh(cfg)
    for block in model.layers.values():
        fully_shard(block, mesh, reshard_after_forward=reshard_after_forward, comm_fusion_zero_copy=True)
    fully_shard(model, mesh, reshard_after_forward=reshard_after_forward)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    return example.Run(cfg, world_mesh, [(0, model)], [optimizer], None, None, 1)


def fully_shard_meshes(ref: dict) -> dict:
    out = {}
    one_d = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    out["fully_shard-1d"] = train_and_compare(_fully_shard_run(one_d, None, True), ref)
    hybrid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out["fully_shard-2d-hsdp"] = train_and_compare(_fully_shard_run(hybrid, None, False), ref)
    # dp x tp: the tp dim is the one the TP styles used (the example's mesh, sliced)
    example = _example()
    world = example.build_mesh(example.ParallelConfig(tp=2, dp=2))
    run = _fully_shard_run(world["dp", "tp"], world, True)
    out["fully_shard-2d-dp-tp"] = train_and_compare(run, ref)
    wq = run.stages[0][1].layers["0"].attention.wq.weight
    out["fully_shard-2d-dp-tp-wq"] = (tuple(wq.placements), tuple(wq.device_mesh.mesh.shape))
    # (replicate, shard, tp) with shard groups of one rank: every parameter replicated over dp
    three_d = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("replicate", "shard", "tp"))
    run = _fully_shard_run(three_d, world, False)
    out["fully_shard-3d-replicate-shard-tp"] = train_and_compare(run, ref)
    return out


def checkpoint_reshard(ref: dict) -> dict:
    """Save at TP2 x DP2 (HSDP level 3) after 2 steps, load at TP1 x DP4 (level 1): steps 3 and 4 (the
    optimizer state carried) equal the reference; then the reverse, from TP1 x DP4 back to TP2 x DP2."""
    example = _example()
    cfg = LlamaConfig()
    long_ref = reference(cfg, steps=5)
    out = {}
    box = [tempfile.mkdtemp(prefix="one_mesh_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box)
    first, second = os.path.join(box[0], "a"), os.path.join(box[0], "b")
    run = _setup(tp=2, dp=2, hsdp_level=3)
    out["dcp-save-tp2dp2"] = train_and_compare(run, long_ref, steps=2)
    example.save(run, first)
    loaded = _setup(tp=1, dp=4, hsdp_level=1)
    example.load(loaded, first)
    out["dcp-load-tp1dp4"] = train_and_compare(loaded, long_ref, steps=2, first_step=2)
    example.save(loaded, second)
    back = _setup(tp=2, dp=2, hsdp_level=2)
    example.load(back, second)
    out["dcp-load-back-tp2dp2"] = train_and_compare(back, long_ref, steps=1, first_step=4)
    dist.barrier()
    if dist.get_rank() == 0:
        import shutil

        shutil.rmtree(box[0], ignore_errors=True)
    return out


EXPECTED_PLACEMENTS = {
    # colwise: TP's chunk of rows first, then HSDP's chunk of it
    "layers.0.attention.wq.weight": ((_StridedShard(0, split_factor=2), Shard(0)), (2, 2)),
    # rowwise: TP shards columns, HSDP rows
    "layers.0.attention.wo.weight": ((Shard(0), Shard(1)), (2, 2)),
    # a plain parameter of the TP model: replicated over tp
    "layers.0.attention_norm.weight": ((Shard(0), Replicate()), (2, 2)),
    "tok_embeddings.weight": ((_StridedShard(0, split_factor=2), Shard(0)), (2, 2)),
}


def dcp_only(rank: int, world_size: int) -> dict:
    dist.init_process_group("gloo")
    return checkpoint_reshard(reference(LlamaConfig()))


def eight_ranks(rank: int, world_size: int) -> dict:
    """PP2 x TP2 x DP2 (HSDP level 3), the whole mesh at once."""
    dist.init_process_group("gloo")
    return {"pp2-tp2-dp2-level3": train_and_compare(_setup(pp=2, tp=2, dp=2, hsdp_level=3), reference(LlamaConfig()))}
