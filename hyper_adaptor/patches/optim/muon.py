"""megatron's ``--optimizer muon`` served by :class:`hyper_adaptor.optim.sharded.ShardedMuon`.

megatron-core 0.19.2 builds Muon through its emerging-optimizer factory: parameter groups (matrices ->
Muon, the rest -> Adam), fp32 / bf16 wrappers, the layer-wise distributed optimizer and checkpoint
layout are megatron's; only the torch optimizer it constructs for the Muon groups comes from the
``emerging_optimizers`` package, which needs Python >= 3.12 and triton. The seam is the one call that
constructs it (``_create_emerging_optimizer``): for ``muon`` it builds ``MegatronMuon`` here, with the
constructor arguments megatron derives from its config for its own class (same names), so every
``--muon-*`` flag keeps megatron's meaning. The factory's availability check is told the optimizer
exists (``HAVE_EMERGING_OPTIMIZERS``); the other emerging optimizers are refused by name at validation.
The TP mode is megatron's ``--muon-tp-mode``, whose default is ``blockwise`` in 0.19.x and ``duplicated``
on Megatron-LM main (patches/megatron_releases.py): with TP > 1 and the flag not given, the two releases
update differently.
"""

from __future__ import annotations

import functools

from hyper_adaptor.notice import notice
from hyper_adaptor.optim.owners import assign_owners, load_imbalance, ns_flops
from hyper_adaptor.optim.sharded import ShardedMuon
from hyper_adaptor.patch_manager import Patch

FEATURE = "muon"
OPTIMIZER = "megatron.core.optimizer"


class MegatronMuon(ShardedMuon):
    """``ShardedMuon`` with the constructor of megatron's ``TensorParallelMuon`` (argument for argument,
    so megatron's config-to-arguments mapping fills it) and megatron's parameter tags: ``is_qkv`` /
    ``qkv_split_shapes`` for the QKV split, ``partition_dim`` / ``expert_tp`` for the tensor-parallel
    group (``pg_collection.tp`` or ``.expt_tp``)."""

    def __init__(self, params, lr: float = 3e-4, momentum: float = 0.95, nesterov: bool = True,
                 weight_decay: float = 0.01, use_decoupled_weight_decay: bool = True, split_qkv: bool = False,
                 is_qkv_fn=None, qkv_split_shapes=None, fp32_matmul_prec: str = "medium",
                 coefficient_type: str = "quintic", num_ns_steps: int = 5, scale_mode: str = "spectral",
                 extra_scale_factor: float = 1.0, pg_collection=None, tp_mode: str = "duplicated"):
        self.pg_collection = pg_collection
        default_split = list(qkv_split_shapes) if qkv_split_shapes else None

        def qkv_split(p):
            if not (split_qkv and is_qkv_fn is not None and is_qkv_fn(p)):
                return None
            return list(getattr(p, "qkv_split_shapes", None) or default_split or []) or None

        def tp_of(p):
            if pg_collection is None:
                return None
            dim = getattr(p, "partition_dim", None)
            if dim is None or dim < 0:  # megatron's "not split" (-1) or untagged
                return None
            group = getattr(pg_collection, "expt_tp", None) if getattr(p, "expert_tp", False) else None
            return (group if group is not None else pg_collection.tp), dim

        super().__init__(params, lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                         decoupled_weight_decay=use_decoupled_weight_decay, coefficient_type=coefficient_type,
                         num_ns_steps=num_ns_steps, scale_mode=scale_mode, extra_scale_factor=extra_scale_factor,
                         fp32_matmul_prec=fp32_matmul_prec, tp_mode=tp_mode, tp_of=tp_of, qkv_split=qkv_split)


def serve_muon(original):
    """Wrap of ``_create_emerging_optimizer``: ``muon`` is built here, anything else by megatron."""

    @functools.wraps(original)
    def _create_emerging_optimizer(config, param_groups, eopt_name, model_chunks, pg_collection):
        if eopt_name != "muon":
            return original(config, param_groups, eopt_name, model_chunks, pg_collection)
        from megatron.core.optimizer import emerging_optimizers as registry

        kwargs = registry._muon_config_to_kwargs(config, model_chunks, pg_collection)
        return MegatronMuon(param_groups, **kwargs), registry._eopt_init_state_fn

    return _create_emerging_optimizer


