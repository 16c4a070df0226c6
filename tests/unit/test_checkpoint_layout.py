"""The checkpoint layout record and the transition rules (hyper_adaptor/patches/checkpoint/layout.py),
on synthetic records and on a synthetic checkpoint directory (megatron's legacy ``common.pt`` form of
the common state: the record is read from it exactly as from the DCP-embedded one). The real
checkpoints are tests/e2e/test_checkpoint_inspect.py's."""

import argparse
import io
import json
import os

import pytest
import torch

import hyper_adaptor.megatron_adaptor  # level 0 before megatron is imported
from hyper_adaptor.features import get
from hyper_adaptor.features.base import FeatureConfigError
from hyper_adaptor.features.checkpoint import applied_features
from hyper_adaptor.patches.checkpoint import layout
from hyper_adaptor.patches.checkpoint.layout import check_transition, from_args

MODEL = dict(num_layers=4, hidden_size=64, ffn_hidden_size=256, num_attention_heads=4, kv_channels=16,
             vocab_size=256, make_vocab_size_divisible_by=64,
             swiglu=False, add_bias_linear=True, untie_embeddings_and_output_weights=False,
             group_query_attention=False, num_query_groups=None, num_experts=None, moe_ffn_hidden_size=None)


def args(world=4, **kw):
    """A megatron namespace as a run (or a checkpoint's saved args) has it."""
    values = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
                  expert_model_parallel_size=1, expert_tensor_parallel_size=None, world_size=world,
                  virtual_pipeline_model_parallel_size=None, pipeline_schedule=None, optimizer="adam",
                  use_distributed_optimizer=False, use_hsdp=False, hsdp_optimizer_level="level2",
                  no_save_optim=None, no_load_optim=None, finetune=False, load=None, ckpt_step=None, **MODEL)
    values.update(kw)
    return argparse.Namespace(**values)


def rec(world=4, state_format=None, **kw):
    return from_args(args(world, **kw), state_format=state_format)


TP2_PP2_DIST = rec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, use_distributed_optimizer=True,
                   state_format="dp_reshardable")


# -- what moves -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved, target", [
    # megatron's DDP / HSDP optimizer state is keyed by the model's parameters: it moves with them
    (rec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
     rec(pipeline_model_parallel_size=4, use_hsdp=True, hsdp_optimizer_level="level3")),
    (rec(use_hsdp=True, hsdp_optimizer_level="level3"), rec(world=2, use_hsdp=True, hsdp_optimizer_level="level3")),
    (rec(use_hsdp=True, hsdp_optimizer_level="level1"), rec(use_hsdp=True, hsdp_optimizer_level="level3")),
    (rec(use_hsdp=True), rec()),
    (rec(context_parallel_size=2), rec()),
    (rec(expert_model_parallel_size=2, num_experts=4), rec(num_experts=4)),
    (rec(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="zbv"),
     rec(pipeline_model_parallel_size=2)),
    (rec(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2), rec(pipeline_model_parallel_size=2)),
    # the distributed optimizer's bucket formats move across data and context parallel
    (rec(use_distributed_optimizer=True, state_format="dp_reshardable"),
     rec(world=2, use_distributed_optimizer=True)),
    (rec(context_parallel_size=2, use_distributed_optimizer=True, state_format="dp_reshardable"),
     rec(use_distributed_optimizer=True)),
    # its model-space format moves anywhere under the distributed optimizer
    (rec(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, use_distributed_optimizer=True,
         state_format="fully_reshardable"),
     rec(pipeline_model_parallel_size=4, use_distributed_optimizer=True)),
    # Muon under megatron's DDP or HSDP: model space as well
    (rec(optimizer="muon", tensor_model_parallel_size=2), rec(optimizer="muon", use_hsdp=True)),
    # megatron's layer-wise optimizer at the layout that saved it
    (rec(optimizer="muon", use_distributed_optimizer=True), rec(optimizer="muon", use_distributed_optimizer=True)),
], ids=["tp2pp2-ddp->pp4-hsdp3", "hsdp3-dp4->dp2", "hsdp1->hsdp3", "hsdp->ddp", "cp2->cp1", "ep2->ep1",
        "zbv->1f1b", "vpp2->vpp1", "distopt-dp4->dp2", "distopt-cp2->cp1", "fully-reshardable-tp2pp2->pp4",
        "muon-ddp->hsdp", "muon-layer-wise-same"])
