"""Train the small Llama with pipeline, tensor, context and (hybrid sharded) data parallel on one mesh.

    torchrun --nproc-per-node 4 examples/llama/train.py --tp 2 --dp 2 --hsdp-level 3 --steps 5
    torchrun --nproc-per-node 4 examples/llama/train.py --pp 2 --tp 2 --schedule interleaved --layers 4
    torchrun --nproc-per-node 4 examples/llama/train.py --tp 2 --cp 2 --hsdp-level 1
    torchrun --nproc-per-node 4 examples/llama/train.py --tp 2 --dp 2 --hsdp-level 3 --steps 2 \\
        --checkpoint-dir /tmp/ckpt          # then --tp 1 --dp 4 --checkpoint-dir /tmp/ckpt resumes it

CPU and gloo by default (``--device cuda`` / ``npu`` with their backend). The world size must equal
pp x dp x cp x tp. Prints the loss of every step (the mean over the global batch) on rank 0. With
``--checkpoint-dir`` a checkpoint there is loaded first (any layout: torch.distributed.checkpoint
reshards) and one is saved after the last step. The order in which the parallelisms are applied is
in parallelize.py.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from parallelize import (
    ParallelConfig,
    average_gradients,
    build_mesh,
    build_schedule,
    data_parallel_group,
    local_batch,
    parallelize,
)

from hyper_adaptor.testing.llama import LlamaConfig, build_llama, loss_fn

_DCP = StateDictOptions(flatten_optimizer_state_dict=True)


@dataclass
class Run:
    cfg: ParallelConfig
    mesh: object
    stages: list  # [(stage_index, module)]
    optimizers: list  # one per stage module
    schedule: object
    group: object
    total_stages: int


def setup(cfg: ParallelConfig, model_cfg: LlamaConfig, lr: float = 1e-2, seed: int = 0,
          device_type: str = "cpu") -> Run:
    cfg.validate(dist.get_world_size(), model_cfg)
    mesh = build_mesh(cfg, device_type)
    model = build_llama(model_cfg, seed)
    if device_type != "cpu":
        model.to(device_type)
    stages = parallelize(model, mesh, cfg)
    # built after wrapping: parameters() then yields HSDP's shards
    optimizers = [torch.optim.Adam(module.parameters(), lr=lr) for _, module in stages]
    return Run(cfg, mesh, stages, optimizers, build_schedule(stages, mesh, cfg), data_parallel_group(mesh, cfg),
               cfg.pp * len(stages))


def forward_backward(run: Run, tokens: torch.Tensor) -> float:
    """Gradients of the global batch ``tokens`` [B, S + 1]; returns its mean loss on every rank."""
    cfg = run.cfg
    x, y = (t.to(run.mesh.device_type) for t in local_batch(tokens, run.mesh, cfg))
    indices = [i for i, _ in run.stages]
    last = run.total_stages - 1 in indices
    if run.schedule is not None:
        losses: list = []
        run.schedule.step(*((x,) if 0 in indices else ()), target=y if last else None, losses=losses)
        local = float(sum(loss.detach() for loss in losses)) if last else 0.0
    else:
        loss = loss_fn(run.stages[0][1](x), y)
        loss.backward()
        local = float(loss.detach())
    if cfg.hsdp_level == 0:
        average_gradients([m for _, m in run.stages], run.group)
    # every (dp, cp) position of the last stage holds the mean of its share; tp ranks hold copies
    share = local if last and run.mesh["tp"].get_local_rank() == 0 else 0.0
    total = torch.tensor(share, dtype=torch.float64)
    dist.all_reduce(total)
    return float(total) / (cfg.dp * cfg.cp)


def train_step(run: Run, tokens: torch.Tensor) -> float:
    loss = forward_backward(run, tokens)
    for optimizer in run.optimizers:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for _, module in run.stages:
        if hasattr(module, "zero_grads"):
            module.zero_grads()
    return loss


def global_batch(step: int, model_cfg: LlamaConfig, batch: int, seq: int) -> torch.Tensor:
    """The same tokens on every rank for a step (each rank then takes its share)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, model_cfg.vocab_size, (batch, seq + 1), generator=g)


def _state_dicts(run: Run) -> list[tuple[dict, dict]]:
    return [get_state_dict(module, optimizer, options=_DCP)
            for (_, module), optimizer in zip(run.stages, run.optimizers)]