def fp32_layer_wise(original):
    """Wrap of ``LayerWiseDistributedOptimizer.__init__`` (``--optimizer muon --use-distributed-optimizer``):
    megatron 0.19.2 wraps the torch optimizers it is given in its bf16 optimizer under ``--bf16`` and in
    nothing otherwise, so an fp32 run fails at its first step (``'...Muon' object has no attribute
    'get_loss_scale'``, megatron's own Muon alike). In fp32 the wrap gives each the ``FP32Optimizer``
    megatron uses for fp32 everywhere else."""

    @functools.wraps(original)
    def __init__(self, optimizers, config, pg_collection=None, init_state_fn_list=None, model_chunks=None):
        original(self, optimizers, config, pg_collection, init_state_fn_list, model_chunks)
        if config.bf16 or config.fp16:
            return
        import torch

        from megatron.core.optimizer.optimizer import FP32Optimizer

        fns = list(init_state_fn_list or [None] * len(self.chained_optimizers))
        self.chained_optimizers = [FP32Optimizer(opt, config, fn) if isinstance(opt, torch.optim.Optimizer) else opt
                                   for opt, fn in zip(self.chained_optimizers, fns, strict=True)]
        self.config = config

    return __init__


def flop_balanced_owners(original):
    """Wrap of ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`` (``--optimizer muon
    --use-distributed-optimizer``): megatron lays each bucket's matrices out on the data-parallel ranks by
    element count (greedy, largest first), and the rank a matrix lands on is the one that runs its
    Newton-Schulz. Element count is what memory costs; Newton-Schulz costs the cube of the short side. The
    wrap keeps megatron's buckets (which matrices share one, in backprop order) and re-deals each
    bucket's matrices over the ranks with ``owners.assign_owners`` on Newton-Schulz flops, then lays
    every rank's shard out as megatron does (64-element aligned starts, shards padded to the largest, to
    megatron's shard divisor). Buckets holding a shared embedding keep megatron's layout.

    The trade: every rank keeps the whole buffer (parameters and gradients), dp shards wide, and a shard
    is padded to the largest, so where element counts and flops part (matrices with different short
    sides) the buffer grows. A notice says by how much, next to the balance gained, per buffer."""

    @functools.wraps(original)
    def _compute_per_buffer_param_layout(params, bucket_size, data_parallel_world_size, ddp_config,
                                         param_indices=None):
        layout = original(params, bucket_size, data_parallel_world_size, ddp_config, param_indices)
        from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

        divisor = LayerWiseDistributedOptimizer._shard_divisor(data_parallel_world_size, ddp_config)
        balanced = rebalance_layout(layout, data_parallel_world_size, divisor)
        ranks = data_parallel_world_size
        notice(f"--muon-layer-wise-balance flops: Newton-Schulz work max/mean {_imbalance(balanced, ranks):.3f} "
               f"(megatron's element-count deal: {_imbalance(layout, ranks):.3f}) over {ranks} ranks; buffer "
               f"{_size(balanced):,} elements (megatron's: {_size(layout):,}); --muon-layer-wise-balance elements "
               "keeps megatron's")
        return balanced

    return _compute_per_buffer_param_layout


def flop_balanced_ping_pong(original):
    """Replacement of ``LayerWiseDistributedOptimizer._shard_params_ping_pong``, the owner deal megatron
    uses when DDP was built without a layer-wise layout (megatron.training's model builders in 0.19.2):
    parameters sorted by element count and dealt to the data-parallel ranks 0, 1, .., n-1, n-1, .., 0.
    Here each parameter goes to the least-loaded rank, largest Newton-Schulz cost first
    (``owners.assign_owners``; parameters outside Muon cost their element count). It fills what megatron's
    does: each rank's list of owned parameters (``dp_cp_params_list``, and ``expt_dp_params_list`` over
    the expert-data-parallel group, None when that group has one rank or no parameters) and every
    optimizer group cut to this rank's own parameters; every rank computes the same deal."""

    @functools.wraps(original)
    def _shard_params_ping_pong(self, optimizers, dp_cp_size, expt_dp_size):
        from megatron.core.utils import get_pg_rank

        groups = [group for opt in optimizers for group in opt.param_groups]
        lists, mine = {}, [[] for _ in groups]
        for expert, size, group_pg in ((False, dp_cp_size, self.dp_cp), (True, expt_dp_size, self.expt_dp)):
            members = [(p, index) for index, group in enumerate(groups)
                       if bool(group.get("is_expert_parallel", False)) == expert for p in group["params"]]
            owners = assign_owners([_cost(p) for p, _ in members], size)
            per_rank = [[] for _ in range(size)]
            rank = get_pg_rank(group_pg) if members else 0
            for (p, index), owner in zip(members, owners, strict=True):
                per_rank[owner].append(p)
                if owner == rank:
                    mine[index].append(p)
            lists[expert] = per_rank
        for group, params in zip(groups, mine, strict=True):
            group["params"] = params
        self.dp_cp_params_list = lists[False]
        expert_lists = lists[True]
        self.expt_dp_params_list = None if expt_dp_size == 1 or not expert_lists[0] else expert_lists
        dense = [(p, rank) for rank, params in enumerate(lists[False]) for p in params]
        matrix_costs = [_cost(p) if _is_matrix(p) else 0.0 for p, _ in dense]
        if sum(matrix_costs):
            imbalance = load_imbalance(matrix_costs, [rank for _, rank in dense], dp_cp_size)
            notice(f"--muon-layer-wise-balance flops: Newton-Schulz work max/mean {imbalance:.3f} over {dp_cp_size} "
                   "data-parallel ranks (owners dealt by Newton-Schulz flops; --muon-layer-wise-balance elements "
                   "keeps megatron's deal)")

    return _shard_params_ping_pong