def test_allowed_transitions(saved, target):
    assert check_transition(saved, target) == []


# -- what is refused --------------------------------------------------------------------------------------------
def test_bucket_format_refuses_a_tp_pp_change_naming_both_layouts_and_the_way_out():
    saved = TP2_PP2_DIST
    saved.path = "ckpt/iter_0000004"
    [problem] = check_transition(saved, rec(pipeline_model_parallel_size=4, use_distributed_optimizer=True))
    assert problem.startswith("checkpoint ckpt/iter_0000004 was saved at TP2 PP2 (1f1b) DP1 with the distributed "
                              "optimizer (dp_reshardable) and cannot load at TP1 PP4 (1f1b) DP1 with the "
                              "distributed optimizer"), problem
    assert "only moves across data parallel (it changed: TP 2 -> 1, PP 2 -> 4)" in problem
    assert "re-save it from a run at TP2 PP2 (1f1b) with --dist-ckpt-optim-fully-reshardable" in problem
    assert "--no-load-optim" in problem
    # the model alone moves
    assert check_transition(saved, rec(pipeline_model_parallel_size=4, use_distributed_optimizer=True),
                            load_optimizer=False) == []


@pytest.mark.parametrize("saved, target, words", [
    # megatron itself only checks TP and PP; these pass its check
    (rec(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, use_distributed_optimizer=True,
         state_format="dp_reshardable"),
     rec(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, pipeline_schedule="zbv",
         use_distributed_optimizer=True),
     "the layers' placement interleaved -> zbv"),
    (rec(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2, use_distributed_optimizer=True,
         state_format="dp_reshardable"),
     rec(pipeline_model_parallel_size=2, use_distributed_optimizer=True), "VPP 2 -> 1"),
    (rec(expert_model_parallel_size=2, num_experts=4, use_distributed_optimizer=True, state_format="dp_reshardable"),
     rec(num_experts=4, use_distributed_optimizer=True), "EP 2 -> 1"),
    (rec(use_distributed_optimizer=True, state_format="dp_zero_gather_scatter"),
     rec(tensor_model_parallel_size=2, use_distributed_optimizer=True), "TP 1 -> 2"),
], ids=["interleaved->zbv", "vpp2->vpp1", "ep2->ep1", "dp-zero-tp"])
def test_bucket_format_refuses_what_megatron_does_not_check(saved, target, words):
    [problem] = check_transition(saved, target)
    assert words in problem and "--dist-ckpt-optim-fully-reshardable" in problem, problem


@pytest.mark.parametrize("saved, target, words", [
    (rec(use_distributed_optimizer=True, state_format="dp_reshardable"), rec(use_hsdp=True),
     "only the distributed optimizer reads"),
    (rec(use_distributed_optimizer=True, state_format="fully_sharded_model_space"), rec(),
     "reaches megatron's DDP and HSDP only from the distributed optimizer's fully_reshardable format"),
    (rec(optimizer="muon"), rec(), "its optimizer state is muon's and this run's --optimizer is adam"),
    (rec(optimizer="muon", use_distributed_optimizer=True),
     rec(world=2, optimizer="muon", use_distributed_optimizer=True), "saves for one fixed layout (it changed: DP)"),
    (rec(optimizer="muon", use_distributed_optimizer=True), rec(optimizer="muon", use_hsdp=True),
     "layer-wise distributed optimizer"),
], ids=["distopt->hsdp", "fs-model-space->ddp", "muon->adam",
        "layer-wise-dp", "layer-wise->hsdp"])
