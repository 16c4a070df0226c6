"""End to end on the preview release: Megatron-LM main's own ``pretrain_gpt.py`` (the snapshot in
``../shared/megatron-lm-main``, megatron-core 0.20.0) with the one import line added, megatron imported
from the checkout (no pip metadata, no triton, dataset helpers compiled at start-up by megatron's own
``make``), TP2 x PP2 on 4 CPU processes on the embedded corpus with the flags of the pip 0.19.2 run that
tests/e2e/conftest.py shares. One launch: the losses and grad norms are compared with that run's.
"""

import math
import os
import sys
from pathlib import Path

import pytest

from hyper_adaptor.megatron_version import ALLOW_ENV
from tests.e2e.test_pretrain_gpt import grad_norms, pretrain, tp2_pp2_flags
from tests.megatron_trees import MAIN_SKIP, MAIN_VERSION, main_commit, main_snapshot, main_tree

pytestmark = pytest.mark.e2e

ONE_LINE = "import hyper_adaptor.megatron_adaptor  # noqa: F401  (the one line)\n"


@pytest.fixture(scope="module")
def main_checkout(tmp_path_factory):
    if main_snapshot() is None:
        pytest.skip(MAIN_SKIP)
    tree = main_tree(tmp_path_factory.mktemp("mlm") / "Megatron-LM")
    script = tree / "pretrain_gpt.py"
    text = script.read_text()
    assert "\nimport torch\n" in text, "Megatron-LM main's pretrain_gpt.py no longer imports torch on a line of its own"
    script.write_text(text.replace("\nimport torch\n", "\nimport torch\n" + ONE_LINE, 1))
    return tree


def test_main_snapshot_pretrain_gpt_tp2_pp2_trains_as_the_pip_release(main_checkout, corpus, tp2_pp2_run,
                                                                      monkeypatch):
    monkeypatch.delenv(ALLOW_ENV, raising=False)  # the preview needs no permission
    # python3 on PATH is this interpreter (with pybind11), as in an activated environment
    env = {"PYTHONPATH": os.pathsep.join([str(main_checkout), str(Path(__file__).resolve().parents[2])]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    losses, output = pretrain(4, *tp2_pp2_flags(corpus), env=env, script=str(main_checkout / "pretrain_gpt.py"))
    core = main_checkout / "megatron" / "core"
    assert f"megatron-core {MAIN_VERSION} is a PREVIEW release (Megatron-LM main, checkout commit " \
           f"{main_commit()[:12]};" in output
    assert f"adapting megatron-core {MAIN_VERSION} (source tree at {core})" in output
    assert "Megatron-Core version .......... 0.20.0" in output  # main's own script ran
    assert list((core / "datasets").glob("helpers_cpp*")), "megatron's make did not build the dataset helpers"
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert all(math.isfinite(loss) for loss in losses.values()) and losses[6] < losses[1] - 0.3, losses
    # the same model, data, seed and flags as the pip 0.19.2 run: main changes nothing on this path
    _, from_wheel, wheel_output = tp2_pp2_run
    assert "megatron-core 0.19.2" in wheel_output
    assert losses == from_wheel
    assert grad_norms(output) == grad_norms(wheel_output)
