"""Level 2 — pipeline schedules as data in place of megatron's (``--pipeline-schedule``; docs/features/pipeline.md).

megatron-core 0.19.2 hard-codes 1F1B and interleaved 1F1B and has no zero-bubble schedule without
TransformerEngine. ``--pipeline-schedule {1f1b,interleaved,gpipe,zbh1,zbv}`` runs the named schedule on the
engine in ``hyper_adaptor/parallel/pipeline`` (validated action lists, one runtime); without the flag megatron's
own schedules run. ``interleaved`` and ``zbv`` use megatron's model chunks
(``--num-virtual-stages-per-pipeline-rank`` / ``--num-layers-per-virtual-pipeline-stage``); ``zbh1`` and ``zbv``
split each backward into input and weight gradients (:mod:`hyper_adaptor.patches.pipeline.wgrad`).
With megatron's ``--overlap-moe-expert-parallel-comm`` and ``--moe-dispatcher-engine hyper``, ``interleaved``
merges its steady (F, B) pairs and runs each pair's forward and backward on two threads that meet at the hooks
of the engine's dispatcher (``CommComputeOverlap``); only where nothing else communicates from both threads.
"""

from __future__ import annotations

from hyper_adaptor.features.base import Feature, FeatureConfigError, Flag, refuse_combined, switch
from hyper_adaptor.parallel.pipeline import CHUNKED_SCHEDULES, SCHEDULES, SPLIT_WEIGHT_SCHEDULES


def _pp(args) -> int:
    return int(getattr(args, "pipeline_model_parallel_size", 1) or 1)


def _chunks(args) -> int:
    from hyper_adaptor.patches.pipeline import model_chunks

    return model_chunks(args)


class Pipeline(Feature):
    name = "pipeline"
    level = 2
    summary = "pipeline schedules as data: GPipe, 1F1B, interleaved, ZB-H1, ZBV (split weight gradients)"
    flags = (
        Flag("--pipeline-schedule",
             "pipeline schedule run by hyper_adaptor's engine: 1f1b, interleaved (needs model chunks: "
             "--num-virtual-stages-per-pipeline-rank), gpipe, zbh1 (zero bubble, weight gradients fill the "
             "bubble), zbv (zero bubble in a V; two chunks per rank). Without it megatron's schedules run.",
             {"choices": SCHEDULES, "default": None}),
    )

    def adjust(self, args) -> list[str]:
        notices = []
        if _pp(args) == 2 and _chunks(args) > 1 and not getattr(args, "overlap_p2p_comm", False):
            # megatron asserts PP > 2 for model chunks without --overlap-p2p-comm (its batches would send
            # twice between the same two ranks); the engine's validated lists have no such limit, and its
            # runtime posts receives early under this switch
            notices.append(switch(args, "overlap_p2p_comm", True,
                                  f"--pipeline-schedule {args.pipeline_schedule} at --pipeline-model-parallel-size 2"))
        micro, pp = _micro_batches(args), _pp(args)
        if micro is not None and micro < pp:
            from hyper_adaptor.parallel.pipeline.timeline import theoretical_bubble

            name = args.pipeline_schedule
            bubble = theoretical_bubble(name, pp, micro, max(_chunks(args), 2 if name == "zbv" else 1))
            notices.append(f"--pipeline-schedule {name}: {micro} micro-batches per step with "
                           f"--pipeline-model-parallel-size {pp}: the schedule runs, but at least {bubble:.0%} of "
                           f"each step is pipeline bubble (raise --global-batch-size to {pp * args.micro_batch_size} "
                           f"x data-parallel size or more)")
        return notices

    def validate(self, args) -> None:
        name = args.pipeline_schedule
        flag = f"--pipeline-schedule {name}"
        pp, chunks = _pp(args), _chunks(args)
        if pp < 2:
            raise FeatureConfigError(f"{flag} needs --pipeline-model-parallel-size >= 2 (got {pp})")
        if name in CHUNKED_SCHEDULES and chunks < 2:
            raise FeatureConfigError(f"{flag} needs model chunks: --num-virtual-stages-per-pipeline-rank "
                                     f"{2 if name == 'zbv' else 'N'} (or --num-layers-per-virtual-pipeline-stage)")
        if name == "zbv" and chunks != 2:
            raise FeatureConfigError(f"{flag} places two chunks per rank in a V: "
                                     f"--num-virtual-stages-per-pipeline-rank "
                                     f"must be 2 (got {chunks})")
        if name not in CHUNKED_SCHEDULES and chunks > 1:
            raise FeatureConfigError(f"{flag} runs one model chunk per rank; drop "
                                     f"--num-virtual-stages-per-pipeline-rank "
                                     f"/ --num-layers-per-virtual-pipeline-stage or choose interleaved / zbv")
        if name == "zbv":
            if not getattr(args, "untie_embeddings_and_output_weights", True):
                raise FeatureConfigError(f"{flag} puts the embedding and the output layer on the same rank in two "
                                         "chunks; tied weights across chunks are not served: add "
                                         "--untie-embeddings-and-output-weights")
            uneven = {"num_layers_in_first_pipeline_stage": "--num-layers-in-first-pipeline-stage",
                      "num_layers_in_last_pipeline_stage": "--num-layers-in-last-pipeline-stage",
                      "pipeline_model_parallel_layout": "--pipeline-model-parallel-layout",
                      "account_for_embedding_in_pipeline_split": "--account-for-embedding-in-pipeline-split",
                      "account_for_loss_in_pipeline_split": "--account-for-loss-in-pipeline-split",
                      "mtp_num_layers": "--mtp-num-layers"}
            refuse_combined(args, f"{flag} (equal stages in a V)", uneven)
        if name in SPLIT_WEIGHT_SCHEDULES:
            refused = {
                "overlap_grad_reduce": "--overlap-grad-reduce (weight gradients arrive in the W steps, after "
                                       "megatron's per-parameter reduction hooks would have fired)",
                "use_hsdp": "--use-hsdp (HSDP reduces a layer's gradients when its backward ends, before the W step)",
                "defer_embedding_wgrad_compute": "--defer-embedding-wgrad-compute",
                "delay_wgrad_compute": "--delay-wgrad-compute (TransformerEngine's split; the schedule splits itself)",
            }
            refuse_combined(args, flag, refused)
        refuse_combined(args, flag, {"use_megatron_fsdp": "--use-megatron-fsdp"})
        pairs = bool(getattr(args, "overlap_moe_expert_parallel_comm", False))
        if pairs:
            _check_pairs(args, flag, name)
        micro = _micro_batches(args)
        if micro is not None:
            from hyper_adaptor.parallel.pipeline.schedules import steady_micro
            from hyper_adaptor.patches.pipeline.schedules import action_lists

            try:  # the check at a count with the same checks (steady_micro); the run builds its whole lists
                action_lists(name, pp, steady_micro(name, pp, micro), chunks, False, pairs)
            except ValueError as err:
                raise FeatureConfigError(str(err)) from err

    def patches(self, args):
        from hyper_adaptor.patches.pipeline import schedules

        return schedules.patches(args.pipeline_schedule)


