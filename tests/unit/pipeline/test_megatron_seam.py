"""patches/pipeline/schedules.py's wrap of megatron's get_forward_backward_func: the schedule is bound into
each set of patches (several schedules in one process, none left selected by a module global)."""

import pytest

from hyper_adaptor.patches.pipeline import schedules


def forward_backward_pipelining_without_interleaving():  # named as megatron's PP > 1 schedule is
    pass


def forward_backward_no_pipelining():  # named as megatron's PP 1 function is
    pass


def _wrapped_get(name: str, megatrons_choice):
    (patch,) = [p for p in schedules.patches(name) if p.target == schedules.TARGET]
    return patch.replacement(lambda *args, **kwargs: megatrons_choice)


def test_each_set_of_patches_hands_out_its_own_schedule():
    gets = {name: _wrapped_get(name, forward_backward_pipelining_without_interleaving) for name in ("zbh1", "gpipe")}
    for name, get in gets.items():
        chosen = get()
        assert chosen.func is schedules.forward_backward and chosen.args == (name,)


def test_one_pipeline_rank_and_the_bridge_schedule_stay_megatrons():
    assert _wrapped_get("zbh1", forward_backward_no_pipelining)() is forward_backward_no_pipelining
    get = _wrapped_get("zbh1", forward_backward_pipelining_without_interleaving)
    assert get(schedule_pg_collection=object()) is forward_backward_pipelining_without_interleaving


def test_only_zbv_moves_megatrons_model_build_into_the_v():
    assert any("get_batch_on_this_tp_rank" in p.target for p in schedules.patches("zbv"))
    assert not any("get_batch_on_this_tp_rank" in p.target for p in schedules.patches("interleaved"))


def test_an_unknown_schedule_names_the_flag():
    with pytest.raises(ValueError, match="--pipeline-schedule: unknown schedule 'zb'"):
        schedules.patches("zb")
