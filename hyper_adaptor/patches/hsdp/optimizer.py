"""Megatron's bf16 optimizer over HSDP shards.

``Float16OptimizerWithFloat16Params`` steps fp32 main copies of the bf16 shards and then writes
them back into the shards (``_copy_main_params_to_model_params``). HSDP learns that a shard
changed from the torch optimizer's step hook, which here sees only the main copies, so the write
back is where the shards are marked: without it levels 1 and 2 would keep computing with the
gathered parameters of the step before (seen: bf16 losses off Megatron DDP's from iteration 3).
"""

from __future__ import annotations

import functools


def mark_shards_stale(original):
    @functools.wraps(original)
    def _copy_main_params_to_model_params(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        for group in self.float16_groups:
            for param in group:
                managed = getattr(param, "_hsdp_param", None)
                if managed is not None:
                    managed.stale = True
        return result

    return _copy_main_params_to_model_params
