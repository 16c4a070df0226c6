"""--moe-dispatcher-engine / --moe-dispatch-chunks / MindSpeed's --moe-alltoall-overlap-comm: what the
expert-parallel feature asks for, switches and refuses (one process, megatron's own argument parser)."""

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import features
from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.patches.expert import dispatcher
from tests.unit.test_adaptor import megatron_args

ADAPTOR = adaptor_module.ADAPTOR
MODEL = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "1")
MOE = ("--num-experts", "4", "--moe-token-dispatcher-type", "alltoall")
ENGINE = ("--moe-dispatcher-engine", "hyper")


def _prepare(*flags):
    args = megatron_args(*MODEL, *flags)
    args.rank, args.world_size = 0, 4
    notices = ADAPTOR.prepare(args, say=False)
    return args, notices


def feature():
    return features.get("expert_parallel")


def test_megatrons_dispatcher_by_default_feature_off():
    args, _ = _prepare(*MOE)
    assert args.moe_dispatcher_engine == "megatron" and args.moe_dispatch_chunks == 1
    assert not feature().requested(args) and not feature().asked_explicitly(args)


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_engine_asked_replaces_moe_layers_dispatcher_name_and_wraps_its_expert_step(chunks):
    args, notices = _prepare(*MOE, *ENGINE, "--expert-model-parallel-size", "2", "--moe-dispatch-chunks", str(chunks))
    assert feature().is_enabled(args) and feature().asked_explicitly(args)
    assert not [n for n in notices if "moe" in n]
    name, experts = feature().patches(args)
    assert name.target == dispatcher.TARGET and name.kind == "replace" and name.rebind_in == ()
    assert experts.target == dispatcher.EXPERTS_TARGET and experts.kind == "wrap"
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    assert issubclass(name.replacement, MoETokenDispatcher) and name.replacement.CHUNKS == chunks


