# Tessera's build and test entry points. README.md names two of them for a fresh machine, `make demo`
# and `make test`, and the lanes beside `make test`: `make check` and `make fuzz`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo simulate test check fuzz test-deps lint native proto k8s-binaries k8s-binaries-pinned k8s-binaries-dra \
	prometheus-binaries sandbox-deps images clean

# A virtual environment with the project and its test tools, rebuilt when pyproject.toml changes.
# The product and, beside it, the tools (tools/pyproject.toml: simulator, sandbox, fake GPU).
$(STAMP): pyproject.toml tools/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]' -e './tools[simulate,sandbox]'
	touch $@

native: $(STAMP)
	$(MAKE) -C hook PYTHON=$(abspath $(BIN)/python)
	$(MAKE) -C tools/fakegpu PYTHON=$(abspath $(BIN)/python)

# Regenerate the gRPC stubs under proto/ from the .proto files (tests fail when they are stale).
proto: $(STAMP)
	$(MAKE) -C proto PYTHON=$(abspath $(BIN)/python)

# Two Kubernetes versions: the pinned one, and the newest, which the DRA path needs (docs/dra.md);
# its version is tools/sandbox/controlplane.py's DRA_K8S_VERSION. The script also builds containerd 2
# (CDI) once for the DRA sandbox and links it into each version's bin dir.
DRA_K8S_VERSION := $(shell sed -nE 's/^DRA_K8S_VERSION = "(v[0-9.]+)"$$/\1/p' tools/sandbox/controlplane.py)

k8s-binaries: k8s-binaries-pinned k8s-binaries-dra

k8s-binaries-pinned:
	hack/k8s-binaries.sh

k8s-binaries-dra:
	K8S_VERSION=$(DRA_K8S_VERSION) hack/k8s-binaries.sh

# Prometheus and promtool with Kubernetes discovery, from Go modules.
prometheus-binaries:
	hack/prometheus-binaries.sh

# containerd, runc and CNI plugins from Debian for the sandbox (root; installs only what is missing).
sandbox-deps:
	hack/install-sandbox-deps.sh

# The product image (Dockerfile), the chart's kube-scheduler image and the example workload image,
# built with buildah, no Docker daemon (root); OCI archives under build/images/ for `skopeo copy`
# (docs/install.md), which the sandbox imports and installs with the chart. Incremental.
images: $(STAMP) sandbox-deps k8s-binaries-pinned
	hack/build-images.sh

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Everything the tests need, three steps at a time: the Python packages, the Debian packages and the
# base image download while Go compiles (docs/benchmarks.md, "make test").
test-deps: $(STAMP) native k8s-binaries prometheus-binaries sandbox-deps images lint

test:
	$(MAKE) --jobs=3 test-deps
	hack/run-tests.sh $(DRA_K8S_VERSION)

# The developer's lane while editing: every test that needs no root, no Kubernetes binaries, no images,
# no valgrind and no Prometheus (pyproject.toml's markers), the fuzzers at 100 inputs per target; not
# the tests that must run alone (`make test` runs them).
# Four worker processes on any machine: most of these tests wait on processes and timers, not a CPU;
# a module stays on one worker (its fixtures are built once). PYTEST_ARGS narrows it (a directory, -k).
CHECK_MARKERS := not sandbox and not k8s and not images and not valgrind and not prometheus and not alone
CHECK_WORKERS ?= 4
check: $(STAMP) native
	TESSERA_FUZZ_EXAMPLES=$${TESSERA_FUZZ_EXAMPLES:-100} $(BIN)/pytest -m "$(CHECK_MARKERS)" \
	  --numprocesses=$(CHECK_WORKERS) --dist=loadfile $(PYTEST_ARGS)

# The fuzzers' full run: 10,000 inputs per Hypothesis target (`make test` runs 1,000 from a new seed
# each run: tests/fuzzing.py), and the hook's libFuzzer targets.
fuzz: $(STAMP) native
	TESSERA_FUZZ_EXAMPLES=$${TESSERA_FUZZ_EXAMPLES:-10000} $(BIN)/pytest tests/fuzz tests/hook/test_fuzz.py

# The main job: the whole path on a local sandbox cluster (root) with Tessera installed by its Helm
# chart from the images built here: pods share a fake GPU, quotas hold.
demo: $(STAMP) native k8s-binaries-pinned sandbox-deps images
	$(BIN)/tessera sandbox demo

# The quick look that needs no root and no cluster: placement policies compared on a replayed fleet.
simulate: $(STAMP)
	$(BIN)/tessera simulate

clean:
	rm -rf $(VENV) hook/build tools/fakegpu/build build/images