def _check_pairs(args, flag: str, name: str) -> None:
    """--overlap-moe-expert-parallel-comm under ``flag``: each steady (F, B) pair runs the forward and the
    backward on two threads that meet at the hooks of the engine's dispatcher. That is sound only where
    the expert-parallel exchanges inside those hooks are the one thing both threads communicate on."""
    asked = f"--overlap-moe-expert-parallel-comm with {flag} (one micro-batch's forward concurrent with another's " \
            "backward)"
    if getattr(args, "moe_dispatcher_engine", None) != "hyper":
        raise FeatureConfigError(f"{asked} needs --moe-dispatcher-engine hyper: the two sides meet at the hooks "
                                 "of its dispatcher")
    if name != "interleaved":
        raise FeatureConfigError(f"{asked}: megatron asks for model chunks with this flag at pipeline size > 1, "
                                 "and of the chunked schedules only interleaved pairs forwards with backwards: use "
                                 "--pipeline-schedule interleaved with --num-virtual-stages-per-pipeline-rank")
    # collectives outside the dispatcher's hooks would be issued by both threads in no fixed order
    for dest, what in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                       ("expert_tensor_parallel_size", "--expert-tensor-parallel-size"),
                       ("context_parallel_size", "--context-parallel-size")):
        size = int(getattr(args, dest, None) or 1)
        if size != 1:
            raise FeatureConfigError(f"{asked} needs {what} 1 (got {size}): that group's collectives would run "
                                     "from both threads")
    refuse_combined(args, asked, {
        "sequence_parallel": "--sequence-parallel (its collectives would run from both threads)",
        "overlap_param_gather": "--overlap-param-gather (the forward's parameter all-gathers and the backward's "
                                "gradient reduction on the data-parallel group from two threads)",
        "use_hsdp": "--use-hsdp (the forward's all-gathers and the backward's reduce-scatters on one group from "
                    "two threads)",
    })


def _micro_batches(args) -> int | None:
    gbs, mbs = getattr(args, "global_batch_size", None), getattr(args, "micro_batch_size", None)
    world = getattr(args, "world_size", None)
    if not (gbs and mbs and world):
        return None
    model_parallel = _pp(args) * int(getattr(args, "tensor_model_parallel_size", 1) or 1) * \
        int(getattr(args, "context_parallel_size", 1) or 1)
    dp = max(1, world // model_parallel)
    return max(1, gbs // (mbs * dp))
