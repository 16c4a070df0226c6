"""The checkpoint resumed from is a complete one (hyper_adaptor/patches/checkpoint/survival.py), on
synthetic checkpoint directories: which directory is chosen and what is said, the atomic tracker write,
the preemption flag's device on backends megatron does not name, the store of a restarted attempt."""

import os
from types import SimpleNamespace

import pytest

from hyper_adaptor.patches.checkpoint import survival
from hyper_adaptor.patches.checkpoint.survival import TRACKER, choose, incomplete_reason, parse_tracker


def iteration(root, number, files=(".metadata", "metadata.json", "__0_0.distcp")):
    path = root / f"iter_{number:07d}"
    path.mkdir()
    for name in files:
        (path / name).write_text("x")
    return path


def tracker(root, text):
    (root / TRACKER).write_text(text)


def test_complete_tracker_choice_says_nothing(tmp_path):
    iteration(tmp_path, 2), iteration(tmp_path, 4)
    tracker(tmp_path, "4")
    assert choose(tmp_path) == (4, [])


def test_incomplete_directory_newer_than_the_tracker_is_named(tmp_path):
    iteration(tmp_path, 2), iteration(tmp_path, 4)
    torn = iteration(tmp_path, 6, files=("__0_0.distcp", ".metadata"))
    tracker(tmp_path, "4")
    chosen, said = choose(tmp_path)
    assert chosen == 4
    assert said == [f"skipped {torn}: metadata.json is missing (the save did not finish)"]


def test_tracker_naming_an_incomplete_directory_falls_back(tmp_path):
    iteration(tmp_path, 2)
    torn = iteration(tmp_path, 4, files=("__0_0.distcp",))
    tracker(tmp_path, "4")
    chosen, said = choose(tmp_path)
    assert chosen == 2
    assert said == [f"skipped {torn}: .metadata and metadata.json are missing (the save did not finish)"]


@pytest.mark.parametrize("text, why", [("", "it is empty"), ("4\x00\x00", "not an iteration"),
                                       ("-3", "it holds -3")])
def test_unusable_tracker_falls_back_to_the_newest_complete(tmp_path, text, why):
    iteration(tmp_path, 2), iteration(tmp_path, 4)
    empty = iteration(tmp_path, 6, files=())
    tracker(tmp_path, text)
    chosen, said = choose(tmp_path)
    assert chosen == 4
    assert why in said[0] and said[0].startswith(f"the tracker {tmp_path / TRACKER} is not usable")
    assert said[1:] == [f"skipped {empty}: it is empty"]


def test_tracker_naming_a_missing_directory(tmp_path):
    iteration(tmp_path, 2)
    tracker(tmp_path, "4")
    chosen, said = choose(tmp_path)
    assert chosen == 2 and said == ["the tracker names iteration 4, whose directory does not exist"]


def test_nothing_complete(tmp_path):
    iteration(tmp_path, 2, files=("__0_0.distcp",))
    tracker(tmp_path, "2")
    assert choose(tmp_path)[0] is None


def test_release_and_legacy_checkpoints_are_left_to_megatron(tmp_path):
    tracker(tmp_path, "release")
    assert parse_tracker(tmp_path / TRACKER) == (0, None)
    assert choose(tmp_path) == (None, [])
    legacy = tmp_path / "iter_0000002"
    (legacy / "mp_rank_00").mkdir(parents=True)
    assert incomplete_reason(legacy) is None


def reader(tmp_path):
    seen = []

    def read_metadata(path):
        seen.append(open(path).read())
        return int(seen[-1]), False

    return survival._complete_checkpoint_reader(survival.FINAL_FILES["torch_dist"])(read_metadata), seen


def test_reader_gives_megatron_the_chosen_iteration_and_one_notice(tmp_path, capsys, monkeypatch):
    from hyper_adaptor import notice

    monkeypatch.setenv("RANK", "0")
    notice.forget()
    iteration(tmp_path, 2)
    tracker(tmp_path, "")
    read, seen = reader(tmp_path)
    assert read(str(tmp_path / TRACKER)) == (2, False)
    assert read(str(tmp_path / TRACKER)) == (2, False)
    assert seen == ["2", "2"]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith("[hyper_adaptor] checkpoint: the tracker")
    assert out[0].endswith(f"resuming from iteration 2 ({tmp_path / 'iter_0000002'})")
    assert (tmp_path / TRACKER).read_text() == ""  # the user's files are left as they are


