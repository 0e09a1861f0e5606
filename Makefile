# Quick start: `make demo` (the main job on the local simulated fleet) and `make test`.
# Both set themselves up: a .venv with the CPU build of torch (pinned first, so that no
# dependency pulls a multi-GB CUDA build) and this package with its test extra.

# The interpreter both venvs are made with (.venv and the real-SGLang one): the distribution's
# /usr/bin/python3 where it is 3.11+ with venv, else python3 on PATH; PYTHON=... picks another.
# Not simply python3: where that is pyenv's (as on the machines this project is built on), it
# is built without PGO and LTO (pyenv's default: no --enable-optimizations in its
# CONFIG_ARGS), and the suite is CPU-bound Python. Measured here, Debian's 3.11.2 against
# pyenv's 3.11.7: a pure-Python loop 0.52-0.56 s against 0.73-0.84 s; tests/service/
# test_restart_local.py, tests/bench/test_predicted_sweep.py and tests/patching/
# test_tune_deploy.py on one worker 160 s of machine CPU against 181-193 s; the real-server
# lane 620 s of CPU and 385 s against 685 s and 411 s.
ifeq ($(origin PYTHON),undefined)
PYTHON := $(shell /usr/bin/python3 -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (3, 11))' \
            2>/dev/null && echo /usr/bin/python3 || echo python3)
endif
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# The real SGLang 0.5.23 wheel, downloaded once; the test fleet installs it into each host.
WHEELS := .cache/wheels

DEMO_HOSTS := sim-ct200 sim-b300

.PHONY: venv lint test test-sglang real-server-lane bundle-coverage-readme sglang-cpu demo demo-hosts clean

# PyTorch's CPU wheel index, used where it is reachable: from PyPI alone, torch==2.13.0 on
# Linux x86-64 is the CUDA build with ~17 NVIDIA packages (gigabytes). Where it is not
# reachable, pip's own indexes decide: a CPU build only where they offer one (a local wheel
# folder, as on the machines this project is built on), and the make says so.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH_INDEX_REACHABLE := import sys, urllib.request; urllib.request.urlopen("$(TORCH_CPU_INDEX)/torch/", timeout=5)

# pip is quiet (-q) and takes 1-2 minutes on a fresh clone: the line before it says what it
# does. setuptools prints a boxed BuildBackendWarning ("Editable installation ... folders
# named like the package may take precedence during imports": here that folder IS the
# package) on every editable install; PYTHONWARNINGS quiets that one warning, in that step.
EDITABLE_QUIET := PYTHONWARNINGS="ignore:Editable installation"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "setting up $(VENV): pip, $(TORCH_PIN) and ddtree-ops with its test extra; 1-2 min the first time, quiet while pip works"
	$(PY) -m pip install -q --upgrade pip
	@if $(PY) -c '$(TORCH_INDEX_REACHABLE)' 2>/dev/null; then \
	  echo "torch: the CPU build from $(TORCH_CPU_INDEX)"; \
	  $(PY) -m pip install -q $(TORCH_PIN) --index-url $(TORCH_CPU_INDEX); \
	else \
	  echo "torch: $(TORCH_CPU_INDEX) is not reachable; $(TORCH_PIN) from pip's configured indexes (the CPU build only where they offer one, e.g. a local wheel folder; from PyPI on Linux x86-64 it is the CUDA build, several GB)"; \
	  $(PY) -m pip install -q $(TORCH_PIN); \
	fi
	$(EDITABLE_QUIET) $(PY) -m pip install -q -e '.[test]'
	mkdir -p $(WHEELS)
	ls $(WHEELS)/sglang-0.5.23-*.whl >/dev/null 2>&1 || $(PY) -m pip download -q --no-deps sglang==0.5.23 -d $(WHEELS)
	touch $(STAMP)

venv: $(STAMP)

# ruff (rules and 120 columns in pyproject.toml; patches/ has its own ruff.toml) and mypy
# (its files and strictness in pyproject.toml too). CI runs it before `make test`.
lint: $(STAMP)
	$(PY) -m ruff check ddtree_ops tests benchmarks && $(PY) -m mypy