def save(run: Run, path: str) -> None:
    """Model and optimizer state under their parameter names (the whole model's at every layout)."""
    state: dict = {}
    for model_sd, optim_sd in _state_dicts(run):
        state.update(model_sd)
        state.update({f"optim.{k}": v for k, v in optim_sd.items()})
    dcp.save(state, checkpoint_id=path)


def load(run: Run, path: str) -> None:
    """What ``save`` wrote at any layout, resharded to this one."""
    parts = _state_dicts(run)
    state: dict = {}
    for model_sd, optim_sd in parts:
        state.update(model_sd)
        state.update({f"optim.{k}": v for k, v in optim_sd.items()})
    dcp.load(state, checkpoint_id=path)
    for ((_, module), optimizer), (model_sd, optim_sd) in zip(zip(run.stages, run.optimizers), parts):
        set_state_dict(module, optimizer, model_state_dict={k: state[k] for k in model_sd},
                       optim_state_dict={k: state[f"optim.{k}"] for k in optim_sd}, options=_DCP)
        optimizer.zero_grad(set_to_none=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("pp", "dp", "cp", "tp"):
        p.add_argument(f"--{name}", type=int, default=None if name == "dp" else 1,
                       help=f"{name} size" + (" (default: what the world leaves)" if name == "dp" else ""))
    p.add_argument("--dp-shard", type=int, default=-1, help="HSDP shard group size within dp x cp (-1: all)")
    p.add_argument("--hsdp-level", type=int, default=0, help="0: plain data parallel; 1, 2, 3: HSDP's levels")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--cp-algo", default="ring", help="ring | ulysses | allgather")
    p.add_argument("--memory", default="none", help="none | checkpoint | swap (per layer)")
    p.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | zbh1 | interleaved | zbv")
    p.add_argument("--micro-batches", type=int, default=2, help="per step, with --pp > 1")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-hidden", type=int, default=48)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--tie-embeddings", action="store_true")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--device", default="cpu")
    return p


def main(argv=None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    backend = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}.get(args.device)
    if backend is None:
        parser.error(f"--device must be cpu, cuda or npu; got {args.device!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fixed = args.pp * args.cp * args.tp
    dp = args.dp if args.dp is not None else max(1, world // fixed)
    cfg = ParallelConfig(pp=args.pp, dp=dp, cp=args.cp, tp=args.tp, dp_shard=args.dp_shard,
                         hsdp_level=args.hsdp_level, sequence_parallel=args.sequence_parallel,
                         cp_algo=args.cp_algo, memory=args.memory, schedule=args.schedule,
                         micro_batches=args.micro_batches)
    try:
        model_cfg = LlamaConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                                n_kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden, dropout=args.dropout,
                                tie_embeddings=args.tie_embeddings)
        cfg.validate(world, model_cfg)
        micro = args.micro_batches if args.pp > 1 else 1
        if args.batch % (dp * micro):
            raise ValueError(f"--batch {args.batch} must be a multiple of dp {dp}"
                             + (f" x --micro-batches {micro}" if micro > 1 else ""))
        if args.seq % args.cp:
            raise ValueError(f"--seq {args.seq} must be a multiple of --cp {args.cp}")
    except ValueError as e:
        parser.error(str(e))
    if "RANK" not in os.environ:
        parser.error("run under torchrun (e.g. torchrun --nproc-per-node 4 examples/llama/train.py ...)")
    if args.device != "cpu":
        getattr(torch, args.device).set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend)
    try:
        run = setup(cfg, model_cfg, lr=args.lr, device_type=args.device)
        start = 0
        if args.checkpoint_dir and os.path.exists(os.path.join(args.checkpoint_dir, ".metadata")):
            load(run, args.checkpoint_dir)
            start = int(open(os.path.join(args.checkpoint_dir, "step")).read())
            if dist.get_rank() == 0:
                print(f"loaded {args.checkpoint_dir} at step {start}", flush=True)
        for step in range(start, start + args.steps):
            loss = train_step(run, global_batch(step, model_cfg, args.batch, args.seq))
            if dist.get_rank() == 0:
                print(f"step {step + 1} loss {loss:.6f}", flush=True)
        if args.checkpoint_dir:
            save(run, args.checkpoint_dir)
            if dist.get_rank() == 0:
                with open(os.path.join(args.checkpoint_dir, "step"), "w") as f:
                    f.write(str(start + args.steps))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
