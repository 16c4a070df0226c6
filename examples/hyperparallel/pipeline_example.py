"""HyperParallel's pipeline usage on CPU: one ``PipelineStage`` per rank, ``Schedule1F1B(stage,
micro_batch_num=8).run(x)``.

    torchrun --nproc_per_node 2 examples/hyperparallel/pipeline_example.py [--steps 3] [--schedule 1f1b]

Rank 0 holds the first layers and feeds the batch; the last rank holds the head and the loss and prints it.
"""

import argparse

import torch
import torch.distributed as dist
from torch import nn

from hyper_adaptor.parallel import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    destroy_process_group,
    init_process_group,
)

DIM, LAYERS_PER_STAGE, BATCH = 32, 2, 16


def stage_module(index: int, num: int) -> nn.Module:
    torch.manual_seed(index)                   # each stage's own weights, whatever rank builds it
    layers = [m for _ in range(LAYERS_PER_STAGE) for m in (nn.Linear(DIM, DIM), nn.Tanh())]
    if index == num - 1:
        layers.append(nn.Linear(DIM, 1))
    return nn.Sequential(*layers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    args = parser.parse_args()
    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(stage_module(rank, world), rank, world)
    target = torch.Generator().manual_seed(7)
    inputs = torch.Generator().manual_seed(8)
    x = torch.randn(BATCH, DIM, generator=inputs)          # one batch, fitted over the steps
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(BATCH, 1, generator=target)
    kind = Schedule1F1B if args.schedule == "1f1b" else ScheduleGPipe
    # loss_fn(output, target): each micro-batch's loss is backpropagated; scaled so the gradient is the batch mean's
    schedule = kind(stage, micro_batch_num=8, loss_fn=lambda out, y: nn.functional.mse_loss(out, y) / 8)
    opt = torch.optim.SGD(stage.module.parameters(), lr=0.01)
    last = rank == world - 1
    for step in range(args.steps):
        losses = []
        schedule.run(*((x,) if rank == 0 else ()), target=y if last else None, losses=losses)
        opt.step()
        opt.zero_grad()
        if last:
            print(f"step {step} loss {sum(float(v) for v in losses):.6f}", flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
