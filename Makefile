# One-command set-up on a fresh machine: every target bootstraps what it needs.
SHELL := /bin/bash
PY_SYS ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: venv tools system-deps protos protos-check lint-protos test demo bench bench-engine clean

# Debian packages the tests need (a real Redis server); skipped when present.
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else sudo apt-get update -qq && sudo apt-get install -y -qq redis-server; fi; }

$(STAMP): pyproject.toml
	test -x $(PY) || $(PY_SYS) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# NOTE: torch first and pinned: the CPU build comes from local disk.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The buf CLI (proto lint/breaking checks), from npm into .tools/.
BUF := .tools/node_modules/.bin/buf
$(BUF):
	mkdir -p .tools && cd .tools && npm install --silent --no-audit --no-fund @bufbuild/buf@1.75.0

tools: $(BUF)

lint-protos: $(BUF)
	$(BUF) lint

protos: venv
	$(PY) scripts/gen_protos.py

protos-check: venv
	$(PY) scripts/gen_protos.py --check

test: venv tools system-deps
	$(PY) -m pytest -q tests

demo: venv system-deps
	$(VENV)/bin/pdd demo

bench: venv system-deps
	$(VENV)/bin/pdd bench

bench-engine: venv
	$(PY) -m pdd.bench.engine_bench

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