def test_optimizer_holders_that_do_not_read_each_other(saved, target, words):
    [problem] = check_transition(saved, target)
    assert words in problem and "--no-load-optim" in problem, problem
    assert check_transition(saved, target, load_optimizer=False) == []


@pytest.mark.parametrize("saved, target", [
    (rec(use_distributed_optimizer=True, state_format="fully_reshardable", tensor_model_parallel_size=2),
     rec(pipeline_model_parallel_size=2)),
    (rec(use_hsdp=True, hsdp_optimizer_level="level3"), rec(use_distributed_optimizer=True,
                                                            tensor_model_parallel_size=2)),
    (rec(), rec(use_distributed_optimizer=True)),
], ids=["fully-reshardable->ddp", "hsdp->distopt", "ddp->distopt"])
def test_model_space_optimizer_state_moves_between_the_distributed_and_per_parameter_optimizers(saved, target):
    assert check_transition(saved, target) == []


def test_a_tp_change_that_changes_the_padded_vocabulary_is_refused_naming_the_flag():
    [problem] = check_transition(rec(vocab_size=257, tensor_model_parallel_size=2), rec(vocab_size=257),
                                 load_optimizer=False)
    # 257 padded to a multiple of 64 x 2 = 384 rows at TP2, of 64 x 1 = 320 at TP1
    assert problem.startswith("--make-vocab-size-divisible-by:") and "384" in problem and "320" in problem


def test_a_model_of_another_shape_is_refused_naming_the_flag_even_without_the_optimizer():
    problems = check_transition(rec(), rec(num_layers=8, hidden_size=128), load_optimizer=False)
    assert len(problems) == 2
    assert problems[0].startswith("--num-layers: the checkpoint holds a model with --num-layers 4, "
                                  "this run builds --num-layers 8"), problems
    assert "--hidden-size" in problems[1]
    # flags the command line leaves out are not compared
    assert check_transition(rec(), rec(vocab_size=None)) == []
    # a world size not known is no change of DP
    layer_wise = rec(optimizer="muon", use_distributed_optimizer=True)
    assert check_transition(layer_wise, rec(world=None, optimizer="muon", use_distributed_optimizer=True)) == []


def test_a_checkpoint_without_optimizer_state_loads_anywhere():
    saved = rec(use_distributed_optimizer=True, state_format="dp_reshardable", no_save_optim=True)
    assert check_transition(saved, rec(tensor_model_parallel_size=2)) == []


# -- the record ------------------------------------------------------------------------------------------------
def test_the_record_describes_the_layout():
    assert str(TP2_PP2_DIST) == "TP2 PP2 (1f1b) DP1 with the distributed optimizer (dp_reshardable)"
    zbv = rec(world=8, pipeline_model_parallel_size=2, num_virtual_stages_per_pipeline_rank=2, pipeline_schedule="zbv",
              context_parallel_size=2, context_parallel_algo="ulysses", expert_model_parallel_size=2, num_experts=4,
              use_hsdp=True, hsdp_optimizer_level="level3")
    assert str(zbv) == "TP1 PP2 VPP2 (zbv) CP2 (ulysses) EP2 DP2 with HSDP level3"
    assert zbv.optimizer_state() == "adam, held by HSDP level3 (model space)"
    # megatron's checks turn --optimizer muon --use-distributed-optimizer into its layer-wise optimizer
    assert rec(optimizer="dist_muon").holder() == "megatron's layer-wise distributed optimizer"
    assert rec(world=None).dp is None and "DP?" in str(rec(world=None))


