# embodyhpc: `make demo` runs the local closed loop, `make test` the test suite (both set up first).
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
CONSTRAINTS := tools/ci-constraints.txt
SLURM_CONF ?= /tmp/slurm-local/etc/slurm.conf
export SLURM_CONF
export MLFLOW_DISABLE_TELEMETRY := true

.PHONY: setup system-deps demo test test-fast test-weights bench lint slurm-up slurm-down clean

setup: system-deps $(VENV)/.installed

# Debian packages: FFmpeg libraries for torchcodec, the local Slurm cluster (root only; elsewhere
# install them yourself: tools/system-deps.sh lists them)
system-deps:
	@if [ "$$(id -u)" = 0 ]; then bash tools/system-deps.sh; \
	else echo "setup: not root, skipping Debian packages (see tools/system-deps.sh; slurm tests will skip)"; fi

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[train,data,fp8,sim,libero,track,dev]'
	touch $@

slurm-up: system-deps
	@if [ "$$(id -u)" = 0 ]; then bash tools/slurm-local.sh start >/dev/null; fi

slurm-down:
	bash tools/slurm-local.sh stop

DEMO_DATA := runs/demo-data/metaworld-mt4
DEMO_TASKS := reach-v3,button-press-topdown-v3,drawer-open-v3,door-open-v3

# the closed loop on this machine: expert demonstrations -> 2-process FSDP2 training -> sharded evaluation
# against expert and random -> report + MLflow (recipes/demo_metaworld_cpu.yaml)
demo: setup
	@test -f $(DEMO_DATA)/meta/info.json || $(VENV)/bin/embodyhpc data synth --out $(DEMO_DATA) \
		--tasks $(DEMO_TASKS) --episodes 25 --image-size 32 --workers 2
	MLFLOW_DISABLE_TELEMETRY=true $(VENV)/bin/embodyhpc submit recipes/demo_metaworld_cpu.yaml --local \
		data.root=$(CURDIR)/$(DEMO_DATA)

# The suite's budgets live in pyproject.toml ([tool.pytest.ini_options]: fast_test_budget_s, fast_suite_budget_s,
# suite_budget_s); tests/budget.py prints the slowest tests and files of every run and holds the budgets.
# `make test` runs the fast half first, alone on the machine, so that it is judged as `make test-fast` is, then the
# slow and Slurm tests; both halves on pytest-xdist workers (one worker takes each xdist_group: a shared trained
# run), and a failure in either fails the target after both ran.
PYTEST := $(PY) -m pytest -q
WORKERS ?= 2
# `make test-fast` fails on a test over the fast loop's budget; `make test` (what CI runs, on slower and busier
# machines) reports it loudly without failing. The fast half's failures are repeated at the very end, where a CI
# log's tail shows them.
FAST := -m "not slurm and not slow" -n $(WORKERS) --dist loadgroup --suite-budget fast
SLOW := -m "slurm or slow" -n $(WORKERS) --dist loadgroup --suite-budget full
FAST_LOG := .cache/test-fast-half.log

test: setup slurm-up
	@set -o pipefail; mkdir -p .cache; export EMBODYHPC_TESTS_STARTED=$$(date +%s); rc=0; \
	$(PYTEST) $(FAST) --fast-budget=report -o test_durations_file=.cache/test-durations-fast.jsonl \
		2>&1 | tee $(FAST_LOG) || rc=$$?; \
	$(PYTEST) $(SLOW) -o test_durations_file=.cache/test-durations-slow.jsonl || rc=$$?; \
	echo "== the fast half (full log: $(FAST_LOG)) =="; \
	grep -E '^(FAILED|ERROR) |BUDGET|^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' $(FAST_LOG) || true; \
	exit $$rc

test-fast: setup
	$(PYTEST) $(FAST) --fast-budget

test-weights:  ## tests/durations.json (the order make test starts files in) from the last `make test`
	$(PY) -m tests.budget

bench: setup  ## ratios against baselines measured in the same run (bench/README.md)
	$(PY) bench/cli_latency.py
	$(PY) bench/data_loader.py
	$(PY) bench/packing_throughput.py
	$(PY) bench/staging.py
	$(PY) bench/pi05_inference.py
	$(PY) bench/fsdp_vs_ddp.py
	$(PY) bench/checkpoint_stall.py
	$(PY) bench/pi05_attention.py
	$(PY) bench/compile_blocks.py
	$(PY) bench/eval_throughput.py
	$(PY) bench/eval_vector.py
	$(PY) bench/groot_packing.py
	$(PY) bench/groot_inference.py

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf build dist *.egg-info .pytest_cache .ruff_cache runs
