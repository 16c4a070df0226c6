"""The patches ``--use-hsdp`` registers."""

from __future__ import annotations

from hyper_adaptor.patch_manager import Patch

FEATURE = "hsdp"


def patches(args) -> list[Patch]:
    from hyper_adaptor.features.hsdp import hsdp_kwargs
    from hyper_adaptor.patches.hsdp.data_parallel import make_wrapper_class
    from hyper_adaptor.patches.hsdp.grad_norm import hsdp_grad_norm

    wrapper = make_wrapper_class(hsdp_kwargs(args))
    return [
        # only the name _ddp_wrap reads; megatron.core's DistributedDataParallel stays as it is
        Patch("megatron.training.models.dist_utils.DistributedDataParallel", wrapper, "replace", FEATURE,
              rebind_in=()),
        Patch("megatron.core.optimizer.clip_grads.get_grad_norm_fp32", hsdp_grad_norm, "wrap", FEATURE),
    ]