def save_checkpoint(tmp_path, iteration=4, sidecar=None, **kw):
    """A torch_dist checkpoint directory as megatron writes one, less its tensors."""
    directory = tmp_path / "ckpt"
    it = directory / f"iter_{iteration:07d}"
    it.mkdir(parents=True)
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (it / ".metadata").write_bytes(b"")  # a finished save (patches/checkpoint/survival.py looks for it)
    state = {"args": args(**kw), "iteration": iteration, "content_metadata": {}}
    if kw.get("use_distributed_optimizer"):
        state["content_metadata"]["distrib_optim_sharding_type"] = "dp_reshardable"
    torch.save(state, it / "common.pt")
    (directory / layout.TRACKER).write_text(str(iteration))
    if sidecar is not None:
        (it / layout.SIDECAR).write_text(json.dumps(sidecar))
    return directory


def test_reading_a_plain_megatron_checkpoint(tmp_path):
    directory = save_checkpoint(tmp_path, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                use_distributed_optimizer=True)
    saved = layout.read(str(directory))
    assert saved.path == str(directory / "iter_0000004") and saved.iteration == 4
    assert str(saved) == "TP2 PP2 (1f1b) DP1 with the distributed optimizer (dp_reshardable)"
    assert saved.versions is None and saved.features is None  # saved without hyper_adaptor
    assert applied_features(saved.args) == ()
    assert layout.read(str(directory / "iter_0000004")).iteration == 4  # an iteration directory itself


def test_reading_the_sidecar_and_a_chosen_step(tmp_path):
    directory = save_checkpoint(tmp_path, iteration=2, sidecar={
        "versions": {"hyper_adaptor": "0.1.0", "megatron_core": "0.19.2"}, "features": ["hsdp"]},
        use_hsdp=True, optimization_level=2)
    (directory / layout.TRACKER).write_text("9")
    saved = layout.read(str(directory), step=2)
    assert saved.versions == {"hyper_adaptor": "0.1.0", "megatron_core": "0.19.2"} and saved.features == ("hsdp",)
    # the tracker names a directory that is not there: the checkpoint a start resumes from is read
    # (patches/checkpoint/survival.py's choice), the newest complete one
    assert layout.read(str(directory)).path == str(directory / "iter_0000002")


