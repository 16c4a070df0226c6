"""ZBV's V placement of megatron's two model chunks per rank.

megatron places chunk ``c`` of pipeline rank ``r`` at model stage ``c * p + r`` (a loop). ZBV runs chunk 1
back up the ranks: stage ``2p - 1 - r``. So rank 0 holds the first stage (embedding) *and* the last (final
norm, output layer, loss), and the bottom of the V (stages p-1 and p) sits on rank p-1. Megatron's model
build asks four questions whose answers change; each seam translates the V coordinates into the loop
coordinates of the same model stage and asks megatron's own code:

- ``get_transformer_layer_offset(config, vp_stage, pp_rank)``: the layer numbers of a chunk are those of its
  model stage, so layers keep megatron's numbering in checkpoints (a ZBV checkpoint loads under 1F1B);
- ``parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage)``: chunk 1 of rank 0 (library users
  and megatron's data loaders decide by it which chunk reads the labels);
- megatron.training's two model builders (``get_model`` with a model provider, and the config-container
  path's ``build_virtual_pipeline_stages``): the provider is told ``post_process`` for chunk 1 of rank 0 and
  not for chunk 1 of rank p-1 (the schedule refuses chunks built otherwise);
- ``Float16Module.forward``: the fp32 up-cast of the last stage's output happens on rank 0's chunk 1, and the
  bottom of the V hands on half-precision activations like every other stage.
"Last pipeline rank" questions (``ignore_virtual=True``) keep their answer: the schedule hands the losses to
the last rank, where megatron.training reduces and logs them.

One batch seam follows from that: Megatron-LM's ``pretrain_gpt.py`` asks which fields a chunk needs by
``is_first_or_last_pipeline_stage(vp_stage)`` (right under the V), then hands
``megatron.core.utils.get_batch_on_this_tp_rank`` the rank's ``is_pipeline_first_stage()`` /
``is_pipeline_last_stage()``, and the helper keeps tokens only on a first rank, labels and loss mask
only on a last one. Rank 0 of the V holds both ends of the model, so it is given what a one-stage
pipeline gets (every field); the other ranks' chunks are middle stages, which the script hands no
batch. The script binds the helper by name at import, so the wrap is rebound in ``__main__`` too.
"""

from __future__ import annotations

import functools
import inspect

from hyper_adaptor.patch_manager import Patch

FEATURE = "pipeline"


def _pp():
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()


def v_stage(pp_rank: int, pp_size: int, vp_stage: int) -> int:
    return pp_rank if vp_stage == 0 else 2 * pp_size - 1 - pp_rank


def _wrap_offset(original):
    def get_transformer_layer_offset(config, vp_stage=None, pp_rank=None):
        if vp_stage is None or config.virtual_pipeline_model_parallel_size != 2:
            return original(config, vp_stage=vp_stage, pp_rank=pp_rank)
        rank, size = _pp()
        rank = rank if pp_rank is None else pp_rank
        stage = v_stage(rank, size, vp_stage)
        return original(config, vp_stage=stage // size, pp_rank=stage % size)

    return get_transformer_layer_offset


def _wrap_is_last(original):
    def is_pipeline_last_stage(ignore_virtual=True, vp_stage=None):
        from megatron.core import parallel_state

        if ignore_virtual or parallel_state.get_virtual_pipeline_model_parallel_world_size() != 2:
            return original(ignore_virtual=ignore_virtual, vp_stage=vp_stage)
        if vp_stage is None:
            raise ValueError("vp_stage must be passed with model chunks (--pipeline-schedule zbv)")
        rank, _size = _pp()
        return rank == 0 and vp_stage == 1

    return is_pipeline_last_stage


def _v_provider(build):
    """``build`` (a model provider) told ``post_process`` for the V's last stage."""

    @functools.wraps(build)
    def provider(*args, **kwargs):
        vp_stage = kwargs.get("vp_stage")
        if vp_stage is not None and "post_process" in kwargs:
            rank, _size = _pp()
            kwargs["post_process"] = rank == 0 and vp_stage == 1
        return build(*args, **kwargs)

    return provider


def _wrap_get_model(original):
    def get_model(model_provider_func, *args, **kwargs):
        return original(_v_provider(model_provider_func), *args, **kwargs)

    return get_model


def _wrap_build_stages(original):
    def build_virtual_pipeline_stages(build_model_func, *args, **kwargs):
        return original(_v_provider(build_model_func), *args, **kwargs)

    return build_virtual_pipeline_stages


def _wrap_float16_forward(original):
    def forward(self, *inputs, fp32_output=True, **kwargs):
        vp_stage = getattr(self, "vp_stage", None)
        if vp_stage is None or getattr(self, "vp_size", None) != 2:
            return original(self, *inputs, fp32_output=fp32_output, **kwargs)
        from megatron.core.transformer.module import float16_to_fp32

        rank, _size = _pp()
        outputs = original(self, *inputs, fp32_output=False, **kwargs)
        if fp32_output and rank == 0 and vp_stage == 1:
            outputs = float16_to_fp32(outputs)
        return outputs

    return forward


def _holds_both_ends() -> bool:
    from megatron.core import parallel_state

    if parallel_state.get_virtual_pipeline_model_parallel_world_size() != 2:
        return False
    rank, _size = _pp()
    return rank == 0


def _wrap_tp_batch(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_batch_on_this_tp_rank(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if bound.arguments.get("pipeline_model_parallel_size", 1) > 1 and _holds_both_ends():
            # every TP rank of the group is pipeline rank 0, so all of them take the same branch
            bound.arguments["pipeline_model_parallel_size"] = 1
        return original(*bound.args, **bound.kwargs)

    return get_batch_on_this_tp_rank


def patches() -> list[Patch]:
    return [
        Patch("megatron.core.transformer.transformer_layer.get_transformer_layer_offset", _wrap_offset, "wrap",
              FEATURE),
        Patch("megatron.core.parallel_state.is_pipeline_last_stage", _wrap_is_last, "wrap", FEATURE),
        Patch("megatron.training.training.get_model", _wrap_get_model, "wrap", FEATURE),
        Patch("megatron.training.models.dist_utils.build_virtual_pipeline_stages", _wrap_build_stages, "wrap",
              FEATURE),
        Patch("megatron.core.transformer.module.Float16Module.forward", _wrap_float16_forward, "wrap", FEATURE),
        Patch("megatron.core.utils.get_batch_on_this_tp_rank", _wrap_tp_batch, "wrap", FEATURE,
              rebind_in=("megatron", "__main__")),
    ]


__all__ = ["patches", "v_stage"]
