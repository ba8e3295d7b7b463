# The two commands a fresh machine needs: `make demo` and `make test`.
# Both create (or reuse) .venv in the repo root and install what they need.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTO_SRC := $(shell find protos -name '*.proto' 2>/dev/null)

.PHONY: demo test test-fast lint protos setup system-deps clean wheel-check

setup: $(STAMP)

# torch is installed on its own, pinned, before anything else can ask for a newer
# (CUDA) build; the project's own pins then find it already satisfied. setuptools'
# editable finder prints an information-only note (no warning) for any package-dir
# layout like ours (router/ installs as outrider.router): it is silenced.
$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	PYTHONWARNINGS="ignore:Editable installation" $(PY) -m pip install -q -e '.[all,test,dev]'
	$(PY) -m outrider.engine.kernels  # the CPU attention kernel, built once (~20 s)
	touch $(STAMP)

# Debian packages the system tests start for real (each binary is named as its package),
# and jemalloc, which the router runs on when the system has it (outrider/allocator.py).
SYSTEM_BINARIES := redis-server prometheus chromium
system-deps:
	@missing=""; for b in $(SYSTEM_BINARIES); do command -v $$b >/dev/null || missing="$$missing $$b"; done; \
	ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2' || missing="$$missing libjemalloc2"; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing (apt)"; \
	  install="apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null"; \
	  sh -c "$$install" || sudo sh -c "$$install"; \
	fi

demo: setup
	$(PY) -m outrider.cli demo

# Tests run on TEST_WORKERS pytest-xdist workers (more than the 2 cores of CI: system
# tests spend much of their time waiting on processes they start), a module (or a group
# of modules that must not overlap, tests/conftest.py) to a worker; the ten slowest are
# listed at the end.
TEST_WORKERS ?= 4
test: setup system-deps
	$(PY) -m pytest -q -n $(TEST_WORKERS) --durations=10

# The wheel outside the checkout: built, installed in a fresh venv (torch's CPU wheel
# first), `outrider serve` + `outrider generate` on the demo pair. Needs no .venv.
wheel-check:
	PYTHON=$(PYTHON) .ci/wheel-check

test-fast: setup
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m 'not slow'

lint: setup
	$(VENV)/bin/ruff check outrider draft_worker target_worker router cluster tests scripts

# Stubs land next to the package (protos/outrider/v1/x.proto -> outrider/v1/x_pb2.py),
# so their own `from outrider.v1 import ...` imports resolve; they are committed.
protos: setup
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTO_SRC)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