@pytest.mark.parametrize("make, words", [
    (lambda d: None, "no such directory"),
    (lambda d: d.mkdir(), "holds no checkpoint (no latest_checkpointed_iteration.txt"),
    (lambda d: (d.mkdir(), (d / layout.TRACKER).write_text("x")), "holds 'x', not an iteration, and no complete"),
    (lambda d: (d.mkdir(), (d / layout.TRACKER).write_text("3"), (d / "iter_0000003").mkdir()),
     "is not a torch_dist checkpoint (no metadata.json"),
    (lambda d: (d.mkdir(), (d / layout.TRACKER).write_text("3"), (d / "iter_0000003").mkdir(),
                (d / "iter_0000003" / "metadata.json").write_text("{}")),
     "its metadata.json names the sharded backend None"),
    (lambda d: (d.mkdir(), (d / layout.TRACKER).write_text("3"), (d / "iter_0000003").mkdir(),
                (d / "iter_0000003" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')),
     "an incomplete save (no .metadata"),
    (lambda d: (d.mkdir(), (d / layout.TRACKER).write_text("3"), (d / "iter_0000003").mkdir(),
                (d / "iter_0000003" / "metadata.json").write_text('{"sharded_backend": "torch_dist"}'),
                (d / "iter_0000003" / ".metadata").write_bytes(b"torn")),
     "its common state (megatron's args) cannot be read"),
], ids=["missing", "empty", "bad-tracker", "legacy", "other-backend", "incomplete", "torn"])
def test_bad_input_is_a_clear_error(tmp_path, make, words):
    directory = tmp_path / "ckpt"
    make(directory)
    with pytest.raises(layout.CheckpointError, match=words.replace("(", r"\(").replace(")", r"\)")):
        layout.read(str(directory))


# -- at start-up --------------------------------------------------------------------------------------------
def test_validate_refuses_before_loading_and_respects_the_flags_that_skip_the_optimizer(tmp_path):
    validate = get("checkpoint").validate
    directory = save_checkpoint(tmp_path, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                use_distributed_optimizer=True)
    run = args(pipeline_model_parallel_size=4, use_distributed_optimizer=True, load=str(directory))
    with pytest.raises(FeatureConfigError, match=r"^--load: checkpoint .*iter_0000004 was saved at TP2 PP2 .*"
                                                 r"cannot load at TP1 PP4"):
        validate(run)
    for flag in ("no_load_optim", "finetune"):
        validate(argparse.Namespace(**{**vars(run), flag: True}))
    validate(args(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, world=8,
                         use_distributed_optimizer=True, load=str(directory)))  # DP 1 -> 2
    # nothing there, or nothing readable: megatron's loader (and the restart path) decide
    validate(args(load=str(tmp_path / "none")))
    # the tracker names a directory that is not there: the start resumes from iteration 4, which is checked
    (directory / layout.TRACKER).write_text("7")
    with pytest.raises(FeatureConfigError, match="iter_0000004 was saved at TP2 PP2"):
        validate(run)
    # --ckpt-step picks the checkpoint that is checked
    with pytest.raises(FeatureConfigError):
        validate(argparse.Namespace(**{**vars(run), "ckpt_step": 4}))


def test_the_save_is_wrapped_to_write_the_sidecar_from_rank_0(tmp_path):
    assert layout.patches(args()) == []
    run = args(save=str(tmp_path), optimization_level=2, use_hsdp=True)
    assert "hsdp" in applied_features(run)
    [patch] = layout.patches(run, applied_features(run))
    assert (patch.target, patch.kind, patch.feature) == (layout.SAVE, "wrap", "checkpoint")
    calls = []
    save = patch.replacement(lambda sd, d, **kw: calls.append(d) or "request")
    it = tmp_path / "iter_0000004"
    it.mkdir()
    assert save({}, str(it), async_sharded_save=False) == "request" and calls == [str(it)]
    written = json.loads((it / layout.SIDECAR).read_text())
    assert written["versions"]["hyper_adaptor"] == hyper_adaptor.__version__
    assert written["versions"]["megatron_core"] == "0.19.2" and "hsdp" in written["features"]
    other = tmp_path / "converted"
    other.mkdir()
    save({}, str(other))  # a save that is not a training checkpoint gets no sidecar
    assert not os.path.exists(other / layout.SIDECAR)


# -- the command ---------------------------------------------------------------------------------------------
def test_inspect_prints_the_record_and_answers_for_a_command_line(tmp_path, capsys):
    from hyper_adaptor import checkpoint_cli

    directory = save_checkpoint(tmp_path, tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                use_distributed_optimizer=True)
    out = io.StringIO()
    assert checkpoint_cli.inspect([str(directory)], out=out) == 0
    text = out.getvalue()
    assert "iteration        4" in text and "saved at         TP2 PP2 (1f1b) DP1 (world 4)" in text
    assert "adam, held by the distributed optimizer (dp_reshardable)" in text
    assert "versions         not recorded" in text
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
             "--max-position-embeddings", "64", "--micro-batch-size", "1", "--use-distributed-optimizer"]
    out = io.StringIO()
    code = checkpoint_cli.inspect([str(directory), "--", *model, "--pipeline-model-parallel-size", "4"], out=out)
    assert code == 2 and "can load: no" in out.getvalue() and "cannot load at TP1 PP4 (1f1b) DP1" in out.getvalue()
    out = io.StringIO()
    code = checkpoint_cli.inspect([str(directory), "--", *model, "--tensor-model-parallel-size", "2",
                                   "--pipeline-model-parallel-size", "2", "--world-size", "8"], out=out)
    assert code == 0 and "can load: yes (model and optimizer state)" in out.getvalue(), out.getvalue()
    with pytest.raises(SystemExit) as exit_:
        checkpoint_cli.inspect([str(tmp_path / "nowhere")])
    assert exit_.value.code == 2 and "no such directory" in capsys.readouterr().err