# The whole suite. Without PYTEST_ARGS the real-SGLang environment (minutes of pip and
# disk on a fresh machine) is built while the rest of the suite runs, at the lowest CPU
# priority, so that it takes from the suite only what the suite leaves idle (measured on
# fresh clones: the suite 726 s beside it at nice 19, the environment 586 s and done
# first; at normal priority, 8 tests fewer, 689 s and 389 s). The real-server lane runs
# last. The main lane runs on four pytest-xdist workers and the real-server lane on three,
# on CI's two cores: with two, a fifth of the CPU went idle while tests waited on what they
# had started (a server's load, a unit's restart, SSH round trips; vmstat over a whole main
# lane: 21 % idle), and with three it stayed busy (measured at fd54920, `make test` beside
# the environment's build: main lane 990 s with three against 1142-1211 s with two alone,
# 3-6 % idle; the real-server lane 316 s with three against 353 s with two). Four in the
# main lane, measured alone (its workers' CPU in a cgroup): 950 s and 1809 s of CPU at
# ef02248, against 998 s and 1804 s with three at b9cc12f (a tenth of the CPU idle with
# three, 3 % with four); the real-server lane took 345 s with four, no better than with
# three. What four leave idle is too little for the real-SGLang environment's build beside
# them (~100 s of CPU), so .ci/run starts that build first, beside .venv's setup and the
# linters. Running the lanes side by side was slower than one after the other (both
# starve: ~28 min against ~25). How the real-server lane splits its work between the
# workers: tests/sglang_real/conftest.py LANE_UNITS. The main lane is --dist loadgroup:
# tests/conftest.py keeps a module with a module-scoped host on one worker and starts the
# slow modules first, so that no worker ends the lane alone.
MAIN_XDIST ?= -n 4 --dist loadgroup
# One OpenMP thread per process in both lanes: their workers and what they start
# already fill both cores, and torch's OpenMP threads spin-waiting for a core the other
# worker holds stretch CPU-bound tests many times over (measured: tests/benchmarks on two
# workers 134.7 s -> 121.8 s, its gpu_check harness test 66.7 s -> 13.5 s; with two busy
# loops beside it, tests/sglang_real/test_ddtree_inprocess.py 24.8 s -> 20.2 s). The
# simulator and the real-server lane's servers set one thread themselves.
TEST_ENV := OMP_NUM_THREADS=1
REAL_XDIST ?= -n 3 --dist loadscope --no-loadscope-reorder
# A narrowed run builds the real-SGLang environment (~7 GB) only when it names that lane.
test: $(STAMP) $(if $(findstring sglang_real,$(PYTEST_ARGS)),sglang-cpu)
ifeq ($(strip $(PYTEST_ARGS)),)
	@mkdir -p .cache; \
	nice -n 19 $(PYTHON) tests/sglang_real/setup_env.py > .cache/sglang-cpu-setup.log 2>&1 & setup=$$!; \
	$(TEST_ENV) DDTREE_OPS_WHEELS=$(abspath $(WHEELS)) $(PY) -m pytest -q $(MAIN_XDIST) --ignore=tests/sglang_real; rc=$$?; \
	if ! wait $$setup; then cat .cache/sglang-cpu-setup.log; exit 1; fi; \
	tail -n 1 .cache/sglang-cpu-setup.log; \
	$(MAKE) --no-print-directory real-server-lane || rc=1; \
	exit $$rc
else
	$(TEST_ENV) DDTREE_OPS_WHEELS=$(abspath $(WHEELS)) $(PY) -m pytest -q $(PYTEST_ARGS)
endif

# The real SGLang 0.5.23 server on CPU (a separate venv under .cache/sglang-cpu, ~7 GB,
# a few minutes once, then instant): what the DDTree bundle is tested inside. Its build
# is stdlib Python and needs nothing of .venv (.ci/run starts it before .venv exists).
sglang-cpu:
	$(PYTHON) tests/sglang_real/setup_env.py

