"""Rank code for test_optimizer_offload_megatron.py: megatron's --optimizer-cpu-offload served by
hyper_adaptor's OffloadOptimizer (hyper_adaptor/patches/memory/), on 2 gloo ranks.

The tiny GPT of gpt_parity (same sizes, batches and seed) is trained for 3 Adam steps at DP2 under
megatron's DDP wrapper or HSDP's, once with megatron's own optimizer and once with the offload seam
applied (a scoped PatchManager, so each run in this world starts from unpatched megatron). A run
returns its per-step losses and full parameters, what megatron built (wrapper and inner optimizer
classes) and the engine's accounting (``state_bytes``, offloaded elements).
"""

from __future__ import annotations

import io
import os
import types

import torch
import torch.distributed as dist

from tests.distributed import gpt_parity as gp

STEPS = 3


def _args(**overrides):
    base = dict(optimizer_cpu_offload=True, optimizer_offload_fraction=1.0, optimizer="adam",
                use_precision_aware_optimizer=False, main_grads_dtype="fp32", main_params_dtype="fp32",
                exp_avg_dtype="fp32", exp_avg_sq_dtype="fp32")
    base.update(overrides)
    return types.SimpleNamespace(**base)


def _hsdp_args(level: str = "level2"):
    return types.SimpleNamespace(hsdp_optimizer_level=level, hsdp_shard_size=-1, hsdp_threshold_kb=0.0,
                                 hsdp_comm_async=False, hsdp_bucket_size_kb=25600.0, hsdp_reduce_dtype=None)


# fp32 main copies megatron's bf16 / fp16 optimizer made in the current build, and the most bytes their
# storages held at once (counted as each copy is made, before anything can release it)
_MADE: list = []
_COPIES_PEAK = [0]


def _count_copies(original):
    """Probe around megatron's copy_optimizer_param_metadata (outside the offload seam's wrap of it)."""
    from hyper_adaptor.patches.memory.torch_optimizer import local_tensor as _source

    def copy_optimizer_param_metadata(destination, source, *args, **kwargs):
        if destination.dtype == torch.float32 and source.dtype != torch.float32:
            _MADE.append(destination)
            live = sum(_source(d).untyped_storage().nbytes() for d in _MADE)
            _COPIES_PEAK[0] = max(_COPIES_PEAK[0], live)
        return original(destination, source, *args, **kwargs)

    return copy_optimizer_param_metadata


def _manager(offload: bool, hsdp: bool | str):
    """A scoped PatchManager with the offload seam and / or HSDP's patches (``hsdp``: its level, or True),
    and the probe that counts megatron's fp32 main copies as they are made."""
    from hyper_adaptor.patch_manager import Patch, PatchManager
    from hyper_adaptor.patches.memory import optimizer as offload_patches

    manager = PatchManager()
    manager.register(Patch(offload_patches.PARAM_METADATA, _count_copies, "wrap", "probe",
                           after=(offload_patches.FEATURE,)))
    if offload:
        manager.register_all(offload_patches.patches(_args()))
    if hsdp:
        from hyper_adaptor.patches.hsdp import patches as hsdp_patches

        manager.register_all(hsdp_patches.patches(_hsdp_args(hsdp if isinstance(hsdp, str) else "level2")))
    return manager


def _build(run: dict):
    """gpt_parity's GPT (TP1, PP1) under megatron DDP or HSDP, and megatron's optimizer for it."""
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    bf16, dist_opt = run.get("bf16", False), run.get("distributed_optimizer", False)
    fp16 = run.get("fp16", False)
    ps.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(gp.Layout.seed)
    torch.manual_seed(gp.Layout.seed)
    dtype = torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32
    config = TransformerConfig(
        num_layers=gp.LAYERS, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, hidden_dropout=0.0,
        attention_dropout=0.0, use_cpu_initialization=True, pipeline_dtype=dtype, params_dtype=dtype, bf16=bf16,
        fp16=fp16,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=gp.VOCAB,
                     max_sequence_length=gp.SEQ, share_embeddings_and_output_weights=True)
    if bf16 or fp16:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(config, model)
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=dist_opt)
    if run.get("hsdp"):
        from hyper_adaptor.patches.hsdp.data_parallel import make_wrapper_class
        from hyper_adaptor.patches.hsdp.patches import hsdp_kwargs

        level = run.get("hsdp_level", "level2")
        chunk = make_wrapper_class(hsdp_kwargs(_hsdp_args(level)))(config=config, ddp_config=ddp_config, module=model)
    else:
        chunk = DistributedDataParallel(config, ddp_config, model)
    opt_config = OptimizerConfig(
        optimizer="adam", lr=1e-3, weight_decay=0.01, clip_grad=1.0, bf16=bf16, fp16=fp16, params_dtype=dtype,
        loss_scale=128.0 if fp16 else None,  # static: megatron's unscaling of the (decoupled) gradients runs
        use_distributed_optimizer=dist_opt, optimizer_cpu_offload=run.get("offload", False),
        optimizer_offload_fraction=run.get("fraction", 1.0),
        use_precision_aware_optimizer=run.get("precision_aware", False))
    return config, chunk, get_megatron_optimizer(opt_config, [chunk])


