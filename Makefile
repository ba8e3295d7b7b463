# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create (or reuse) .venv in the repo root and install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(shell find protos -name '*.proto' 2>/dev/null)

.PHONY: demo test test-fast lint protos setup redis clean

setup: $(STAMP)

# torch is installed on its own, pinned, before anything else can ask for a newer
# (CUDA) build; the project's own pins then find it already satisfied.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,dev]'
	touch $(STAMP)

redis:
	@command -v redis-server >/dev/null || { \
	  echo "installing redis-server (apt)"; \
	  (apt-get update -qq && apt-get install -y -qq redis-server >/dev/null) \
	  || sudo sh -c 'apt-get update -qq && apt-get install -y -qq redis-server >/dev/null'; }

demo: setup
	$(PY) -m outrider.cli demo

test: setup redis
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m 'not slow'

lint: setup
	$(VENV)/bin/ruff check outrider draft_worker target_worker router cluster tests scripts

# Stubs land next to the package (protos/outrider/v1/x.proto -> outrider/v1/x_pb2.py),
# so their own `from outrider.v1 import ...` imports resolve; they are committed.
protos: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
