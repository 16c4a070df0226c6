"""The pipeline engine's FWD_BWD pairs through CommComputeOverlap (part of ``expert_overlap_checks``):
a 2-stage 1F1B with ``overlap_b_f``, each stage a Linear + MoE block; on 4 ranks the MoE is expert
parallel over the two pipeline replicas. Bitwise the same pairs run one after the other, every pair
through ``run`` and every hook paired."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyper_adaptor.parallel.expert import CommComputeOverlap, ExpertParallel, MoE
from tests.distributed.expert_overlap_checks import EXPERTS, FFN, HIDDEN, TOPK, compare


# ---------------------------------------------------------- the pipeline engine's FWD_BWD pairs
class _CountingOverlap:
    """CommComputeOverlap that counts the pairs it ran and the hooks that met."""

    def __init__(self):
        self.inner, self.calls, self.pairs = CommComputeOverlap(timeout=60), 0, 0

    def run(self, fwd_fn, bwd_fn):
        self.calls += 1
        try:
            return self.inner.run(fwd_fn, bwd_fn)
        finally:
            self.pairs += self.inner.coordinator.pairs


class StageBlock(torch.nn.Module):
    def __init__(self, moe):
        super().__init__()
        self.moe = moe
        self.lin = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        return h + self.moe(h)


def pipeline_case(world_size, rank, *, overlapped, micro=6):
    """A 2-stage 1F1B with overlap_b_f, each stage a Linear + MoE block; on 4 ranks the MoE is expert
    parallel over the two pipeline replicas (mesh ("ep", "pp") = (2, 2)). ``overlapped``: FWD_BWD pairs
    through CommComputeOverlap, the MoE's dispatcher wrapped."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.pipeline import PipelineStage, Schedule1F1B

    if world_size == 4:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep", "pp"))
        pp_group, ep_mesh, replica = mesh["pp"].get_group(), mesh["ep"], rank // 2
    else:
        pp_group, ep_mesh, replica = dist.group.WORLD, None, 0
    stage_index = dist.get_rank(pp_group)
    torch.manual_seed(40 + stage_index)
    moe = MoE(HIDDEN, FFN, EXPERTS, TOPK, shared_ffn=FFN)
    if ep_mesh is not None:
        parallelize_module(moe, ep_mesh, ExpertParallel())
    block = StageBlock(moe)
    runner = _CountingOverlap() if overlapped else None
    if overlapped:
        moe.dispatcher.dispatch = runner.inner.wrap_dispatch(moe.dispatcher.dispatch)
        moe.dispatcher.combine = runner.inner.wrap_combine(moe.dispatcher.combine, is_last_layer=True)
    schedule = Schedule1F1B(PipelineStage(block, stage_index, 2, group=pp_group), micro,
                            torch.nn.functional.mse_loss, overlap_b_f=True, comm_compute_overlap=runner)
    g = torch.Generator().manual_seed(900 + replica)
    x, target = torch.randn(micro * 3, HIDDEN, generator=g), torch.randn(micro * 3, HIDDEN, generator=g)
    losses = []
    schedule.step(*((x,) if stage_index == 0 else ()), target=target if stage_index == 1 else None, losses=losses)
    if runner is not None:
        runner.inner.close()
    pairs_in_list = sum(a.pair is not None for a in schedule.actions)
    result = {n: p.grad.clone() for n, p in block.named_parameters()}
    if losses:
        result["losses"] = torch.stack(losses)
    return result, (runner.calls, runner.pairs) if runner else None, pairs_in_list


def pipeline_checks(world_size, rank, checks):
    want, _, pairs_in_list = pipeline_case(world_size, rank, overlapped=False)
    got, (calls, hooks), _ = pipeline_case(world_size, rank, overlapped=True)
    failures, _ = compare(got, want, None)
    if pairs_in_list == 0 or calls != pairs_in_list:
        failures.append(f"{calls} pairs ran through CommComputeOverlap; the list has {pairs_in_list}")
    if hooks != 3 * calls:
        failures.append(f"{hooks} hooks paired over {calls} pairs, want {3 * calls}")
    checks["pipeline/overlap_b_f-pairs"] = failures