def _full_params(chunk) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in chunk.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[gp._global_name(chunk, name)] = value.detach().float().clone()
    return out


def _train_steps(config, chunk, optimizer, steps: range) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config.finalize_model_grads_func = finalize_model_grads
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    num_micro = gp.GLOBAL_BATCH // gp.MICRO_BATCH // dp_size
    forward_backward = get_forward_backward_func()

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        return output, lambda out: (out.float().mean(), {"lm loss": out.float().mean().detach()})

    history = []
    for step in steps:
        micro = gp._micro_batch_dicts(gp._batches(step, gp.Layout.seed))
        mine = micro[dp_rank * num_micro: (dp_rank + 1) * num_micro]
        chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses = forward_backward(forward_step_func=forward_step, data_iterator=iter(mine), model=chunk,
                                  num_microbatches=num_micro, seq_length=gp.SEQ, micro_batch_size=gp.MICRO_BATCH,
                                  forward_only=False)
        loss = torch.stack([d["lm loss"] for d in losses]).sum()
        dist.all_reduce(loss, group=ps.get_data_parallel_group())
        ok, _, _ = optimizer.step()
        assert ok
        history.append({"loss": loss.item() / dp_size, "params": _full_params(chunk)})
    return history


def _inner(optimizer):
    return getattr(optimizer, "chained_optimizers", [optimizer])[0].optimizer


