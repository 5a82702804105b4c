# Everything installs itself into .venv on first use. Needs only python3.11 (with venv) and make.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
EXAMPLE ?= examples/quickstart.yaml

.PHONY: run validate test lint kube kueue kube-up kind kind-up unit test-agent test-operator test-cluster e2e bench crd manifests clean images-offline

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
	mkdir -p .cache && NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir .cache/site

.PHONY: docs docs-reference
docs: $(STAMP)  ## Serve the documentation site (mkdocs.yml, docs/) on http://127.0.0.1:8000
	$(BIN)/mkdocs serve

docs-reference: $(STAMP)  ## Regenerate docs/reference/ddpjob.md from the models (hack/gen_reference.py)
	$(BIN)/python hack/gen_reference.py

test: lint kube kueue  ## Everything that can run here: lint, types, layers, the docs, then every tier (kind e2e skips itself without kind)
	$(BIN)/python -m pytest -q

# The real control plane (tests/harness/kube): etcd, kube-apiserver, kube-controller-manager and
# kube-scheduler built from the Go modules pinned in hack/kube into .cache/kube/<versions>/bin.
# Needs Go (the go line of hack/kube/go.mod) and the Go module proxy; builds only what is missing.
kube: $(STAMP)  ## Build the real control plane's binaries from Go modules (hack/kube)
	$(BIN)/python -m tests.harness.kube build

# Kueue's controller (tests/harness/kueue), built from the Go module pinned in hack/kueue into
# .cache/kueue/<version>-<hash>/bin; tests/cluster runs it against the real control plane.
kueue: $(STAMP)  ## Build Kueue's controller from its Go module (hack/kueue)
	$(BIN)/python -m tests.harness.kueue build

kube-up: kube  ## Start the real control plane with 3 process-kubelet nodes; prints KUBECONFIG=..., Ctrl-C stops it
	$(BIN)/python -m tests.harness.kube up

# One tier at a time (docs/development.md has the tiers); `make test` runs them all.
unit: $(STAMP)  ## The pure core and the fast tests: tests/unit
	$(BIN)/python -m pytest -q tests/unit

test-agent: $(STAMP)  ## ddpjob-agent and ddpjob run with real torch processes: tests/agent
	$(BIN)/python -m pytest -q tests/agent

test-operator: $(STAMP)  ## The operator process on the API emulator (and its real-cluster twins): tests/operator
	$(BIN)/python -m pytest -q tests/operator

test-cluster: kube kueue  ## The real control plane, process kubelets and Kueue: tests/cluster
	$(BIN)/python -m pytest -q tests/cluster

# The kind end-to-end suite (tests/e2e/conftest.py lists every knob). With kind on PATH and a
# running Docker (a laptop): creates the kind cluster ddpjob-e2e from kind's node image, builds
# the operator and worker-cpu images and loads them, helm-installs charts/ddpjob, runs the DDPJob
# scenarios, deletes the cluster. KIND_NODE_IMAGE picks the Kubernetes version, KEEP_CLUSTER=1
# keeps the cluster, DDPJOB_E2E_REUSE=1 runs on an existing one. Without kind (this machine, CI,
# air-gapped): the offline kind of tests/harness/kind (make kind), in a Docker daemon of the harness's
# own, as root; DDPJOB_KIND=offline|upstream chooses. A missing piece fails the run.
E2E_PYTEST_ARGS ?=
e2e:  ## kind end-to-end: cluster, images, Helm chart, recovery/scale/suspend scenario, node faults
	@$(MAKE) --no-print-directory $(STAMP)
	DDPJOB_E2E=1 $(BIN)/python -m pytest -m e2e tests/e2e -v -rs $(E2E_PYTEST_ARGS)

# Everything an offline kind cluster needs, built here with no container registry (tests/harness/kind):
# the kind CLI, kubelet/kubeadm/kubectl/kube-proxy at hack/kube's pin, containerd, runc, crictl,
# the CNI plugins, CoreDNS, pause, the node image and every image baked into it. Needs root, Go,
# and apt-get install docker.io debootstrap libseccomp-dev. Cached in .cache/kind by input hash.
kind: kube  ## Build the offline kind node image and everything in it (tests/harness/kind; root)
	$(BIN)/python -m tests.harness.kind build

kind-up: kind  ## Start an offline kind cluster of 3 nodes; prints KUBECONFIG=..., Ctrl-C deletes it
	$(BIN)/python -m tests.harness.kind up --nodes 3

crd: $(STAMP)  ## Regenerate the CRD copies from the models
	$(BIN)/ddpjob crd > deploy/crd.yaml
	$(BIN)/ddpjob crd > charts/ddpjob/crds/ddpjob.io_ddpjobs.yaml

manifests: $(STAMP)  ## Re-render deploy/ddpjob.yaml from charts/ddpjob (default values, ddpjob-system)
	$(BIN)/python -m tests.harness.tools manifests

bench: $(STAMP)
	$(BIN)/python bench/bench_agent.py

images-offline:  ## operator + worker-cpu images with no registry: debootstrap base, local wheelhouse (root; docs/images.md)
	scripts/images-offline.sh

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
