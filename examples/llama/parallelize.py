"""Every parallelism on one mesh for the Llama model of ``hyper_adaptor.testing.llama``.

One DeviceMesh with dims ``(pp, dp, cp, tp)`` (tp innermost: its ranks are neighbours). The order, one
function each, is torchtitan's:

1. ``split_pipeline``   — this rank's pipeline stage(s) of the whole model (``pp``), before anything else,
   so every later step sees only the layers it will run;
2. ``apply_tp``         — tensor parallel (and sequence parallel) on ``tp``: projections become DTensors;
3. ``apply_cp``         — context parallel on ``cp``: the core attention of every layer;
4. ``apply_memory``     — activation checkpointing or swapping per layer (``hyper_adaptor.memory``),
   around the TP / CP modules so that a recomputation replays their communication;
5. ``apply_hsdp``       — HSDP over the data-parallel ranks (``dp`` x ``cp``: context-parallel ranks hold
   the same weights and see different tokens, so their gradients are reduced together), last, so it
   wraps the TP DTensors and shards their TP-local tensors over data parallel.

``parallelize(model, mesh, cfg)`` runs them; ``ParallelConfig`` holds the choices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from hyper_adaptor.memory import checkpoint_wrapper, swap_wrapper
from hyper_adaptor.parallel import (
    ColwiseParallel,
    ContextParallel,
    PipelineStage,
    PrepareModuleInput,
    Replicate,
    RowwiseParallel,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBH1,
    ScheduleZBV,
    SequenceParallel,
    Shard,
    init_device_mesh,
    parallelize_module,
)
from hyper_adaptor.parallel.hsdp import hsdp
from hyper_adaptor.testing.llama import Llama, loss_fn, split_stage

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "zbh1": ScheduleZBH1,
             "interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBV}
MULTI_STAGE = ("interleaved", "zbv")  # two stages per rank
ZERO_BUBBLE = ("zbh1", "zbv")
MEMORY = ("none", "checkpoint", "swap")
CP_ALGOS = ("ring", "ulysses", "allgather")
DIMS = ("pp", "dp", "cp", "tp")


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1
    dp_shard: int = -1  # ranks of dp x cp each HSDP shard group spans (-1: all of them; fewer: replicas)
    hsdp_level: int = 0  # 0: plain data parallel (gradients all-reduced), 1/2/3: HSDP's optimizer levels
    sequence_parallel: bool = False
    cp_algo: str = "ring"
    memory: str = "none"
    schedule: str = "1f1b"
    micro_batches: int = 2

    def validate(self, world_size: int, model_cfg=None) -> None:
        """Every bad choice is a ValueError naming the option (the example turns it into a usage error)."""
        for name in ("pp", "dp", "cp", "tp", "micro_batches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive int; got {value!r}")
        if self.pp * self.dp * self.cp * self.tp != world_size:
            raise ValueError(f"--pp {self.pp} x --dp {self.dp} x --cp {self.cp} x --tp {self.tp} must equal the "
                             f"world size {world_size}")
        if self.hsdp_level not in (0, 1, 2, 3):
            raise ValueError(f"--hsdp-level must be 0, 1, 2 or 3; got {self.hsdp_level!r}")
        group = self.dp * self.cp
        if self.dp_shard != -1 and (self.dp_shard < 1 or group % self.dp_shard):
            raise ValueError(f"--dp-shard must be -1 or a divisor of dp x cp = {group}; got {self.dp_shard!r}")
        if self.cp_algo not in CP_ALGOS:
            raise ValueError(f"--cp-algo must be one of {CP_ALGOS}; got {self.cp_algo!r}")
        if self.memory not in MEMORY:
            raise ValueError(f"--memory must be one of {MEMORY}; got {self.memory!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {tuple(SCHEDULES)}; got {self.schedule!r}")
        if self.schedule in ZERO_BUBBLE and self.pp > 1 and self.hsdp_level and self.dp * self.cp > 1:
            # their W steps add weight gradients outside autograd, where HSDP's gradient hooks never run
            raise ValueError(f"--schedule {self.schedule} defers weight gradients past HSDP's reduction: use it "
                             f"with --hsdp-level 0 (gradients averaged after the step) or another schedule")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("--sequence-parallel needs --tp > 1")
        if model_cfg is not None:
            stages = self.pp * (2 if self.schedule in MULTI_STAGE and self.pp > 1 else 1)
            if stages > model_cfg.n_layers:
                raise ValueError(f"--pp {self.pp} with --schedule {self.schedule} needs {stages} stages; the model "
                                 f"has {model_cfg.n_layers} layers (--layers)")
            for name, value in (("heads", model_cfg.n_heads), ("kv-heads", model_cfg.n_kv_heads),
                                ("ffn-hidden", model_cfg.ffn_hidden), ("vocab", model_cfg.vocab_size)):
                if value % self.tp:
                    raise ValueError(f"--tp {self.tp} must divide --{name} {value}")
            if self.tp > 1 and model_cfg.tie_embeddings:
                raise ValueError("--tp > 1 needs untied embeddings (the embedding is sharded by rows, the "
                                 "output by columns of the same matrix)")


def build_mesh(cfg: ParallelConfig, device_type: str = "cpu"):
    """The one mesh: dims (pp, dp, cp, tp), each present even at size 1 (slicing stays uniform)."""
    return init_device_mesh(device_type, (cfg.pp, cfg.dp, cfg.cp, cfg.tp), mesh_dim_names=DIMS)


# -- 1. pipeline ----------------------------------------------------------------------------------------
def split_pipeline(model: Llama, mesh, cfg: ParallelConfig) -> list[tuple[int, Llama]]:
    """``[(stage_index, stage module)]`` of this rank: one stage, or two (interleaved: r and r + pp;
    ZBV: the V, r and 2 pp - 1 - r)."""
    pp, r = cfg.pp, mesh["pp"].get_local_rank()
    if pp == 1:
        return [(0, model)]
    if cfg.schedule == "interleaved":
        indices = [r, r + pp]
    elif cfg.schedule == "zbv":
        indices = [r, 2 * pp - 1 - r]
    else:
        indices = [r]
    total = pp * len(indices)
    return [(i, split_stage(model, i, total)) for i in indices]


# -- 2. tensor (and sequence) parallel ------------------------------------------------------------------
def apply_tp(model: Llama, tp_mesh, sequence_parallel: bool = False) -> Llama:
    """Megatron's split: q/k/v and w1/w3 by columns, wo and w2 by rows (one all-reduce each after
    attention and after the feed-forward); the embedding by vocabulary rows, the output by vocabulary
    columns with the logits gathered. Sequence parallel keeps the norms and residuals sequence-sharded
    between the blocks instead (all-gather before, reduce-scatter after)."""
    if tp_mesh.size() == 1:
        return model
    seq = Shard(1)
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(),
                                                 output_layouts=seq if sequence_parallel else Replicate())
    if model.output is not None:
        plan["output"] = ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                         output_layouts=Replicate())
        if sequence_parallel:
            plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        layer_plan = {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate()),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate()),
        }
        if sequence_parallel:
            layer_plan.update({
                "attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                use_local_output=True),
                "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),
            })
        parallelize_module(block, tp_mesh, layer_plan)
    return model


# -- 3. context parallel --------------------------------------------------------------------------------
def apply_cp(model: Llama, cp_mesh, algo: str = "ring") -> Llama:
    """Each rank holds a contiguous slice of the sequence (``cp_rank`` places its RoPE positions); the
    core attention of every layer becomes ``ContextParallel`` over ``cp``."""
    if cp_mesh.size() == 1:
        return model
    style = {"ring": dict(algo="ring"), "ulysses": dict(ulysses_degree=None), "allgather": dict(ulysses_degree=1)}
    for block in model.layers.values():
        block.attention.cp_rank = cp_mesh.get_local_rank()
        parallelize_module(block.attention.core_attention, cp_mesh,
                           ContextParallel(seq_dim=1, head_dim=2, load_balance=False, **style[algo]))
    return model


# -- 4. activation checkpoint / swap --------------------------------------------------------------------
def apply_memory(model: Llama, mode: str) -> Llama:
    for block in model.layers.values():
        if mode == "checkpoint":
            checkpoint_wrapper(block)
        elif mode == "swap":
            swap_wrapper(block)
    return model


# -- 5. HSDP --------------------------------------------------------------------------------------------
def data_parallel_group(mesh, cfg: ParallelConfig):
    """The ranks holding the same weights: dp x cp of this rank's pipeline stage and tp position."""
    if cfg.dp * cfg.cp == 1:
        return None
    if cfg.cp == 1:
        return mesh["dp"].get_group()
    if cfg.dp == 1:
        return mesh["cp"].get_group()
    return mesh["dp", "cp"]._flatten("dp_cp").get_group()


