"""--profile and MindSpeed's --profile-* flags: defaults, the one-profiler adjustment, bad input (one
process, megatron's own parser), and the profiling window driven step by step on this process's CPU."""

import json
import os
import re

import pytest

import hyper_adaptor.megatron_adaptor as adaptor_module
from hyper_adaptor import features, platform
from hyper_adaptor.features import FeatureConfigError
from hyper_adaptor.features.profiling import NSYS_ENV
from hyper_adaptor.patches.profiling import summary, window
from tests.unit.test_adaptor import megatron_args

ADAPTOR = adaptor_module.ADAPTOR
FEATURE = features.get("profiling")


def _prepare(*flags, world=4):
    args = megatron_args(*flags)
    args.rank, args.world_size = 0, world
    return args, ADAPTOR.prepare(args, say=False)


def test_flags_have_mindspeeds_and_megatrons_defaults():
    args = megatron_args()
    assert (args.profile_level, args.profile_save_path) == ("level0", "./profile_dir")
    assert not (args.profile_with_cpu or args.profile_with_stack or args.profile_with_memory
                or args.profile_record_shapes)
    assert (args.profile_step_start, args.profile_step_end, args.profile_ranks) == (10, 12, [])  # megatron's
    assert FEATURE.level == 0


def test_without_profile_the_feature_is_off_and_nothing_changes():
    args, notices = _prepare("--profile-level", "level2", "--use-pytorch-profiler")
    assert not FEATURE.is_enabled(args) and not any("--profile" in n for n in notices)


def test_profile_is_served_by_one_profiler_with_a_notice_at_every_level(tmp_path):
    for level in ("0", "1", "2"):
        args, notices = _prepare("--profile", "--profile-ranks", "0", "2", "--optimization-level", level,
                                 "--profile-save-path", str(tmp_path))
        # megatron's own --profile (nsys, or its torch.profiler) is off: one profiler runs
        assert args.profile is False and FEATURE.is_enabled(args)
        assert any(n.startswith("--profile: True -> False (hyper_adaptor's profiler records steps [10, 12) on "
                                "ranks 0, 2") for n in notices)
        assert [p.target for p in FEATURE.patches(args)] == ["megatron.training.training.train_step"]
        # prepared twice (adapt is idempotent): still served, said once
        assert FEATURE.is_enabled(args) and FEATURE.adjust(args) == []


@pytest.mark.parametrize("ranks, expected", [((), None), (("-1",), None), (("0", "2", "2"), (0, 2))])
def test_profile_ranks_megatrons_empty_and_mindspeeds_minus_one_mean_every_rank(ranks, expected, tmp_path):
    flags = ("--profile-ranks", *ranks) if ranks else ()
    args, _ = _prepare("--profile", *flags, "--profile-save-path", str(tmp_path))
    config = window.WindowConfig.from_args(args)
    assert config.ranks == expected
    assert config.with_cpu  # on CPU the host's operators are what there is to record


def test_megatron_spelling_maps_onto_the_same_profiler(tmp_path):
    board = tmp_path / "tb"
    args, notices = _prepare("--profile", "--use-pytorch-profiler", "--pytorch-profiler-collect-shapes",
                             "--pytorch-profiler-collect-callstack", "--tensorboard-dir", str(board))
    config = window.WindowConfig.from_args(args)
    assert config.record_shapes and config.with_stack
    assert config.save_path == os.path.join(str(board), "..", "torch_profile")
    assert any("--profile-save-path" in n and "--tensorboard-dir/../torch_profile" in n for n in notices)


def test_under_nsys_on_cuda_megatrons_own_profile_stays(monkeypatch):
    monkeypatch.setattr(platform, "device_type", lambda: "cuda")
    monkeypatch.setenv(NSYS_ENV, "1")
    args = megatron_args("--profile")
    assert not FEATURE.requested(args)  # megatron's nsys path: cudaProfilerStart under Nsight Systems
    assert FEATURE.requested(megatron_args("--profile", "--use-pytorch-profiler"))


@pytest.mark.parametrize("flags, message", [
    (("--profile-step-start", "4", "--profile-step-end", "4"),
     r"--profile-step-end 4 must be greater than --profile-step-start 4"),
    (("--profile-step-start", "5", "--profile-step-end", "3"),
     r"--profile-step-end 3 must be greater than --profile-step-start 5"),
    (("--profile-step-start", "-1", "--profile-step-end", "3"), r"--profile-step-start must be >= 0"),
    (("--profile-ranks", "0", "4"), r"--profile-ranks 4: outside the world of 4 processes"),
    (("--profile-ranks", "-2"), r"--profile-ranks -2: outside the world"),
    (("--profile-with-memory",), r"--profile-with-memory needs --profile-with-cpu"),
    (("--train-iters", "11"), r"--profile-step-end 12 is past --train-iters 11"),
    (("--use-pytorch-profiler", "--pytorch-profiler-collect-chakra"), r"--pytorch-profiler-collect-chakra"),
])
def test_bad_input_is_an_error_naming_the_flag(flags, message, tmp_path):
    with pytest.raises(FeatureConfigError, match=message):
        _prepare("--profile", "--profile-save-path", str(tmp_path), *flags)


