# Everything installs itself into .venv on first use. Needs only python3.11 (with venv) and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXAMPLE ?= examples/quickstart.yaml

.PHONY: run validate test lint kube kube-up unit integration e2e bench crd manifests clean images-offline

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[local,dev]'
	touch $(STAMP)

run: $(STAMP)  ## Run the example DDPJob on this machine
	$(BIN)/ddpjob run $(EXAMPLE)

validate: $(STAMP)
	$(BIN)/ddpjob validate examples/*.yaml

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

test: lint kube  ## Everything that can run here: lint, types, layers, unit, integration on the emulator and on the real control plane (kind e2e skips itself without kind)
	$(BIN)/python -m pytest -q

# The real control plane (tests/kube): etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler built from the Go modules pinned in hack/kube into .cache/kube/<versions>/bin.
# Needs Go (the go line of hack/kube/go.mod) and the Go module proxy; builds only what is missing.
kube: $(STAMP)  ## Build the real control plane's binaries from Go modules (hack/kube)
	$(BIN)/python -m tests.kube build

kube-up: kube  ## Start the real control plane with 3 process-kubelet nodes; prints KUBECONFIG=..., Ctrl-C stops it
	$(BIN)/python -m tests.kube up

unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# The kind end-to-end suite (tests/e2e/conftest.py lists every knob): creates the kind cluster
# ddpjob-e2e, builds the operator and worker-cpu images and loads them into it, helm-installs
# charts/ddpjob, runs the DDPJob scenarios, deletes the cluster. KIND_NODE_IMAGE picks the
# Kubernetes version, KEEP_CLUSTER=1 keeps the cluster, DDPJOB_E2E_REUSE=1 runs on an existing one.
# DDPJOB_E2E=1: a missing kind or Docker fails the run instead of skipping it.
E2E_PYTEST_ARGS ?=
e2e:  ## kind end-to-end: cluster, images, Helm chart, recovery/scale/suspend scenario (needs Docker + kind)
	@command -v kind >/dev/null 2>&1 || { echo "make e2e: kind is not on PATH; install it: https://kind.sigs.k8s.io/docs/user/quick-start/#installation" >&2; exit 1; }
	@docker info >/dev/null 2>&1 || { echo "make e2e: the Docker daemon does not answer (docker info failed); kind needs a running Docker" >&2; exit 1; }
	@$(MAKE) --no-print-directory $(STAMP)
	DDPJOB_E2E=1 $(BIN)/python -m pytest -m e2e tests/e2e -v -rs $(E2E_PYTEST_ARGS)

crd: $(STAMP)  ## Regenerate the CRD copies from the models
	$(BIN)/ddpjob crd > deploy/crd.yaml
	$(BIN)/ddpjob crd > charts/ddpjob/crds/ddpjob.io_ddpjobs.yaml

manifests: $(STAMP)  ## Re-render deploy/ddpjob.yaml from charts/ddpjob (default values, ddpjob-system)
	$(BIN)/python -m tests.tools manifests

bench: $(STAMP)
	$(BIN)/python bench/bench_agent.py

images-offline:  ## operator + worker-cpu images with no registry: debootstrap base, local wheelhouse (root; docs/images.md)
	scripts/images-offline.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