def _accounting(optimizer) -> dict:
    inner = _inner(optimizer)
    out = {"wrapper": type(getattr(optimizer, "chained_optimizers", [optimizer])[0]).__name__,
           "inner": type(inner).__name__}
    engine = getattr(inner, "engine", None)
    wrapper = getattr(optimizer, "chained_optimizers", [optimizer])[0]
    mains = getattr(wrapper, "shard_fp32_from_float16_groups", None)
    if mains is not None:  # the distributed optimizer's fp32 main shards of half-precision parameters
        out["fp32_main_bytes"] = sum(m.numel() * m.element_size() for g in mains for m in g if m is not None)
        out["half_shard_elements"] = sum(p.numel() for g in wrapper.shard_float16_groups for p in g)
    copies = getattr(wrapper, "fp32_from_float16_groups", None)
    if copies is not None:  # megatron's bf16 / fp16 optimizer's fp32 main copies: bytes their storages hold
        from hyper_adaptor.patches.memory.torch_optimizer import local_tensor as _source

        out["fp32_main_bytes"] = sum(_source(m).untyped_storage().nbytes() for g in copies for m in g)
        out["half_elements"] = sum(_source(p).numel() for g in wrapper.float16_groups for p in g)
        # what megatron.training's --log-params-norm reads: main_param, the host master where it is one
        hosts = {m.untyped_storage().data_ptr() for m in engine.masters.values()} if engine is not None else set()
        out["main_param_is_host_master"] = sum(
            _source(p.main_param).untyped_storage().data_ptr() in hosts for g in wrapper.float16_groups for p in g)
    if engine is not None:
        out["state_bytes"] = inner.state_bytes()
        out["offloaded"] = sum(p.numel() for p in engine.masters)
        out["total"] = sum(p.numel() for g in engine.param_groups for p in g["params"])
        out["largest"] = max(p.numel() for g in engine.param_groups for p in g["params"])
        out["host_state_devices"] = sorted({v.device.type for s in engine.host_optimizer.state.values()
                                            for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
                                           if engine.host_optimizer is not None else [])
        out["device_master_elements"] = sum(m.numel() for m in getattr(engine, "device_masters", {}).values())
    # what megatron's wrapper reads as the torch optimizer's state: every parameter has Adam's moments
    out["state_keys"] = sorted({k for s in inner.state.values() for k in s})
    out["params_with_state"] = len(inner.state)
    out["params"] = sum(len(g["params"]) for g in inner.param_groups)
    return out


def train(run: dict) -> dict:
    """``run``: offload, fraction, bf16, distributed_optimizer, hsdp (bools / numbers), hsdp_level."""
    from megatron.core import parallel_state as ps

    hsdp = run.get("hsdp_level", "level2") if run.get("hsdp") else False
    with _manager(run.get("offload", False), hsdp).applied():
        _MADE.clear()
        _COPIES_PEAK[0] = 0
        config, chunk, optimizer = _build(run)
        from hyper_adaptor.patches.memory.torch_optimizer import local_tensor as _source

        copies = {"copies_peak_bytes": _COPIES_PEAK[0],  # a copy's bytes: its local shard's under HSDP
                  "largest_copy_bytes": max((_source(d).numel() * 4 for d in _MADE), default=0)}
        _MADE.clear()
        history = _train_steps(config, chunk, optimizer, range(STEPS))
        accounting = _accounting(optimizer)
    ps.destroy_model_parallel()
    return {"history": history, **accounting, **copies}


def _checkpoint_state(chunk, optimizer, is_loading: bool) -> dict:
    """What megatron.training saves (and the template a load fills) for --ckpt-format torch_dist:
    its own generate_state_dict over the unwrapped chunk (HSDP localizes its shards there)."""
    from megatron.core import parallel_state as ps
    from megatron.core.utils import unwrap_model
    from megatron.training.checkpointing import generate_state_dict

    args = types.SimpleNamespace(ckpt_format="torch_dist", no_save_optim=False, no_save_rng=True)
    # megatron.training's metadata (_build_sharded_state_dict_metadata) for its default flags
    metadata = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True),
                "distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                "chained_optim_avoid_prefix": True}
    state = generate_state_dict(args, unwrap_model([chunk]), optimizer, None, None,
                                optim_sd_kwargs={"metadata": metadata, "is_loading": is_loading})
    return {"model": state["model"], "optimizer": state["optimizer"]}


def resume(run: dict, tmpdir: str, offload: bool = True) -> dict:
    """2 steps, a megatron torch_dist checkpoint (model + optimizer), a fresh model and optimizer
    loaded from it, the 3rd step: returns the resumed run's 3rd step."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    path = os.path.join(tmpdir, "_".join(f"{k}-{v}" for k, v in sorted({**run, "offload": offload}.items())))
    with _manager(offload, run.get("hsdp", False)).applied():
        config, chunk, optimizer = _build({**run, "offload": offload})
        _train_steps(config, chunk, optimizer, range(STEPS - 1))
        if dist.get_rank() == 0:
            os.makedirs(path, exist_ok=True)
        dist.barrier()
        dist_checkpointing.save(_checkpoint_state(chunk, optimizer, False), path)
        dist.barrier()
        ps.destroy_model_parallel()

        config, chunk, optimizer = _build({**run, "offload": offload})
        if run.get("distributed_optimizer"):
            # megatron 0.19.2's distributed optimizer over torch's AdamW (no TE / apex) cannot describe a
            # checkpoint before its first step (DistributedOptimizer.state_dict asserts one 'step' over
            # an empty state), and does not restore the step count over a trained one (seen: the
            # template's count stays) — both without the offload too. So load over one trained as
            # many steps from other parameters: its moments and parameters differ from the saved ones
            # and must be replaced.
            with torch.no_grad():
                for p in chunk.parameters():
                    p.add_(0.25)
            _train_steps(config, chunk, optimizer, range(STEPS - 1))
        with torch.no_grad():  # parameters that differ from the saved ones until they are loaded
            for p in chunk.parameters():
                p.add_(0.5)
        loaded = dist_checkpointing.load(_checkpoint_state(chunk, optimizer, True), path)
        chunk.load_state_dict(loaded["model"])
        with torch.no_grad():  # the fp32 distributed optimizer's main shards are views of leaf parameters
            optimizer.load_state_dict(loaded["optimizer"])
        host = _accounting(optimizer)
        history = _train_steps(config, chunk, optimizer, range(STEPS - 1, STEPS))
    ps.destroy_model_parallel()
    return {"history": history, "after_load": host}


def reload_params(run: dict) -> dict:
    """1 step, the model parameters written outside the optimizer (+0.5, as a checkpoint's model weights
    loaded with --no-load-optim would be) and megatron's ``reload_model_params``, 1 more step."""
    from megatron.core import parallel_state as ps

    with _manager(run.get("offload", False), run.get("hsdp", False)).applied():
        config, chunk, optimizer = _build(run)
        _train_steps(config, chunk, optimizer, range(1))
        with torch.no_grad():
            for p in chunk.parameters():
                p.add_(0.5)
        optimizer.reload_model_params()
        history = _train_steps(config, chunk, optimizer, range(1, 2))
    ps.destroy_model_parallel()
    return {"history": history}


