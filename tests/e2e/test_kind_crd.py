"""The CRD on a real API server (kind): structural schema, CEL rules, scale subresource.

Opt-in: it runs on the session's kind cluster (conftest.py; ``make e2e``) and is skipped with
the reason when kind or a Docker daemon is missing. It needs only the CRD, not the operator:
the jobs it creates live in ``default``, which the e2e operator does not serve. Set
``DDPJOB_E2E_REUSE=1`` (or the older ``DDPJOB_KIND_CLUSTER=NAME``) to reuse an existing cluster.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.harness.kubectl import ROOT, Kube

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(e2e_cluster: Kube) -> Kube:
    kube = e2e_cluster.in_namespace("default")
    kube.kubectl("apply", "-f", str(ROOT / "deploy" / "crd.yaml"))
    kube.kubectl("wait", "--for=condition=Established", "crd/ddpjobs.ddpjob.io", "--timeout=60s")
    return kube


@pytest.mark.parametrize(
    "example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_examples_are_accepted_by_a_real_api_server(cluster: Kube, example: Path) -> None:
    result = cluster.kubectl("apply", "--dry-run=server", "-f", str(example), check=False)
    assert result.returncode == 0, result.stderr


def test_cel_rule_rejects_replicas_outside_bounds(cluster: Kube) -> None:
    document = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    document["spec"]["minReplicas"] = 3
    result = cluster.kubectl(
        "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(document), check=False
    )
    assert result.returncode != 0
    assert "replicas must lie within minReplicas..maxReplicas" in result.stderr


def test_scale_subresource_and_short_name(cluster: Kube) -> None:
    cluster.kubectl("apply", "-f", str(ROOT / "examples" / "quickstart.yaml"))
    try:
        cluster.kubectl("scale", "ddpj/quickstart", "--replicas=3")
        got = cluster.kubectl("get", "ddpj/quickstart", "-o", "jsonpath={.spec.replicas}")
        assert got.stdout == "3"
        too_many = cluster.kubectl("scale", "ddpj/quickstart", "--replicas=4", check=False)
        assert too_many.returncode != 0
    finally:
        cluster.kubectl("delete", "ddpj/quickstart", "--wait=false", check=False)
