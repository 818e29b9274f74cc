# `make serve` and `make test` are the two entry points named in README.md.
# Both create .venv on first use: torch==2.13.0 first (a CPU build from local
# disk; a bare `torch` requirement would pull a multi-GB CUDA build), then the
# project with its dev extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
PYTEST_ARGS ?=

.PHONY: serve test bench gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/supervise serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m bench.run_all

clean:
	rm -rf $(VENV) build *.egg-info

# Only where a GPU is at hand (make test never needs one): NCCL engine, NVML
# telemetry, GPU memory released after teardown, exit 85 with a GPU holder.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check $(ARGS)