# The tests against the real SGLang server (DDTree on real SGLang, the deploy -> restart ->
# bench pipeline without the simulator), with the DDTree bundle's coverage measured in
# every server process; then the coverage is checked against the list of lines not
# executed (and why) in the bundle's README. `make test-sglang PYTEST_ARGS=...` runs a
# subset without the coverage check.
SGLANG_PY := .cache/sglang-cpu/venv/bin/python
COVERAGE_DIR := .cache/bundle-coverage
COVERAGE_ENV := DDTREE_COVERAGE_RC=$(abspath tests/sglang_real/bundle-coverage.ini) \
	DDTREE_COVERAGE_DIR=$(abspath $(COVERAGE_DIR)) DDTREE_BUNDLE_FILES=$(abspath patches/ddtree_temperature/files)
BUNDLE_README := patches/ddtree_temperature/README.md

real-server-lane:
	@rm -rf $(COVERAGE_DIR) && mkdir -p $(COVERAGE_DIR); \
	$(TEST_ENV) $(COVERAGE_ENV) DDTREE_OPS_WHEELS=$(abspath $(WHEELS)) $(PY) -m pytest -q --durations=25 $(REAL_XDIST) tests/sglang_real; rc=$$?; \
	$(COVERAGE_ENV) $(SGLANG_PY) tests/sglang_real/bundle_coverage.py --check $(BUNDLE_README) || rc=1; \
	exit $$rc

test-sglang: $(STAMP) sglang-cpu
ifeq ($(strip $(PYTEST_ARGS)),)
	@$(MAKE) --no-print-directory real-server-lane
else
	$(TEST_ENV) DDTREE_OPS_WHEELS=$(abspath $(WHEELS)) $(PY) -m pytest -q \
	  $(or $(filter tests/%,$(PYTEST_ARGS)),tests/sglang_real) $(filter-out tests/%,$(PYTEST_ARGS))
endif

# After the lane: rewrite the README's coverage section from the data it left (reasons of
# the ranges still not executed are kept; new ones say TODO until written).
bundle-coverage-readme:
	$(COVERAGE_ENV) $(SGLANG_PY) tests/sglang_real/bundle_coverage.py --write $(BUNDLE_README)

# Each local simulated host gets its own Python prefix holding the real SGLang 0.5.23
# files (the site-packages that `deploy` patches); a .pth exposes the main venv so that
# torch and ddtree_ops (the simulator) import there too.
demo-hosts: $(STAMP)
	@for h in $(DEMO_HOSTS); do \
	  d=.cache/demo-hosts/$$h; \
	  if [ ! -f $$d/.ready ]; then \
	    rm -rf $$d && $(PY) -m venv --without-pip $$d && \
	    $(PY) -m pip --python $$d/bin/python install -q --no-deps $(WHEELS)/sglang-0.5.23-*.whl && \
	    sp=$$($$d/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))') && \
	    $(PY) -c 'import sysconfig; print("import site; site.addsitedir(%r)" % sysconfig.get_path("purelib"))' > $$sp/ddtree_ops_dev.pth && \
	    touch $$d/.ready || exit 1; \
	  fi; \
	done

# The whole story on the local simulated fleet: check the hosts, deploy the DDTree patch,
# restart on DDTree (the b300 host falls back to eager), sweep, report. A fresh ledger
# each time; `ddtree-ops bench ... --resume` is how an interrupted sweep is finished.
# --no-policy: the demo starts from the fixed tree even after `tune --deploy local`
# (README "Tuning the tree per batch size"), whose policy has no budget-16 state on the b300.
DEMO_OPS := $(VENV)/bin/ddtree-ops -i inventories/local.yaml
demo: demo-hosts
	$(DEMO_OPS) doctor local
	$(DEMO_OPS) deploy local
	$(DEMO_OPS) restart local --algorithm DDTREE --budget 16 --topk 4 --no-policy
	rm -rf results/demo.jsonl results/demo_plots
	$(DEMO_OPS) bench --sweep bench_configs/demo.yaml --out results/demo.jsonl
	$(DEMO_OPS) report results/demo.jsonl --csv results/demo.csv \
	  --csv-best results/demo_best.csv --plots results/demo_plots/

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis .mypy_cache .ruff_cache
