"""Optimizers and LR schedules as plain torch: Muon, AdamW, ChainedOptimizer, the parameter split and the
warmup / cosine / WSD schedules. No megatron here; the megatron adaptor builds on this."""

# AdamW is torch's own: it is well kept and has fused / foreach kernels on every device torch supports;
# there is nothing of ours to add to it.
from torch.optim import AdamW

from .chained import ChainedOptimizer
from .factory import get_hyper_optimizer, split_params
from .muon import Muon, adjusted_lr, newton_schulz, orthogonalise_blocks
from .owners import assign_owners, load_imbalance, ns_flops, round_robin_owners
from .schedule import ChainedLR, get_hyper_lr_scheduler, lr_multiplier
from .sharded import ShardedMuon

__all__ = ["AdamW", "ChainedLR", "ChainedOptimizer", "Muon", "adjusted_lr", "assign_owners", "get_hyper_lr_scheduler",
           "get_hyper_optimizer", "load_imbalance", "lr_multiplier", "newton_schulz", "ns_flops",
           "orthogonalise_blocks", "round_robin_owners", "ShardedMuon", "split_params"]
