# Two set-up-free entry points (README): `make demo` trains, `make test` tests. Both create .venv first.
#
# The install order matters on Python 3.11: megatron-core 0.19.2 declares Python >= 3.12 but ships a
# cp311 wheel, so it goes in with --no-deps --ignore-requires-python after its real dependencies.
# torch is pinned to 2.13.0 (the CPU build on this machine): an unpinned `torch` would pull a
# multi-GB CUDA build. Override TORCH_SPEC on a machine that needs another build.

PYTHON      ?= python3
VENV        ?= .venv
TORCH_SPEC  ?= torch==2.13.0
MCORE_SPEC  ?= megatron-core==0.19.2
MCORE_RELEASES ?= 0.19.0 0.19.1 0.19.2
PY          := $(VENV)/bin/python
STAMP       := $(VENV)/.hyper_adaptor-installed
PYTEST_ARGS ?=
RUFF_SPEC   ?= ruff==0.17.6

.PHONY: setup demo lint test test-fast torch-venv test-torch bench clean-venv

setup: $(STAMP)

$(STAMP): setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet numpy
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet "packaging>=24.2" einops psutil pybind11 pytest pytest-timeout pytest-xdist "$(RUFF_SPEC)"
	$(PY) -m pip install --quiet --no-deps --ignore-requires-python "$(MCORE_SPEC)"
	$(PY) -m pip install --quiet --no-deps -e .
	# the other megatron-core releases the patches are checked against, unpacked by the tests as
	# Megatron-LM checkouts (no pip metadata); 2-3 MB each
	for v in $(MCORE_RELEASES); do $(PY) -m pip download --quiet --no-deps --ignore-requires-python \
		"megatron-core==$$v" -d $(VENV)/megatron-releases; done
	# megatron's own Muon (emerging-optimizers, Python >= 3.12 declared), for the tests that compare with it;
	# not installed: the suite runs without it, as most Python 3.11 machines do
	$(PY) -m pip download --quiet --no-deps --ignore-requires-python emerging-optimizers==0.3.0 absl-py==2.5.1 \
		-d $(VENV)/emerging-optimizers
	$(PY) -c "import torch, hyper_adaptor.megatron_adaptor, megatron.core; print('torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
	touch $(STAMP)

# The main job: a real megatron.training GPT run, TP2 x PP2 on 4 processes, embedded stdlib corpus.
demo: $(STAMP)
	PYTHON=$(abspath $(PY)) bash examples/run_demo.sh

# The linter (ruff.toml): a finding fails `make test` before any test runs.
lint: $(STAMP)
	$(VENV)/bin/ruff check .

# The whole suite (unit, distributed parity, end to end), after the linter, each phase on two workers
# (pytest-xdist). The unit tests are single-process and independent; the distributed and end-to-end tests
# start worlds of ranks, and a file's tests share them (module fixtures), so a file stays on one worker
# (--dist loadfile; xdist's loadgroup is ignored by the pinned pytest 9.2). One world alone leaves part of
# the two cores idle while its ranks wait on each other; two at once keep both busy.
test: lint
	$(PY) -m pytest -q -n 2 --durations=20 $(PYTEST_ARGS) tests/unit
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=40 $(PYTEST_ARGS) tests/distributed tests/e2e tests/gpu

# Without the end-to-end torchrun runs.
test-fast: lint
	$(PY) -m pytest -q -m "not e2e" $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/level0_overhead.py

clean-venv:
	rm -rf $(VENV)

# Optional, not part of CI: the unit and distributed tests against another torch release, in a venv of
# its own (.venv-torch-<version>), e.g. `make test-torch TORCH=2.15.0`. Releases above the cap in
# /etc/xdg/pip/constraints.txt (this machine's pip config) come from PyPI as their default CUDA build
# (several GB with the nvidia-* wheels; it runs on the CPU), so the cap is lifted for that one install,
# and the triton it brings is removed so that only torch differs from CI's stack.
# Each phase runs to the end even when the other fails; one summary line per phase closes the run.
TORCH       ?=
TORCH_VENV  := .venv-torch-$(TORCH)
TORCH_PY    := $(TORCH_VENV)/bin/python

# the venv is `setup`'s recipe with another VENV and TORCH_SPEC (the cap lifted for it)
torch-venv:
	@test -n "$(TORCH)" || { echo "usage: make test-torch TORCH=<version>, e.g. TORCH=2.15.0"; exit 2; }
	PIP_CONSTRAINT=/dev/null $(MAKE) --no-print-directory setup VENV=$(TORCH_VENV) TORCH_SPEC="torch==$(TORCH)"
	# the CUDA builds bring triton; CI's CPU build does not, and the level-0 tests expect its stand-in
	$(TORCH_PY) -m pip uninstall --quiet -y triton 2>/dev/null || true

test-torch: torch-venv
	@rc=0; for phase in unit distributed; do \
		if [ $$phase = unit ]; then workers="-n 2"; else workers="-n 2 --dist loadfile"; fi; \
		echo "== torch $(TORCH): tests/$$phase (log: $(TORCH_VENV)/test-$$phase.log)"; \
		$(TORCH_PY) -m pytest -q -rfE $$workers $(PYTEST_ARGS) tests/$$phase > $(TORCH_VENV)/test-$$phase.log 2>&1 \
			|| rc=1; \
		grep -E '^(FAILED|ERROR) ' $(TORCH_VENV)/test-$$phase.log || true; \
	done; \
	for phase in unit distributed; do \
		echo "torch $$($(TORCH_PY) -c 'import torch; print(torch.__version__)') | tests/$$phase: $$(tail -n 1 $(TORCH_VENV)/test-$$phase.log | tr -d =)"; \
	done; \
	exit $$rc
