"""megatron's ``--optimizer muon`` served by :class:`hyper_adaptor.optim.sharded.ShardedMuon`.

megatron-core 0.19.2 builds Muon through its emerging-optimizer factory: parameter groups (matrices ->
Muon, the rest -> Adam), fp32 / bf16 wrappers, the layer-wise distributed optimizer and checkpoint
layout are megatron's; only the torch optimizer it constructs for the Muon groups comes from the
``emerging_optimizers`` package, which needs Python >= 3.12 and triton. The seam is the one call that
constructs it (``_create_emerging_optimizer``): for ``muon`` it builds ``MegatronMuon`` here, with the
constructor arguments megatron derives from its config for its own class (same names), so every
``--muon-*`` flag keeps megatron's meaning. The factory's availability check is told the optimizer
exists (``HAVE_EMERGING_OPTIMIZERS``); the other emerging optimizers are refused by name at validation.
"""

from __future__ import annotations

import functools

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


def patches(serve: bool) -> list[Patch]:
    """``serve``: hyper_adaptor's Muon in place of emerging_optimizers' (see the module docstring); the
    layer-wise optimizer's fp32 wrapper either way."""
    result = [Patch(f"{OPTIMIZER}.layer_wise_optimizer.LayerWiseDistributedOptimizer.__init__", fp32_layer_wise,
                    "wrap", FEATURE)]
    if serve:
        result += [Patch(f"{OPTIMIZER}._create_emerging_optimizer", serve_muon, "wrap", FEATURE),
                   Patch(f"{OPTIMIZER}.HAVE_EMERGING_OPTIMIZERS", True, "replace", FEATURE, rebind_in=())]
    return result