def apply_hsdp(model: Llama, group, cfg: ParallelConfig) -> Llama:
    """Each layer a unit of its own, then the root (the embedding, final norm and output)."""
    if group is None or cfg.hsdp_level == 0:
        return model
    options = dict(shard_size=cfg.dp_shard, threshold=0, optimizer_level=f"level{cfg.hsdp_level}",
                   enable_grad_accumulation=True, comm_fusion=True, group=group)
    for block in model.layers.values():
        hsdp(block, **options)
    return hsdp(model, **options)


def average_gradients(modules, group) -> None:
    """``--hsdp-level 0``: plain data parallel, gradients averaged over ``group`` (DTensor ones on their
    TP-local tensors: data parallel does not change their TP placement)."""
    if group is None:
        return
    size = dist.get_world_size(group)
    for module in modules:
        for param in module.parameters():
            if param.grad is not None:
                local = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                dist.all_reduce(local, group=group)
                local.div_(size)


def parallelize(model: Llama, mesh, cfg: ParallelConfig) -> list[tuple[int, Llama]]:
    """This rank's ``[(stage_index, module)]``, every step applied in the order of the module doc."""
    stages = split_pipeline(model, mesh, cfg)
    group = data_parallel_group(mesh, cfg)
    out = []
    for index, stage in stages:
        apply_tp(stage, mesh["tp"], cfg.sequence_parallel)
        apply_cp(stage, mesh["cp"], cfg.cp_algo)
        apply_memory(stage, cfg.memory)
        out.append((index, apply_hsdp(stage, group, cfg)))
    return out


