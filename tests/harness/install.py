"""The chart installed on the real control plane, as the e2e suite and the recovery benchmark
use it: the operator's Deployment on a process kubelet, serving one namespace."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.harness.kube.controlplane import free_port
from tests.harness.kubectl import ROOT, Installed, Kube

TEST_NAMESPACE = "ddpjob-e2e"


CHART = ROOT / "charts" / "ddpjob"


REAL_RELEASE = "ddpjob-e2e"


REAL_OPERATOR_NAMESPACE = "ddpjob-e2e-system"
"""On the shared real control plane ``ddpjob-system`` holds the RBAC the other tests use."""


REAL_OPERATOR_IMAGE = "ghcr.io/ddpjob/ddpjob-operator"


REAL_WORKER_IMAGE = "ghcr.io/ddpjob/ddpjob-worker-cpu:0.1.0"
"""Images the process kubelet knows (tests/harness/kube/runtime.py): the dev venv's programs."""


def artifacts_dir() -> Path:
    path = Path(os.environ.get("DDPJOB_E2E_ARTIFACTS") or ROOT / ".cache" / "e2e-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def install_on_real(kube: Kube) -> Installed:
    """The chart (namespaced, serving ``ddpjob-e2e``) on the real control plane."""
    for namespace in (TEST_NAMESPACE, REAL_OPERATOR_NAMESPACE):
        manifest = kube.kubectl(
            "create", "namespace", namespace, "--dry-run=client", "-o", "yaml"
        ).stdout
        kube.kubectl("apply", "-f", "-", stdin=manifest)
    # Pods share this machine's ports (tests/harness/kube/runtime.py): no fixed 8080/8081.
    values = {
        "image": {"repository": REAL_OPERATOR_IMAGE},
        "watchNamespaces": [TEST_NAMESPACE],
        "metrics": {"port": free_port()},
        "health": {"port": free_port()},
    }
    values_file = artifacts_dir() / "helm-values-real.json"
    values_file.write_text(json.dumps(values))
    kube.helm(
        "upgrade", "--install", REAL_RELEASE, str(CHART),
        "--namespace", REAL_OPERATOR_NAMESPACE,
        "--values", str(values_file), "--wait", "--timeout", "5m",
    )  # fmt: skip
    # helm 4's --wait can return before the pod is Ready: wait for the rollout itself.
    kube.in_namespace(REAL_OPERATOR_NAMESPACE).kubectl(
        "rollout", "status", f"deployment/{REAL_RELEASE}", "--timeout=300s", timeout=330
    )
    return Installed(
        kube.in_namespace(TEST_NAMESPACE), REAL_OPERATOR_IMAGE, REAL_WORKER_IMAGE, REAL_RELEASE,
        REAL_OPERATOR_NAMESPACE,
    )  # fmt: skip
