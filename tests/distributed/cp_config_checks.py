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

Attention dropout (``dropout_checks``): each algorithm's engine at CP 2 with dropout ``DROPOUT`` and a fixed
base seed against dense float64 attention over the whole sequence with the mask ``Dropout.keep`` gives for
the whole sequence (outputs and q/k/v gradients, ``TOL``: the gradients match only if the backward
regenerates the forward's masks); and megatron blocks with ``attention_dropout`` 0.1: in eval mode equal to
the CP 1 block without dropout, in training mode dropping (a fresh mask per forward, the same one after
the same ``model_parallel_cuda_manual_seed``: the base seed comes from megatron's RNG tracker's stream);
and the ``ContextParallel`` style on a module with ``attention_dropout``: in training the same reference
(base seed from ``torch.manual_seed``), in eval none.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tests.distributed.cp_checks import compare

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 32, 4
TOL = 1e-5
DROPOUT = 0.1
# dropout parity: (algorithm, the CPGroups layout), each causal or not, load-balanced or contiguous
DROPOUT_ALGOS = {"ring": None, "allgather": None, "ulysses": None,
                 "hybrid 2x1": "ulysses x ring 2x1", "hybrid 1x2": "ulysses x ring 1x2"}
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


def _config(cp: int = 1, cp_comm_type=None, attention_dropout=0.0):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.0,
                             attention_dropout=attention_dropout, use_cpu_initialization=True,
                             context_parallel_size=cp,
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
    result["dropout"] = dropout_checks(collections, reference, x, dout, want_out, mine)
    return result


def _dropped_reference(q, k, v, dout, keep, causal, p=DROPOUT):
    """(out, dq, dk, dv): dense float64 attention over the whole sequence with the keep-mask ``keep``."""
    xs = [t.double().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.permute(1, 2, 0, 3) for t in xs)
    groups = q.shape[2] // k.shape[2]
    kh, vh = kh.repeat_interleave(groups, 1), vh.repeat_interleave(groups, 1)
    scores = qh @ kh.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    out = ((torch.softmax(scores, -1) * keep / (1 - p)) @ vh).permute(2, 0, 1, 3)
    out.backward(dout.double())
    return [out.detach()] + [t.grad for t in xs]


def _engine_parity(collections, rank) -> dict:
    from hyper_adaptor.parallel.context import CPGroups, Dropout, context_parallel_attention

    generator = torch.Generator().manual_seed(2)
    np_, ng, hn = 4, 2, 8
    q = torch.randn(SEQ, BATCH, np_, hn, generator=generator)
    k, v = (torch.randn(SEQ, BATCH, ng, hn, generator=generator) for _ in range(2))
    dout = torch.randn(SEQ, BATCH, np_, hn, generator=generator)
    everywhere = torch.arange(SEQ)
    keep = Dropout(DROPOUT, torch.tensor(1234)).keep(everywhere, everywhere, BATCH, np_)
    failures = {}
    for causal in (True, False):
        want = _dropped_reference(q, k, v, dout, keep, causal)
        for load_balanced in (True, False):
            mine = _positions(rank, 2) if load_balanced else torch.arange(rank * SEQ // 2, (rank + 1) * SEQ // 2)
            for name, layout in DROPOUT_ALGOS.items():
                collection = collections[layout] if layout else None
                if collection is None:
                    groups = CPGroups(cp=collections["own"].cp, ulysses=None, ring=None,
                                      ulysses_degree=2 if name == "ulysses" else 1)
                else:
                    ulysses, ring = collection.hcp
                    groups = CPGroups(cp=collection.cp, ulysses=ulysses, ring=ring, ulysses_degree=ulysses.size())
                mine_qkv = [t[mine].clone().requires_grad_() for t in (q, k, v)]
                out = context_parallel_attention(*mine_qkv, groups=groups, algo=name.split()[0], causal=causal,
                                                 load_balanced=load_balanced, dropout_p=DROPOUT, dropout_seed=1234)
                out.backward(dout[mine])
                key = f"{name} causal={causal} load_balanced={load_balanced}"
                failures[key] = compare("out", out, want[0][mine], TOL) + sum(
                    (compare(f"d{t}", x.grad, g[mine], TOL) for t, x, g in zip("qkv", mine_qkv, want[1:])), [])
    # the comparison can fail: another seed is another mask (the last reference: not causal, contiguous)
    groups = CPGroups(cp=collections["own"].cp, ulysses=None, ring=None, ulysses_degree=1)
    other = context_parallel_attention(q[mine], k[mine], v[mine], groups=groups, algo="ring", causal=False,
                                       load_balanced=False, dropout_p=DROPOUT, dropout_seed=99)
    failures["another seed differs"] = [] if compare("out", other, want[0][mine], TOL) else ["same output"]
    # a fresh seed per call when none is given
    first, second = (context_parallel_attention(q[mine], k[mine], v[mine], groups=groups, algo="ring",
                                                causal=True, load_balanced=False, dropout_p=DROPOUT)
                     for _ in range(2))
    failures["fresh seed per call"] = [] if compare("out", first, second, TOL) else ["same output twice"]
    return failures


class _Core(torch.nn.Module):
    """A core-attention module as the style sees it: only its attention_dropout is read."""

    def __init__(self):
        super().__init__()
        self.attention_dropout = torch.nn.Dropout(DROPOUT)


def _style_checks(rank) -> dict:
    """The ParallelStyle takes the module's attention_dropout in training, none in eval; its base seed comes
    from the default generator (torch.manual_seed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from hyper_adaptor.parallel.context import ContextParallel, Dropout, draw_seed

    core = parallelize_module(_Core(), init_device_mesh("cpu", (2,)),
                              ContextParallel(seq_dim=0, head_dim=2, load_balance=True, algo="ring"))
    generator = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(SEQ, BATCH, 2, 8, generator=generator) for _ in range(4))
    mine, everywhere = _positions(rank, 2), torch.arange(SEQ)
    torch.manual_seed(7)
    keep = Dropout(DROPOUT, draw_seed("cpu")).keep(everywhere, everywhere, BATCH, 2)
    result = {}
    for mode, mask, p in (("train", keep, DROPOUT), ("eval", torch.ones_like(keep), 0.0)):
        core.train(mode == "train")
        torch.manual_seed(7)
        out = core(q[mine], k[mine], v[mine])
        want = _dropped_reference(q, k, v, dout, mask, True, p)
        result[f"style {mode}"] = compare("out", out, want[0][mine], TOL)
    result["style dropout_p=1 refused"] = [] if "dropout_p (context-parallel attention dropout) must be a number in " \
        "[0, 1), got 1.0" in _error(lambda: ContextParallel(dropout_p=1.0)) else ["no clear error"]
    return result


def dropout_checks(collections, reference, x, dout, want_out, mine) -> dict:
    """See the module doc; every entry a list of failures (empty: passed)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    rank = dist.get_rank()
    result = _engine_parity(collections, rank)
    result.update(_style_checks(rank))
    for comm_type in ("p2p", "a2a"):
        block = _block(_config(2, comm_type, attention_dropout=0.1))
        block.load_state_dict(reference.state_dict())
        block.eval()
        with torch.no_grad():
            evaluated = block(hidden_states=x[mine], attention_mask=None)
        result[f"{comm_type} eval = CP 1 without dropout"] = compare("eval out", evaluated, want_out[mine], TOL)
        block.train()
        runs = []
        for seed in (5, 6, 5):
            # megatron draws attention dropout from its model-parallel RNG stream (the tracker's fork)
            model_parallel_cuda_manual_seed(seed)
            runs.append(_run(block, x[mine], dout[mine]))
        failures = []
        if not compare("train out", runs[0][0], want_out[mine], TOL):
            failures.append("training output equals the output without dropout")
        if not compare("train out", runs[0][0], runs[1][0], TOL):
            failures.append("another seed, the same output")
        failures += compare("same seed out", runs[2][0], runs[0][0], 0) + compare("same seed dx", runs[2][1],
                                                                                    runs[0][1], 0)
        result[f"{comm_type} training drops, seeded by the RNG tracker"] = failures
    return result