def _is_matrix(p) -> bool:
    return p.dim() == 2 and not getattr(p, "is_embedding_or_output_parameter", False)


def _cost(p) -> float:
    # a non-Muon parameter's Adam step is a few passes over its elements
    return ns_flops(p.shape) if _is_matrix(p) else 10.0 * p.numel()


def _size(layout) -> int:
    return layout.bucket_indices[-1][1] if layout.bucket_indices else 0


def _imbalance(layout, ranks: int) -> float:
    costs, owners = [], []
    for param, (start, _, bucket) in layout.param_index_map.items():
        first, last = layout.bucket_indices[bucket]
        costs.append(ns_flops(param.shape) if param.dim() == 2 else 0.0)
        owners.append((start - first) // ((last - first) // ranks))
    return load_imbalance(costs, owners, ranks)


def rebalance_layout(layout, ranks: int, divisor: int):
    """``layout`` (megatron's ``PerBufferParamLayout``) with each bucket's parameters re-dealt over
    ``ranks`` shards by Newton-Schulz flops (see ``flop_balanced_owners``)."""
    from megatron.core.optimizer.param_layout import PerBufferParamLayout, pad_param_start, pad_to_divisor

    members: dict[int, list] = {}
    for param, (start, _, bucket) in layout.param_index_map.items():
        members.setdefault(bucket, []).append((start, param))
    index_map, buckets, cursor = {}, [], 0
    for bucket, (first, last) in enumerate(layout.bucket_indices):
        entries = [param for _, param in sorted(members.get(bucket, []), key=lambda e: e[0])]
        if ranks == 1 or not entries or any(getattr(p, "shared_embedding", False) for p in entries):
            shift = cursor - first
            for p in entries:
                start, end, _ = layout.param_index_map[p]
                index_map[p] = (start + shift, end + shift, bucket)
            buckets.append((cursor, cursor + last - first))
            cursor += last - first
            continue
        costs = [ns_flops(p.shape) if p.dim() == 2 else float(p.numel()) for p in entries]
        shards = [[] for _ in range(ranks)]
        for p, owner in zip(entries, assign_owners(costs, ranks), strict=True):
            shards[owner].append(p)
        used = []
        for shard in shards:
            end = 0
            for p in shard:
                end = pad_param_start(end) + p.numel()
            used.append(end)
        width = pad_to_divisor(max(max(used), 1), divisor)
        for rank, shard in enumerate(shards):
            at = cursor + rank * width
            for p in shard:
                at = pad_param_start(at)
                index_map[p] = (at, at + p.numel(), bucket)
                at += p.numel()
        buckets.append((cursor, cursor + ranks * width))
        cursor += ranks * width
    return PerBufferParamLayout(param_index_map=index_map, bucket_indices=buckets,
                                per_bucket_numel_unpadded=list(layout.per_bucket_numel_unpadded),
                                param_indices=layout.param_indices, num_optimizer_shards=layout.num_optimizer_shards)


def patches(serve: bool, balance_flops: bool = True) -> list[Patch]:
    """``serve``: hyper_adaptor's Muon in place of emerging_optimizers' (see the module docstring); the
    layer-wise optimizer's fp32 wrapper either way, and its owners dealt by flops (``balance_flops``)."""
    layer_wise = f"{OPTIMIZER}.layer_wise_optimizer.LayerWiseDistributedOptimizer"
    result = [Patch(f"{layer_wise}.__init__", fp32_layer_wise, "wrap", FEATURE)]
    if balance_flops:
        result += [Patch(f"{layer_wise}._compute_per_buffer_param_layout", flop_balanced_owners, "wrap", FEATURE),
                   Patch(f"{layer_wise}._shard_params_ping_pong", flop_balanced_ping_pong, "wrap", FEATURE)]
    if serve:
        result += [Patch(f"{OPTIMIZER}._create_emerging_optimizer", serve_muon, "wrap", FEATURE),
                   Patch(f"{OPTIMIZER}.HAVE_EMERGING_OPTIMIZERS", True, "replace", FEATURE, rebind_in=())]
    return result