def build_schedule(stages: list[tuple[int, Llama]], mesh, cfg: ParallelConfig, loss=loss_fn):
    """The pipeline schedule over ``pp`` (None when pp is 1). The loss of each micro-batch is divided
    by their number: the schedule's gradients are those of the sum."""
    if cfg.pp == 1:
        return None
    total = cfg.pp * len(stages)
    group = mesh["pp"].get_group()
    pipeline_stages = [PipelineStage(module, index, total, group=group) for index, module in stages]
    m = cfg.micro_batches

    def scaled(out, target):
        return loss(out, target) / m

    first = pipeline_stages if cfg.schedule in MULTI_STAGE else pipeline_stages[0]
    return SCHEDULES[cfg.schedule](first, m, loss_fn=scaled)


def local_batch(tokens: torch.Tensor, mesh, cfg: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's (input, target) of a global batch ``[B, S + 1]``: rows by dp, a contiguous sequence
    slice by cp (the same for every tp and pp rank)."""
    x, y = tokens[:, :-1], tokens[:, 1:]
    dp_rank, cp_rank = mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank()
    rows, cols = x.shape[0] // cfg.dp, x.shape[1] // cfg.cp
    pick = (slice(dp_rank * rows, (dp_rank + 1) * rows), slice(cp_rank * cols, (cp_rank + 1) * cols))
    return x[pick].contiguous(), y[pick].contiguous()
