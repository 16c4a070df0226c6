"""The pipeline feature's flag handling (features/pipeline.py): what validate refuses (naming the flags),
what adjust switches, and the notice below level 2. Parity of each schedule:
tests/distributed/test_pipeline_megatron.py; through megatron.training: tests/e2e/test_pipeline_megatron.py."""

import types

import pytest

import hyper_adaptor.megatron_adaptor  # noqa: F401
from hyper_adaptor.features import FeatureConfigError, get
from hyper_adaptor.megatron_adaptor import Adaptor

PIPELINE = get("pipeline")


def _args(**flags):
    args = types.SimpleNamespace(optimization_level=2, num_layers=8, pipeline_model_parallel_size=4,
                                 tensor_model_parallel_size=1, context_parallel_size=1,
                                 virtual_pipeline_model_parallel_size=None, overlap_p2p_comm=False,
                                 untie_embeddings_and_output_weights=True, world_size=4, global_batch_size=8,
                                 micro_batch_size=1)
    PIPELINE.fill_defaults(args)
    vars(args).update(flags)
    return args


def _refused(match, **flags):
    args = _args(**flags)
    PIPELINE.adjust(args)
    with pytest.raises(FeatureConfigError, match=match):
        PIPELINE.validate(args)


def test_every_schedule_validates_where_it_applies():
    for name, chunks in (("1f1b", None), ("gpipe", None), ("zbh1", None), ("interleaved", 2), ("zbv", 2)):
        args = _args(pipeline_schedule=name, virtual_pipeline_model_parallel_size=chunks)
        assert PIPELINE.requested(args)
        PIPELINE.adjust(args)
        PIPELINE.validate(args)
    assert not PIPELINE.requested(_args())


def test_combinations_that_cannot_work_are_errors_naming_the_flags():
    _refused(r"--pipeline-schedule zbh1 needs --pipeline-model-parallel-size >= 2 \(got 1\)",
             pipeline_schedule="zbh1", pipeline_model_parallel_size=1)
    _refused(r"--pipeline-schedule interleaved needs model chunks: --num-virtual-stages-per-pipeline-rank",
             pipeline_schedule="interleaved")
    _refused(r"--pipeline-schedule zbv needs model chunks: --num-virtual-stages-per-pipeline-rank 2",
             pipeline_schedule="zbv")
    _refused(r"--pipeline-schedule zbv .* must be 2 \(got 4\)", pipeline_schedule="zbv",
             virtual_pipeline_model_parallel_size=4, num_layers=16)
    _refused(r"--pipeline-schedule gpipe runs one model chunk per rank", pipeline_schedule="gpipe",
             virtual_pipeline_model_parallel_size=2)
    _refused(r"--untie-embeddings-and-output-weights", pipeline_schedule="zbv",
             virtual_pipeline_model_parallel_size=2, untie_embeddings_and_output_weights=False)
    _refused(r"--pipeline-schedule zbv .* --num-layers-in-first-pipeline-stage", pipeline_schedule="zbv",
             virtual_pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1)
    _refused(r"--pipeline-schedule zbh1 cannot be combined with --overlap-grad-reduce", pipeline_schedule="zbh1",
             overlap_grad_reduce=True)
    _refused(r"--pipeline-schedule zbv cannot be combined with --use-hsdp", pipeline_schedule="zbv",
             virtual_pipeline_model_parallel_size=2, use_hsdp=True)
    _refused(r"--pipeline-schedule 1f1b cannot be combined with --use-megatron-fsdp", pipeline_schedule="1f1b",
             use_megatron_fsdp=True)


def test_schedules_without_weight_split_take_megatrons_overlapped_reduction_and_hsdp():
    for flags in (dict(overlap_grad_reduce=True), dict(use_hsdp=True)):
        args = _args(pipeline_schedule="interleaved", virtual_pipeline_model_parallel_size=2, **flags)
        PIPELINE.validate(args)


def test_pp2_with_chunks_switches_on_overlap_p2p_comm_for_megatrons_check():
    # megatron asserts PP > 2 for model chunks without --overlap-p2p-comm; the engine has no such limit
    args = _args(pipeline_schedule="zbv", virtual_pipeline_model_parallel_size=2, pipeline_model_parallel_size=2,
                 world_size=2)
    notices = PIPELINE.adjust(args)
    assert args.overlap_p2p_comm is True
    assert any("--overlap-p2p-comm" in n and "--pipeline-schedule zbv" in n for n in notices), notices


def test_fewer_micro_batches_than_stages_run_with_a_notice_naming_the_bubble():
    args = _args(pipeline_schedule="1f1b", global_batch_size=2)
    notices = PIPELINE.adjust(args)
    PIPELINE.validate(args)
    assert any("2 micro-batches" in n and "--pipeline-model-parallel-size 4" in n for n in notices), notices


def test_below_level_2_the_flag_gets_a_notice_and_megatrons_schedule_runs():
    adaptor = Adaptor()
    args = _args(pipeline_schedule="zbh1", optimization_level=1)
    notices = adaptor.prepare(args, say=False)
    assert not PIPELINE.is_enabled(args)
    assert any("--pipeline-schedule" in n and "level" in n for n in notices), notices