def _plain_state_dict_round_trip() -> dict:
    """megatron's state_dict of an offloaded FP32Optimizer through torch.save(weights_only load)."""
    from megatron.core import parallel_state as ps

    with _manager(True, False).applied():
        config, chunk, optimizer = _build({"offload": True})
        _train_steps(config, chunk, optimizer, range(1))
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        buffer.seek(0)
        try:
            saved = torch.load(buffer, weights_only=True)
        except Exception as error:
            saved = {"error": f"{type(error).__name__}: {error}"[:300]}
    ps.destroy_model_parallel()
    if "error" in saved:
        return saved
    return {"keys": sorted({k for s in saved["state"].values() for k in s}), "entries": len(saved["state"])}


RUNS = {
    "ddp": {},
    "distopt": {"distributed_optimizer": True},
    "bf16": {"bf16": True},
    "fp16": {"fp16": True},  # static loss scale: megatron unscales the main copies' gradients
    "bf16-distopt": {"bf16": True, "distributed_optimizer": True},
    "hsdp": {"hsdp": True},
    "hsdp-bf16": {"hsdp": True, "bf16": True},
    "hsdp-level3": {"hsdp": True, "hsdp_level": "level3"},
    "hsdp-level3-bf16": {"hsdp": True, "hsdp_level": "level3", "bf16": True},
}
# megatron's precision-aware path (--use-precision-aware-optimizer): its distributed optimizer keeps no fp32
# main shards and hands the bf16 shards to its CPU-offload optimizer (OffloadedHybridOptimizer); compared
# with the plain bf16 distributed optimizer's run (megatron's precision-aware optimizer needs TE otherwise)
PRECISION_AWARE = {
    "bf16-distopt-pa": {"bf16": True, "distributed_optimizer": True, "precision_aware": True},
    "bf16-distopt-pa-half": {"bf16": True, "distributed_optimizer": True, "precision_aware": True, "fraction": 0.5},
    "fp16-distopt-pa": {"fp16": True, "distributed_optimizer": True, "precision_aware": True},
}


def all_checks(rank: int, world_size: int, tmpdir: str) -> dict:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    out = {"runs": {}, "resume": {}}
    for name, run in RUNS.items():
        out["runs"][name] = {"reference": train(run), "offload": train({**run, "offload": True})}
    out["runs"]["half"] = {"offload": train({"offload": True, "fraction": 0.5})}
    out["runs"]["bf16-half"] = {"offload": train({"offload": True, "fraction": 0.5, "bf16": True})}
    references = {"bf16": out["runs"]["bf16-distopt"]["reference"],
                  "fp16": train({"fp16": True, "distributed_optimizer": True})}
    for name, run in PRECISION_AWARE.items():
        out["runs"][name] = {"reference": references["fp16" if run.get("fp16") else "bf16"],
                             "offload": train({**run, "offload": True})}
    for name in ("ddp", "distopt", "bf16", "hsdp", "hsdp-bf16"):
        out["resume"][name] = resume(RUNS[name], tmpdir)
    out["resume"]["bf16-distopt-pa"] = resume(PRECISION_AWARE["bf16-distopt-pa"], tmpdir)
    out["weights_only"] = _plain_state_dict_round_trip()
    out["reload"] = {"reference": reload_params(RUNS["bf16"]),
                     "offload": reload_params({**RUNS["bf16"], "offload": True})}
    return out
