"""Context parallel asked by a ``TransformerConfig`` alone (no megatron.training command line), run inside a
2-rank gloo world (hyper_adaptor/testing/world.py), as megatron-core's own unit tests build layers.

Every rank builds the CP 1 reference: a ``TransformerBlock`` of 2 layers on megatron's local spec (causal
self-attention, no dropout, fp32) fed the whole sequence, with a seeded output gradient. Each CP layout then
builds the same block (the reference's weights) from a ``TransformerConfig(context_parallel_size=N,
cp_comm_type=...)``, feeds this rank's load-balanced chunks (2N chunks, CP position r holds r and 2N-1-r, as
megatron's ``get_batch_on_this_cp_rank`` cuts a batch) and backpropagates the same chunks of the output
gradient; parameter gradients are summed over the CP group (megatron reduces them over data x context).

Compared, relative to max(1, the reference's largest magnitude): the output chunks, the input gradient
chunks and every parameter gradient, within ``TOL`` (fp32; the block-wise softmax only reorders sums).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.distributed.cp_checks import compare

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 32, 4
TOL = 1e-5
LEVEL_ENV = "HYPER_ADAPTOR_OPTIMIZATION_LEVEL"
# name: (cp_comm_type, the algorithm each of the 2 layers must run, the groups handed to the block)
LAYOUTS = {
    "p2p": ("p2p", ["ring", "ring"], None),
    "all_gather": ("all_gather", ["allgather", "allgather"], None),
    "allgather": ("allgather", ["allgather", "allgather"], None),
    "a2a": ("a2a", ["ulysses", "ulysses"], None),
    "per-layer": (["p2p", "a2a"], ["ring", "ulysses"], None),
    # TestMixedProcessGroups' way: a CP group handed to the block in its pg_collection, not parallel_state's
    "a2a-own-groups": ("a2a", ["ulysses", "ulysses"], "own"),
    # hierarchical groups in the pg_collection: Ulysses over both ranks (ring of one), then the ring over both
    "a2a+p2p": ("a2a+p2p", ["hybrid", "hybrid"], "ulysses x ring 2x1"),
    "a2a+p2p-ring": ("a2a+p2p", ["hybrid", "hybrid"], "ulysses x ring 1x2"),
    # no hierarchical groups anywhere (parallel_state's are not initialised here)
    "a2a+p2p-no-groups": ("a2a+p2p", ["hybrid", "hybrid"], None),
}


def _config(cp: int = 1, cp_comm_type=None):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                             attention_dropout=0.0, use_cpu_initialization=True, context_parallel_size=cp,
                             cp_comm_type=cp_comm_type)


def _block(config, pg_collection=None):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    return TransformerBlock(config, get_gpt_layer_local_spec(), pg_collection=pg_collection)


def _positions(r: int, n: int) -> torch.Tensor:
    c = SEQ // (2 * n)
    return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)])


def _run(block, x, dout):
    x = x.clone().requires_grad_()
    out = block(hidden_states=x, attention_mask=None)
    out.backward(dout)
    grads = {name: p.grad.clone() for name, p in block.named_parameters()}
    return out.detach(), x.grad, grads


def _error(build) -> str:
    try:
        build()
    except Exception as exc:  # the type is part of what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _collections(rank: int) -> dict:
    """The layouts' own groups (every rank creates every group, in one order)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    both = dist.new_group([0, 1])
    single = None
    for r in (0, 1):
        group = dist.new_group([r])
        if r == rank:
            single = group
    collections = {}
    for name, cp, hcp in (("own", both, None), ("ulysses x ring 2x1", both, [both, single]),
                          ("ulysses x ring 1x2", both, [single, both])):
        collection = ProcessGroupCollection.use_mpu_process_groups()
        collection.cp = cp
        if hcp is not None:
            collection.hcp = hcp
        collections[name] = collection
    return collections


def config_checks(rank: int, world_size: int) -> dict:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    assert world_size == 2
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=2)
    model_parallel_cuda_manual_seed(123)
    result = {"errors": {}, "parity": {}, "algos": {}, "intended_group": {}}

    # below level 2: megatron's assertion, saying how to get context parallel served (before anything applied it)
    for level in ("0", "1"):
        os.environ[LEVEL_ENV] = level
        result["errors"][f"level {level}"] = _error(lambda: _block(_config(2, "p2p")))
    os.environ[LEVEL_ENV] = "2"

    torch.manual_seed(0)
    reference = _block(_config())
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    dout = torch.randn(SEQ, BATCH, HIDDEN, generator=generator)
    want_out, want_dx, want_grads = _run(reference, x, dout)

    collections = _collections(rank)
    mine = _positions(parallel_state.get_context_parallel_rank(), 2)
    for name, (comm_type, _, groups) in LAYOUTS.items():
        collection = collections.get(groups)
        cp_group = collection.cp if collection is not None else parallel_state.get_context_parallel_group()
        try:
            block = _block(_config(2, comm_type), collection)
            block.load_state_dict(reference.state_dict())
            out, dx, grads = _run(block, x[mine], dout[mine])
        except Exception as exc:
            result["errors"][name] = f"{type(exc).__name__}: {exc}"
            continue
        failures = compare("out", out, want_out[mine], TOL) + compare("input grad", dx, want_dx[mine], TOL)
        for param, grad in grads.items():
            dist.all_reduce(grad, group=cp_group)
            failures += compare(f"grad {param}", grad, want_grads[param], TOL)
        result["parity"][name] = failures
        layers = [layer.self_attention.core_attention for layer in block.layers]
        result["algos"][name] = [getattr(core, "hyper_cp_algo", None) for core in layers]
        # the groups megatron would use: the pg_collection's, else parallel_state's
        hcp = getattr(collection, "hcp", None) or [None, None]
        result["intended_group"][name] = all(
            (core.hyper_cp_groups.cp, core.hyper_cp_groups.ulysses, core.hyper_cp_groups.ring) == (cp_group, *hcp)
            for core in layers)

    result["errors"]["unimplemented"] = _error(lambda: _block(_config(2, "a2a+a2a")))
    return result