def test_unwritable_save_path_is_an_error_naming_the_flag(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(FeatureConfigError, match=r"--profile-save-path .*a_file: it exists and is not a directory"):
        _prepare("--profile", "--profile-save-path", str(blocker))
    with pytest.raises(FeatureConfigError, match=r"--profile-save-path .*a_file/traces: .*a_file is not a directory"):
        _prepare("--profile", "--profile-save-path", str(blocker / "traces"))
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(FeatureConfigError, match=r"--profile-save-path .*locked/traces: it cannot be created"):
            _prepare("--profile", "--profile-save-path", str(locked / "traces"))
    assert not (tmp_path / "traces").exists()  # validate checks only: nothing created


# ---------------------------------------------------------------- the window, step by step

def _run(config, iterations, work):
    """megatron's loop as the patch sees it: train_step(iteration=i) for each i."""
    window.configure(config)
    try:
        for i in iterations:
            with window.current().step(i):
                work()
        return window.current()
    finally:
        window.configure(None)


def _config(tmp_path, **overrides):
    values = dict(start=2, end=4, ranks=None, level="level0", with_cpu=True, with_stack=False,
                  with_memory=False, record_shapes=True, save_path=str(tmp_path / "p"))
    values.update(overrides)
    return window.WindowConfig(**values)


def _work():
    import torch

    torch.mm(torch.ones(32, 32), torch.ones(32, 32)).sum()


@pytest.mark.parametrize("level", ["level0", "level1", "level2"])
def test_the_window_records_exactly_steps_start_to_end(tmp_path, capsys, level):
    done = _run(_config(tmp_path, level=level), range(6), _work)
    assert done.done and (done.first, done.last) == (2, 3)
    files = os.listdir(tmp_path / "p")
    assert files == ["rank0.steps2-3.pt.trace.json"]
    events = json.loads((tmp_path / "p" / files[0]).read_text())["traceEvents"]
    assert sorted({e["name"] for e in events if e["name"].startswith("ProfilerStep#")}) == \
        ["ProfilerStep#2", "ProfilerStep#3"]
    assert sum(e["name"] == "aten::mm" for e in events) == 2  # one per recorded step, none from 0, 1, 4, 5
    out = capsys.readouterr().out
    assert re.search(rf"\[profile\] rank 0: steps 2-3 \({level}, torch.profiler, window [0-9.]+ ms\)", out)
    assert re.search(r"\[profile\] rank 0: top host self time: .*aten::mm", out)


def test_a_rank_not_chosen_writes_nothing_and_a_resumed_run_records_what_is_left(tmp_path):
    assert not _run(_config(tmp_path, ranks=(1, 2)), range(6), _work).done
    assert not (tmp_path / "p").exists()
    resumed = _run(_config(tmp_path), range(3, 6), _work)  # resumed after 3 iterations: step 3 only
    assert (resumed.first, resumed.last) == (3, 3)
    assert os.listdir(tmp_path / "p") == ["rank0.steps3-3.pt.trace.json"]


def test_memory_on_cpu_says_that_no_snapshot_is_kept(tmp_path, capsys):
    _run(_config(tmp_path, with_memory=True), range(4), _work)
    assert os.listdir(tmp_path / "p") == ["rank0.steps2-3.pt.trace.json"]
    events = json.loads((tmp_path / "p" / "rank0.steps2-3.pt.trace.json").read_text())["traceEvents"]
    assert any(e["name"] == "[memory]" for e in events)  # the allocation events
    assert "no memory snapshot on cpu" in capsys.readouterr().out


def test_the_patch_passes_through_without_a_window():
    from hyper_adaptor.patches.profiling.patches import profiled_train_step

    calls = []
    step = profiled_train_step(lambda *a, iteration=None, **k: calls.append((a, iteration, k)) or "result")
    window.configure(None)
    assert step(1, 2, iteration=5, x=3) == "result" and calls == [((1, 2), 5, {"x": 3})]


class _Avg:
    def __init__(self, key, cpu):
        self.key, self.self_cpu_time_total, self.self_device_time_total = key, cpu, 0.0


def test_summary_counts_collectives_in_flight_and_ranks_operators():
    rows = [_Avg("ProfilerStep*", 50_000), _Avg("aten::mm", 30_000), _Avg("gloo:all_reduce", 0),
            _Avg("c10d::allreduce_", 2_000), _Avg("aten::add", 1_000)]
    ms = 1_000_000
    # c10d's op on the training thread inside gloo's range on its own thread, and a later one: 12 ms in flight
    intervals = [(10 * ms, 20 * ms), (12 * ms, 14 * ms), (30 * ms, 32 * ms)]
    comm, top = summary.lines(rows, device_time=False, wall_ms=100.0, comm_intervals=intervals, top=2)
    assert comm == "communication 12.0 ms = 12.0% of the window (a collective in flight, any thread)"
    assert top == "top host self time: aten::mm 30.0 ms (30.0%) | c10d::allreduce_ 2.0 ms (2.0%)"


def test_the_recorder_sees_collectives_on_gloos_own_threads(tmp_path, capsys):
    import torch
    import torch.distributed as dist

    from hyper_adaptor.testing import free_port

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        # enough bytes per step that the collectives' time cannot round to 0.0 ms on a fast, idle machine
        x = torch.ones(1 << 20)
        _run(_config(tmp_path), range(4), lambda: [dist.all_reduce(x) for _ in range(8)])
    finally:
        if created:
            dist.destroy_process_group()
    out = capsys.readouterr().out
    share = re.search(r"communication ([0-9.]+) ms", out)
    assert share and float(share.group(1)) > 0, out
