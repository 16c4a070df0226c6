"""End to end from a Megatron-LM checkout, the way MindSpeed's users work: megatron imported from a
directory on PYTHONPATH with no pip metadata (megatron-core 0.19.1, what branch core_r0.19.0 reports),
its dataset helpers not prebuilt but compiled at start-up by megatron's own ``make`` with
``python3 -m pybind11`` from PATH. TP2 x PP2 on 4 CPU processes with the plain Megatron command line on
the embedded corpus: the same losses and grad norms as the pip-installed 0.19.2 wheel (the two releases
differ in no file on this path), whose run is the one tests/e2e/conftest.py shares.
"""

import os
import sys
from pathlib import Path

import pytest

from tests.e2e.test_pretrain_gpt import grad_norms, pretrain, tp2_pp2_flags
from tests.megatron_trees import source_tree

pytestmark = pytest.mark.e2e

# What a checkout's megatron/core/datasets/Makefile does (written here, not copied): build the
# pybind11 extension from helpers.cpp with the headers of the python3 on PATH, named by the
# python3-config on PATH (LIBEXT), which the adaptor overrides with this interpreter's suffix.
MAKEFILE = """\
LIBEXT = $(shell python3-config --extension-suffix)
helpers_cpp$(LIBEXT): helpers.cpp
\t$(CXX) -O3 -Wall -shared -std=c++17 -fPIC $(shell python3 -m pybind11 --includes) $< -o $@
"""


@pytest.fixture(scope="module")
def checkout(tmp_path_factory):
    tree = source_tree("0.19.1", tmp_path_factory.mktemp("Megatron-LM"))
    datasets = tree / "megatron" / "core" / "datasets"
    for built in datasets.glob("helpers_cpp*"):
        built.unlink()
    (datasets / "Makefile").write_text(MAKEFILE)
    return tree


def test_tp2_pp2_from_a_checkout_matches_the_pip_package(checkout, corpus, tp2_pp2_run):
    # python3 on PATH is this interpreter (with pybind11), as in an activated environment
    env = {"PYTHONPATH": os.pathsep.join([str(checkout), str(Path(__file__).resolve().parents[2])]),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    from_checkout, output = pretrain(4, *tp2_pp2_flags(corpus), env=env, torchrun=True)
    # the adaptor's banner names the megatron-core it adapts and where it came from
    assert f"megatron-core 0.19.1 (source tree at {checkout / 'megatron' / 'core'})" in output
    built = list((checkout / "megatron" / "core" / "datasets").glob("helpers_cpp*"))
    assert built, "megatron's make did not build the dataset helpers"
    _, from_wheel, wheel_output = tp2_pp2_run
    assert "megatron-core 0.19.2" in wheel_output and "source tree at" not in wheel_output
    assert sorted(from_checkout) == [1, 2, 3, 4, 5, 6]
    assert from_checkout == from_wheel
    assert grad_norms(output) == grad_norms(wheel_output)
