"""Rank code for test_hsdp_experts.py: a megatron-core GPT with MoE layers under expert parallelism,
trained a few Adam steps with megatron's DDP + distributed optimizer and then with --use-hsdp's
wrapper (hyper_adaptor/patches/hsdp) at the same layout, in one world.

Every run starts from the same weights (same seeds, same layout) and sees the same batches; each
returns its per-step loss and gradient norm (what megatron.training logs) and this rank's parameters
after the last step (TP/EP-local, whole over data parallel), so the test compares HSDP with DDP on
every rank. The DDP runs come first: HSDP's patches, once applied, stay applied in the process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_adaptor.testing.gpt import build_gpt_moe, forward_step
from tests.distributed.gpt_parity import MICRO_BATCH, SEQ, VOCAB, _micro_batch_dicts

LAYERS, EXPERTS, TOPK, GLOBAL_BATCH, STEPS, SEED = 2, 4, 2, 16, 3, 1234
CLIP = 0.5  # below the first steps' gradient norms (about 0.57 and 0.55): clipping acts, then does not
# the model's sizes (bench/_moe_memory.py builds the same model larger)
DIMS = dict(layers=LAYERS, hidden=64, heads=4, ffn=128, experts=EXPERTS, topk=TOPK, moe_ffn=96, seq=SEQ, vocab=VOCAB)


def _batches(step: int) -> list:
    g = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return [tokens[i : i + MICRO_BATCH] for i in range(0, GLOBAL_BATCH, MICRO_BATCH)]


def _build(run: dict):
    """The GPT-MoE of ``run`` at this file's sizes (hyper_adaptor/testing/gpt.py). ``wrong_expert_scale``:
    the negative control, experts averaged over their own group only."""
    if not run.get("wrong_expert_scale"):
        return build_gpt_moe(run, DIMS, seed=SEED, clip=CLIP)
    from hyper_adaptor.patches.hsdp import data_parallel

    right = data_parallel._expert_kwargs
    data_parallel._expert_kwargs = lambda kw, *groups: {**right(kw, *groups), "grad_scale": 1.0}
    try:
        return build_gpt_moe(run, DIMS, seed=SEED, clip=CLIP)
    finally:
        data_parallel._expert_kwargs = right


def _local(param) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()


def _layout(model) -> dict:
    """Which group each kind of parameter is sharded over: (mesh size, sharded?) per kind."""
    from torch.distributed.tensor import DTensor

    out = {}
    for param in model.parameters():
        kind = "expert" if not getattr(param, "allreduce", True) else "dense"
        if isinstance(param, DTensor):
            out.setdefault(kind, set()).add((param.device_mesh.size(), any(p.is_shard() for p in param.placements)))
    return {k: sorted(v) for k, v in out.items()}


def train(run: dict) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config, model, chunk, optimizer = _build(run)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss  # (fp16: the loss scaler's; 1 otherwise)
    if run.get("load"):
        _load(run, model, chunk)
    if run.get("overflow_in"):
        result = _found_inf(run["overflow_in"], optimizer)
        ps.destroy_model_parallel()
        return result
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    num_micro = GLOBAL_BATCH // MICRO_BATCH // dp_size

    losses, norms, scales, skipped = [], [], [], []
    for step in range(run.get("steps", STEPS)):
        mine = _micro_batch_dicts(_batches(step))[dp_rank * num_micro : (dp_rank + 1) * num_micro]
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mine), model=chunk,
                                          num_microbatches=num_micro, seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                          forward_only=False)
        loss = torch.stack([d["lm loss"] for d in out]).sum()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        losses.append(loss.item() / dp_size)
        scales.append(float(optimizer.get_loss_scale()))
        ok, grad_norm, _ = optimizer.step()
        skipped.append(not ok)  # fp16: an overflow anywhere skips the step on every rank
        norms.append(float(grad_norm) if ok else float("nan"))
    if run.get("save"):
        _save(run, model)
    params = {name: _local(p) for name, p in model.named_parameters()}
    result = {"loss": losses, "grad_norm": norms, "loss_scale": scales, "skipped": skipped, "params": params,
              "layout": _layout(model),
              "optimizers": len(getattr(optimizer, "chained_optimizers", [optimizer]))}
    ps.destroy_model_parallel()
    return result


def _found_inf(kind: str, optimizer) -> dict:
    """fp16: an inf in one ``kind`` ("dense" / "expert") gradient shard of rank 0 only; with HSDP's
    shards every rank must skip the step (megatron's chained optimizer: the dense and the expert
    optimizer each check their own gradients, over their own model-parallel groups)."""
    from torch.distributed.tensor import DTensor

    planted = False
    for sub in optimizer.chained_optimizers:
        for group in sub.float16_groups:
            for param in group:
                grad = torch.zeros_like(param)
                local = grad._local_tensor if isinstance(grad, DTensor) else grad
                is_expert = not getattr(param, "allreduce", True)
                if dist.get_rank() == 0 and not planted and is_expert == (kind == "expert") and local.numel():
                    local.view(-1)[0] = float("inf")
                    planted = True
                param.grad = grad
    return {"found_inf": bool(optimizer.prepare_grads()), "planted": planted}


def _model_state(run: dict, model):
    """megatron's description of the model's checkpoint entries; HSDP's as --use-hsdp writes them
    (this rank's rows at their global offsets: hyper_adaptor/patches/hsdp/checkpoint.py)."""
    state = model.sharded_state_dict()
    if run.get("hsdp"):
        from hyper_adaptor.patches.hsdp.checkpoint import localize_sharded_state_dict

        state = localize_sharded_state_dict(state)
    return state


def _save(run: dict, model) -> None:
    import os

    from megatron.core import dist_checkpointing

    if dist.get_rank() == 0:
        os.makedirs(run["save"], exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_model_state(run, model), run["save"])
    dist.barrier()


def _load(run: dict, model, chunk) -> None:
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load(_model_state(run, model), run["load"])
    (chunk if run.get("hsdp") else model).load_state_dict(loaded)


def parity(rank: int, world_size: int, runs: dict) -> dict:
    """``runs``: name -> run (ep, tp, etp, hsdp level or None, shard size); DDP runs first."""
    dist.init_process_group("gloo")
    results = {}
    for name, run in runs.items():
        try:
            results[name] = train(run)
        except Exception as error:  # a refused run is a result (today's code refuses them all)
            import traceback

            results[name] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-1500:]}"
            break  # the other ranks may be stuck in a collective this one left
    return results
