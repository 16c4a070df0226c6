"""The optimizer-format seam (hyper_adaptor/patches/checkpoint/optimizer_formats.py) on small inputs; the
layouts it serves are proved end to end by tests/e2e/test_checkpoint_layouts.py."""

from __future__ import annotations

import pytest
import torch

from hyper_adaptor.patches.checkpoint import optimizer_formats as fmt

KEY = "decoder.layers.mlp.linear_fc1.weight"


@pytest.mark.parametrize("requested,present,want", [
    # the distributed optimizer's main parameter, from a Float16 plain checkpoint and from an fp32 one
    (f"optimizer.state.param.{KEY}", {f"optimizer.state.fp32_param.{KEY}", KEY}, f"optimizer.state.fp32_param.{KEY}"),
    (f"optimizer.state.param.{KEY}", {KEY}, KEY),
    # Float16's main parameter from a distributed-optimizer checkpoint
    (f"optimizer.state.fp32_param.{KEY}", {f"optimizer.state.param.{KEY}"}, f"optimizer.state.param.{KEY}"),
    # present as asked: untouched; moments and model weights are never renamed
    (f"optimizer.state.param.{KEY}", {f"optimizer.state.param.{KEY}", KEY}, None),
    (f"optimizer.state.exp_avg.{KEY}", {f"optimizer.state.exp_avg_sq.{KEY}", KEY}, None),
    (KEY, {f"optimizer.state.param.{KEY}"}, None),
])
def test_a_missing_main_parameter_key_is_read_from_where_the_other_optimizer_kept_it(requested, present, want):
    assert fmt.alias_for(requested, present) == want


@pytest.fixture(autouse=True)
def _megatron():
    import hyper_adaptor.megatron_adaptor  # noqa: F401  (the import shims megatron.core needs here)


def _adam():
    w, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    return torch.optim.AdamW([{"params": [w], "weight_decay": 0.1, "wd_mult": 1.0},
                              {"params": [b], "weight_decay": 0.0, "wd_mult": 0.0}])


def test_distributed_groups_become_plain_groups_with_this_optimizers_parameters_and_one_step():
    saved = [{"lr": 1e-3, "weight_decay": 0.0, "wd_mult": 0.0, "step": 2.0},
             {"lr": 1e-3, "weight_decay": 0.1, "wd_mult": 1.0, "step": 2.0}]
    groups, step = fmt.plain_groups(saved, _adam())  # saved in the other order: matched by configuration
    assert step == 2.0
    assert [g["params"] for g in groups] == [[0], [1]]  # this optimizer's ids, in its order
    assert all("step" not in g for g in groups)
    assert [g["wd_mult"] for g in groups] == [1.0, 0.0]  # each with its own group's configuration


def test_a_group_the_checkpoint_lacks_is_an_error_naming_it():
    with pytest.raises(ValueError, match="no parameter group configured as this run's"):
        fmt.plain_groups([{"wd_mult": 1.0, "step": 1.0}], _adam())


def test_checkpoint_keys_reads_the_dcp_metadata_only(tmp_path):
    import torch.distributed.checkpoint as dcp

    assert fmt.checkpoint_keys(tmp_path) is None  # no .metadata: not a torch_dist checkpoint
    dcp.save({"a.weight": torch.ones(2), "optimizer.state.exp_avg.a.weight": torch.zeros(2)},
             checkpoint_id=str(tmp_path), no_dist=True)
    assert fmt.checkpoint_keys(tmp_path) == {"a.weight", "optimizer.state.exp_avg.a.weight"}
