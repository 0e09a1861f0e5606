# Quick start: `make demo` (the main job on the local simulated fleet) and `make test`.
# Both set themselves up: a .venv with the CPU build of torch (pinned first, so that no
# dependency pulls a multi-GB CUDA build) and this package with its test extra.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_PIN := torch==2.13.0
# The real SGLang 0.5.23 wheel, downloaded once; the test fleet installs it into each host.
WHEELS := .cache/wheels

.PHONY: venv test demo clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	mkdir -p $(WHEELS)
	ls $(WHEELS)/sglang-0.5.23-*.whl >/dev/null 2>&1 || $(PY) -m pip download -q --no-deps sglang==0.5.23 -d $(WHEELS)
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	DDTREE_OPS_WHEELS=$(abspath $(WHEELS)) $(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(VENV)/bin/ddtree-ops -i inventories/local.yaml doctor all

clean:
	rm -rf $(VENV) .cache .pytest_cache .hypothesis