@pytest.mark.parametrize("extra", [
    ("--moe-expert-capacity-factor", "1.0"),
    ("--moe-expert-capacity-factor", "1.5", "--moe-pad-expert-input-to-capacity"),
    ("--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "position"),
    ("--moe-shared-expert-intermediate-size", "64", "--moe-shared-expert-overlap"),
    ("--moe-grouped-gemm",),
    ("--deterministic-mode",),
    ("--bf16",),
    ("--moe-dispatch-chunks", "4", "--moe-expert-capacity-factor", "1.0"),
    ("--moe-dispatch-chunks", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
     "--expert-tensor-parallel-size", "1"),
    ("--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2", "--bf16"),
    ("--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2", "--bf16",
     "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
     "--pipeline-schedule", "interleaved"),
])
def test_served_combinations(extra):
    args, _ = _prepare(*MOE, *ENGINE, *extra)
    assert feature().is_enabled(args)


@pytest.mark.parametrize("flags, named", [
    # what the engine serves
    ((*ENGINE,), ("--moe-dispatcher-engine hyper", "--num-experts")),
    (("--num-experts", "4", *ENGINE), ("--moe-dispatcher-engine hyper", "--moe-token-dispatcher-type alltoall",
                                        "allgather", "megatron's default")),
    (("--num-experts", "4", "--moe-token-dispatcher-type", "allgather", *ENGINE),
     ("--moe-dispatcher-engine hyper", "--moe-token-dispatcher-type alltoall")),
    # chunks
    ((*MOE, *ENGINE, "--moe-dispatch-chunks", "0"), ("--moe-dispatch-chunks", ">= 1")),
    ((*MOE, "--moe-dispatch-chunks", "2"), ("--moe-dispatch-chunks 2", "--moe-dispatcher-engine hyper")),
    ((*MOE, *ENGINE, "--moe-dispatch-chunks", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"),
     ("--moe-dispatch-chunks 2", "--expert-tensor-parallel-size 2")),
    ((*MOE, *ENGINE, "--moe-dispatch-chunks", "2", "--expert-tensor-parallel-size", "2"),
     ("--moe-dispatch-chunks 2", "--expert-tensor-parallel-size 2")),
    ((*MOE, *ENGINE, "--moe-dispatch-chunks", "2", "--moe-expert-capacity-factor", "1",
      "--moe-pad-expert-input-to-capacity"), ("--moe-dispatch-chunks 2", "--moe-pad-expert-input-to-capacity")),
    ((*MOE, "--moe-alltoall-overlap-comm", "--tensor-model-parallel-size", "2", "--sequence-parallel"),
     ("--moe-dispatch-chunks 2 (asked by --moe-alltoall-overlap-comm)", "--expert-tensor-parallel-size 2")),
    # capacity
    ((*MOE, *ENGINE, "--moe-expert-capacity-factor", "nan"), ("--moe-expert-capacity-factor",)),
    ((*MOE, *ENGINE, "--moe-expert-capacity-factor", "-1"), ("--moe-expert-capacity-factor",)),
    ((*MOE, *ENGINE, "--moe-pad-expert-input-to-capacity"),
     ("--moe-pad-expert-input-to-capacity", "--moe-expert-capacity-factor")),
    ((*MOE, *ENGINE, "--moe-shared-expert-overlap"), ("--moe-shared-expert-overlap",
                                                      "--moe-shared-expert-intermediate-size")),
    # conflicts, naming both flags
    # megatron's combined 1F1B runs the dispatcher's steps as separate nodes: the plain engine only
    ((*MOE, *ENGINE, "--overlap-moe-expert-parallel-comm", "--moe-dispatch-chunks", "2"),
     ("--moe-dispatch-chunks 2", "--overlap-moe-expert-parallel-comm", "--moe-dispatch-chunks 1")),
    ((*MOE, "--moe-alltoall-overlap-comm", "--overlap-moe-expert-parallel-comm"),
     ("--moe-dispatch-chunks 2 (asked by --moe-alltoall-overlap-comm)", "--overlap-moe-expert-parallel-comm")),
    ((*MOE, *ENGINE, "--overlap-moe-expert-parallel-comm", "--moe-shared-expert-intermediate-size", "64",
      "--moe-shared-expert-overlap"), ("--moe-shared-expert-overlap", "--overlap-moe-expert-parallel-comm")),
    ((*MOE, *ENGINE, "--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "1f1b"),
     ("--pipeline-schedule 1f1b", "--overlap-moe-expert-parallel-comm", "--pipeline-schedule interleaved")),
    ((*MOE, "--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--pipeline-schedule", "interleaved"),
     ("--pipeline-schedule interleaved", "--overlap-moe-expert-parallel-comm", "--moe-dispatcher-engine hyper")),
    ((*MOE, *ENGINE, "--overlap-moe-expert-parallel-comm", "--expert-model-parallel-size", "2",
      "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--pipeline-schedule", "interleaved", "--overlap-grad-reduce", "--use-distributed-optimizer",
      "--overlap-param-gather"), ("--pipeline-schedule interleaved", "--overlap-param-gather")),
    ((*MOE, *ENGINE, "--moe-permute-fusion"), ("--moe-dispatcher-engine hyper", "--moe-permute-fusion")),
    ((*MOE, *ENGINE, "--moe-router-padding-for-fp8"), ("--moe-dispatcher-engine hyper",
                                                       "--moe-router-padding-for-fp8")),
    # below level 2: an error, not megatron's dispatcher instead
    ((*MOE, *ENGINE, "--optimization-level", "1"), ("--moe-dispatcher-engine hyper", "--optimization-level 2")),
    ((*MOE, "--moe-alltoall-overlap-comm", "--optimization-level", "0"),
     ("--moe-alltoall-overlap-comm", "--optimization-level 2")),
])
def test_refused_naming_the_flags(flags, named):
    with pytest.raises(FeatureConfigError) as error:
        _prepare(*flags)
    for name in named:
        assert name in str(error.value), (name, str(error.value))


@pytest.mark.parametrize("pipeline", [False, True])
def test_megatrons_combined_1f1b_flag_puts_pair_hooks_in_the_dispatcher_under_hyper_adaptors_schedule(pipeline):
    """megatron's combined 1F1B calls the dispatcher's steps from its own nodes (no hooks); hyper_adaptor's
    interleaved schedule pairs micro-batches at the hooks around the engine's dispatch and combine."""
    schedule = ("--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
                "--pipeline-schedule", "interleaved") if pipeline else ()
    args, _ = _prepare(*MOE, *ENGINE, "--expert-model-parallel-size", "2", "--bf16",
                       "--overlap-moe-expert-parallel-comm", *schedule)
    name, _ = feature().patches(args)
    assert name.replacement.CHUNKS == 1 and name.replacement.PAIR_HOOKS is pipeline


def test_mindspeeds_alltoall_overlap_asks_for_the_engine_with_notices():
    args, notices = _prepare(*MOE, "--moe-alltoall-overlap-comm")
    assert args.moe_dispatcher_engine == "hyper" and args.moe_dispatch_chunks == 2
    assert any("--moe-dispatcher-engine" in n and "--moe-alltoall-overlap-comm" in n for n in notices)
    assert any("--moe-dispatch-chunks" in n for n in notices)


def test_validate_leaves_args_as_it_found_them():
    args, _ = _prepare(*MOE, *ENGINE, "--moe-expert-capacity-factor", "1.0")
    before = dict(vars(args))
    feature().validate(args)
    assert vars(args) == before


# hot-expert replicas
EP2 = ("--expert-model-parallel-size", "2")
REPLICAS = ("--moe-hot-expert-replicas", "2")


def test_hot_expert_replicas_are_served_on_the_engine_with_their_training_seams():
    from hyper_adaptor.patches.expert import replicas

    args, _ = _prepare(*MOE, *ENGINE, *EP2, *REPLICAS, "--moe-replica-interval", "3")
    assert feature().is_enabled(args) and args.moe_hot_expert_replicas == 2 and args.moe_replica_interval == 3
    patches = feature().patches(args)
    assert [p.target for p in patches[2:]] == [replicas.FINISH_TARGET, replicas.STEP_TARGET]
    off, _ = _prepare(*MOE, *ENGINE, *EP2)
    assert off.moe_hot_expert_replicas == 0 and off.moe_replica_interval == 100 and len(feature().patches(off)) == 2


@pytest.mark.parametrize("flags, named", [
    ((*MOE, *EP2, *REPLICAS), ("--moe-hot-expert-replicas 2", "--moe-dispatcher-engine hyper")),
    ((*MOE, *ENGINE, *REPLICAS), ("--moe-hot-expert-replicas 2", "--expert-model-parallel-size")),
    ((*MOE, *ENGINE, *EP2, "--moe-hot-expert-replicas", "5"), ("--moe-hot-expert-replicas 5", "--num-experts",
                                                               "= 4")),
    ((*MOE, *ENGINE, *EP2, "--moe-hot-expert-replicas", "-1"), ("--moe-hot-expert-replicas", ">= 0")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--moe-replica-interval", "0"), ("--moe-replica-interval", ">= 1",
                                                                       "--moe-hot-expert-replicas 2")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--moe-expert-capacity-factor", "1.0"),
     ("--moe-hot-expert-replicas 2", "--moe-expert-capacity-factor")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--moe-expert-capacity-factor", "1.0", "--moe-pad-expert-input-to-capacity"),
     ("--moe-hot-expert-replicas 2", "--moe-expert-capacity-factor")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--moe-dispatch-chunks", "2"),
     ("--moe-hot-expert-replicas 2", "--moe-dispatch-chunks 2")),
    ((*MOE, *EP2, *REPLICAS, "--moe-alltoall-overlap-comm"),
     ("--moe-hot-expert-replicas 2", "--moe-dispatch-chunks 2 (asked by --moe-alltoall-overlap-comm)")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--tensor-model-parallel-size", "2", "--sequence-parallel"),
     ("--moe-hot-expert-replicas 2", "--expert-tensor-parallel-size 2")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--overlap-grad-reduce"), ("--moe-hot-expert-replicas 2",
                                                                 "--overlap-grad-reduce")),
    ((*MOE, *ENGINE, *EP2, *REPLICAS, "--optimization-level", "1"),
     ("--moe-hot-expert-replicas 2", "--optimization-level 2")),
])
def test_hot_expert_replicas_refused_naming_the_flags(flags, named):
    with pytest.raises(FeatureConfigError) as error:
        _prepare(*flags)
    for name in named:
        assert name in str(error.value), (name, str(error.value))
