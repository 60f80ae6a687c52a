# The two commands in the README: `make serve` and `make test`. Each creates the virtual
# environment on first use, so a fresh clone needs nothing else.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
PYTEST_ARGS ?=

.PHONY: serve test test-slow coverage check lint bench bench-report gpu-check perf-analyzer-env pytriton-env constraints clean

# Versions held to constraints.txt, the last resolution that passed (CONSTRAINTS= for the newest).
CONSTRAINTS ?= constraints.txt

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]' $(if $(CONSTRAINTS),-c $(CONSTRAINTS))
	touch $(STAMP)

# A fresh resolution of pyproject.toml's dependencies (dev extra included), frozen into
# constraints.txt under its header: run the tests on it before committing it.
constraints:
	rm -rf .constraints-venv && $(PYTHON) -m venv .constraints-venv
	.constraints-venv/bin/python -m pip install -q --upgrade pip
	.constraints-venv/bin/python -m pip install -q -e '.[dev]'
	{ grep '^#' constraints.txt; .constraints-venv/bin/python -m pip freeze --exclude-editable; } > constraints.new
	mv constraints.new constraints.txt && rm -rf .constraints-venv

serve: $(STAMP)
	$(BIN)/clipserve --pretrained none $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow $(PYTEST_ARGS)

# Line coverage of the GPU modules (torch executors, their device layer, GPU JPEG decode) under
# the backend, batching and GPU-decode tests on this machine's CPU: the device layer and the
# decoder's CPU twin run their lines here; docs/gpu-status.md lists what stays CUDA-only.
# Fails below 90%. ~5 min.
COVERED := clipserve/backends/torch_eager.py,clipserve/backends/cuda_graphs.py,clipserve/backends/torch_device.py,clipserve/inference/gpu_decode.py,clipserve/inference/nvjpeg.py,clipserve/inference/decode_process.py,clipserve/batching/on_device.py
coverage: $(STAMP)
	mkdir -p .cache
	rm -f .cache/coverage .cache/coverage.*
	$(BIN)/python -m coverage run --source=clipserve \
		-m pytest -q tests/backends tests/batching tests/inference/test_gpu_decode.py \
		tests/inference/test_gpu_decode_safety.py tests/inference/test_gpu_decode_served.py \
		tests/inference/test_decode_process.py $(PYTEST_ARGS)
	$(BIN)/python -m coverage run --source=clipserve \
		-m pytest -q -m slow tests/inference/test_decode_process.py $(PYTEST_ARGS)
	$(BIN)/python -m coverage combine -q
	$(BIN)/python -m coverage report --include=$(COVERED) --show-missing --fail-under=90

lint: $(STAMP)
	$(BIN)/ruff check clipserve bench tests
	$(BIN)/ruff format --check clipserve bench tests
	$(BIN)/mypy

check: lint test

bench: $(STAMP)
	$(BIN)/python -m bench.served_vs_offline

# The whole benchmark report into bench/results/<date>-<machine>/ (~12 min here; ARGS=--quick: ~2).
bench-report: ARGS =
bench-report: $(STAMP)
	$(BIN)/clipserve-bench report $(ARGS)

# Every GPU path measured on this machine's first CUDA device, into one JSON under bench/results/
# (~20 min; ARGS="--allow-cpu --quick" checks the tool itself without a GPU). Needs no venv:
# a GPU host's own python with the wheel set in bench/gpu_check/__init__.py's docstring.
gpu-check: ARGS =
gpu-check:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m bench.gpu_check $(ARGS)

# Triton's perf_analyzer in .perf-analyzer/ (binary and libraries extracted, nothing installed):
# tests/test_perf_analyzer.py (slow) runs it against clipserve over gRPC and HTTP.
perf-analyzer-env: $(STAMP)
	PYTHON=$(BIN)/python scripts/perf_analyzer_env.sh .perf-analyzer

# Triton's front end for bench/frontend's cost section (PyTriton, in a venv of its own).
pytriton-env:
	scripts/pytriton_env.sh .pytriton

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .perf-analyzer .pytriton

# The images built and run on this host (10-20 min; docker/test.sh says what it checks) into
# bench/results/docker-test.json and .log. Exits 0 with SKIPPED where no Docker engine answers.
# DOCKER=/path/to/docker picks the client (it needs BuildKit: buildx, or one before 23).
.PHONY: docker-test
docker-test:
	docker/test.sh