def test_reader_refuses_when_nothing_is_complete(tmp_path):
    iteration(tmp_path, 2, files=())
    tracker(tmp_path, "2")
    read, _ = reader(tmp_path)
    with pytest.raises(RuntimeError, match=r"--load .*no complete checkpoint"):
        read(str(tmp_path / TRACKER))


class Storage:
    """megatron's maybe_msc as the tracker write sees it: ``open`` is the builtin."""

    def __init__(self):
        self.os = os

    def open(self, *args, **kwargs):
        return open(*args, **kwargs)


def test_tracker_write_is_atomic(tmp_path):
    storage = survival._atomic_tracker(Storage())
    path = str(tmp_path / TRACKER)
    tracker(tmp_path, "4")
    with storage.open(path, "w") as f:
        f.write("6")
        assert (tmp_path / TRACKER).read_text() == "4"  # not visible until closed
    assert (tmp_path / TRACKER).read_text() == "6"
    assert oct(os.stat(path).st_mode & 0o777) != oct(0o600)
    with pytest.raises(KeyboardInterrupt), storage.open(path, "w") as f:
        f.write("8")
        raise KeyboardInterrupt  # a death inside the write keeps the previous tracker
    assert (tmp_path / TRACKER).read_text() == "6"
    assert sorted(os.listdir(tmp_path)) == [TRACKER]
    # everything else goes to megatron's object unchanged
    with storage.open(str(tmp_path / "other.txt"), "w") as f:
        f.write("y")
    assert storage.os is os and (tmp_path / "other.txt").read_text() == "y"


def test_signal_flags_gather_on_the_platform_device(monkeypatch):
    import torch

    def megatron_get_device(local_rank=None):
        raise RuntimeError  # megatron's answer for any backend but nccl and gloo

    device = survival._platform_signal_device(megatron_get_device)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "hccl")
    assert device() == torch.device("cpu")  # this machine's platform
    monkeypatch.setattr(torch.distributed, "get_backend", lambda *a: "gloo")
    with pytest.raises(RuntimeError):
        device()


def test_restarted_attempt_gets_its_own_store(monkeypatch):
    calls = []

    def initialize_distributed(get_embedding_ranks, get_position_embedding_ranks, store, extra=None):
        calls.append(store)

    wrapped = survival._store_per_attempt(initialize_distributed)
    monkeypatch.setattr(survival, "attempt_store", lambda: "attempt store")
    wrapped(None, None, None)
    wrapped(None, None, store="given")
    assert calls == ["attempt store", "given"]
    monkeypatch.undo()
    for env in ({"TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"},
                {"TORCHELASTIC_RESTART_COUNT": "1", "TORCHELASTIC_USE_AGENT_STORE": "False"}):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert survival.attempt_store() is None


def test_patches_follow_the_flags():
    targets = [p.target for p in survival.patches(SimpleNamespace(exit_signal_handler=False))]
    assert "megatron.training.dist_signal_handler.get_device" not in targets
    assert "megatron.training.checkpointing.read_metadata" in targets
    assert "megatron.training.checkpointing.read_metadata" not in [
        p.target for p in survival.patches(SimpleNamespace(ckpt_step=4))]
    assert "megatron.training.dist_signal_handler.get_device" in [
        p.target for p in survival.patches(SimpleNamespace(exit_signal_handler=True))]


def test_required_files_follow_the_checkpoint_format(tmp_path):
    dcp = iteration(tmp_path, 2, files=(".metadata", "__0_0.distcp"))
    assert incomplete_reason(dcp, survival.final_files(SimpleNamespace(ckpt_format="torch_dcp"))) is None
    assert "metadata.json" in incomplete_reason(dcp, survival.final_files(SimpleNamespace(ckpt_format="torch_dist")))
    assert incomplete_reason(iteration(tmp_path, 4, files=("x",)), survival.final_files(
        SimpleNamespace(ckpt_format="torch"))) is None


def test_load_with_nothing_complete_is_refused_before_anything_is_built(tmp_path):
    from hyper_adaptor.features import get
    from hyper_adaptor.features.base import FeatureConfigError

    torn = iteration(tmp_path, 2, files=("__0_0.distcp",))
    tracker(tmp_path, "2")
    args = SimpleNamespace(load=str(tmp_path), ckpt_format="torch_dist", ckpt_step=None)
    validate = get("checkpoint").validate
    with pytest.raises(FeatureConfigError, match=rf"--load {tmp_path}: no complete checkpoint .*skipped {torn}"):
        validate(args)
    iteration(tmp_path, 1)
    assert survival.problems(args) == []
