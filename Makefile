# The README's commands. Everything runs inside .venv/ at the repository root.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-complete
DEMO_MODEL := .cache/demo-model
VISION_MODEL := .cache/demo-model-vision
HOST ?= 127.0.0.1
PORT ?= 8000
PYTEST_ARGS ?=

# What the engine needs on a machine without a GPU: a KV cache size for the CPU build (GiB),
# no Hugging Face hub access, no usage reporting.
export VLLM_CPU_KVCACHE_SPACE ?= 1
export HF_HUB_OFFLINE ?= 1
export VLLM_NO_USAGE_STATS ?= 1
export DO_NOT_TRACK ?= 1

.PHONY: help setup serve serve-vision serve-stack images test test-unit test-runtime test-operator test-chart bench lint demo-model clean

help:
	@echo "make serve   set up, write the demo model, serve it on http://$(HOST):$(PORT)"
	@echo "make serve-vision   the same with the image+text demo model (send it images)"
	@echo "make serve-stack    the data plane: NATS, two replicas of the demo model, the gateway"
	@echo "make images  build the three images (prints the docker commands where Docker is absent)"
	@echo "make test    set up and run the whole test suite"
	@echo "make bench   run the benchmarks under bench/ (results in bench/RESULTS.md)"
	@echo "make lint    ruff and the import-layering contracts"
	@echo "make setup   create $(VENV)/ with the project, the CPU engine and the test tools"

setup: $(STAMP)

# Re-runs only when the project's dependency list changes.
$(STAMP): pyproject.toml scripts/setup.sh scripts/tools.sh
	PYTHON=$(PYTHON) VENV=$(VENV) bash scripts/setup.sh
	touch $@

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(BIN)/llmendpoints-runtime demo-model $(DEMO_MODEL)

demo-model: $(DEMO_MODEL)/config.json

serve: $(STAMP) $(DEMO_MODEL)/config.json
	@echo "llmendpoints: serving the DEMO model ($(DEMO_MODEL)): its weights are random, so its text is gibberish." \
	      "To serve a real model: MODEL_NAME=<hf-repo-or-path> $(BIN)/llmendpoints-runtime serve"
	MODEL_NAME=$(abspath $(DEMO_MODEL)) OPENAI_SERVED_MODEL_NAME_OVERRIDE=$${OPENAI_SERVED_MODEL_NAME_OVERRIDE:-demo} \
	  MAX_MODEL_LEN=$${MAX_MODEL_LEN:-512} HOST=$(HOST) PORT=$(PORT) \
	  $(BIN)/llmendpoints-runtime serve

$(VISION_MODEL)/config.json: | $(STAMP)
	$(BIN)/llmendpoints-runtime demo-model --vision $(VISION_MODEL)

# The image+text demo model (Idefics3, random weights), served as "demo-vision": up to 4 images
# per prompt (LIMIT_MM_PER_PROMPT). See docs/images.md.
serve-vision: $(STAMP) $(VISION_MODEL)/config.json
	@echo "llmendpoints: serving the VISION DEMO model ($(VISION_MODEL)): random weights, gibberish answers, real image handling."
	MODEL_NAME=$(abspath $(VISION_MODEL)) OPENAI_SERVED_MODEL_NAME_OVERRIDE=$${OPENAI_SERVED_MODEL_NAME_OVERRIDE:-demo-vision} \
	  MAX_MODEL_LEN=$${MAX_MODEL_LEN:-1024} LIMIT_MM_PER_PROMPT=$${LIMIT_MM_PER_PROMPT:-'{"image": 4}'} \
	  HOST=$(HOST) PORT=$(PORT) $(BIN)/llmendpoints-runtime serve

# The whole data plane locally (scripts/serve_stack.py): nats-server, two runtime replicas of the
# demo model sharing its job queue, the gateway with a tenant key. Ctrl-C stops all of it.
serve-stack: $(STAMP) $(DEMO_MODEL)/config.json
	$(BIN)/python scripts/serve_stack.py

# The three images (scripts/images.sh): built (PUSH=1: and pushed) where Docker runs; elsewhere
# the docker commands are printed. REGISTRY=... TAG=... name them.
images:
	bash scripts/images.sh

test: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-unit: $(STAMP)
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

test-runtime: $(STAMP)
	$(BIN)/python -m pytest tests/runtime $(PYTEST_ARGS)

test-operator: $(STAMP)
	$(BIN)/python -m pytest tests/integration $(PYTEST_ARGS)

test-chart: $(STAMP)
	$(BIN)/python -m pytest tests/chart $(PYTEST_ARGS)

bench: $(STAMP) $(DEMO_MODEL)/config.json
	$(BIN)/python bench/run_all.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) .cache .pytest_cache

# Copy crds/ (the source of truth) into the Helm chart; tests/chart checks they are identical.
.PHONY: sync-crds
sync-crds:
	bash scripts/sync_crds.sh
