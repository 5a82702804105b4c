"""The CRD on a real API server (kind): structural schema, CEL rules, scale subresource.

Opt-in: it runs wherever `docker`, `kind` and `kubectl` are on PATH and Docker answers, and is
skipped with the reason otherwise (this repo's CI machine has no Docker engine or kind).
Set DDPJOB_KIND_CLUSTER to reuse an existing kind cluster instead of creating one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ("docker", "kind", "kubectl")


def _skip_reason() -> str | None:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        return f"needs {', '.join(missing)} on PATH for a kind cluster"
    info = subprocess.run(["docker", "info"], capture_output=True, check=False, timeout=30)
    if info.returncode != 0:
        return "the Docker engine does not answer (`docker info` failed)"
    return None


REASON = _skip_reason()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


def kubectl(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["kubectl", *args], input=stdin, capture_output=True, text=True, check=False, timeout=120
    )


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    name = os.environ.get("DDPJOB_KIND_CLUSTER")
    created = name is None
    name = name or "ddpjob-e2e"
    if created:
        subprocess.run(["kind", "create", "cluster", "--name", name, "--wait", "120s"], check=True)
    subprocess.run(["kubectl", "config", "use-context", f"kind-{name}"], check=True)
    applied = kubectl("apply", "-f", str(ROOT / "deploy" / "crd.yaml"))
    assert applied.returncode == 0, applied.stderr
    established = kubectl(
        "wait", "--for=condition=Established", "crd/ddpjobs.ddpjob.io", "--timeout=60s"
    )
    assert established.returncode == 0, established.stderr
    yield name
    if created:
        subprocess.run(["kind", "delete", "cluster", "--name", name], check=False)


@pytest.mark.parametrize(
    "example", sorted((ROOT / "examples").glob("*.yaml")), ids=lambda p: p.name
)
def test_examples_are_accepted_by_a_real_api_server(cluster: str, example: Path) -> None:
    result = kubectl("apply", "--dry-run=server", "-f", str(example))
    assert result.returncode == 0, result.stderr


def test_cel_rule_rejects_replicas_outside_bounds(cluster: str) -> None:
    document = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    document["spec"]["minReplicas"] = 3
    result = kubectl("apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(document))
    assert result.returncode != 0
    assert "replicas must lie within minReplicas..maxReplicas" in result.stderr


def test_scale_subresource_and_short_name(cluster: str) -> None:
    created = kubectl("apply", "-f", str(ROOT / "examples" / "quickstart.yaml"))
    assert created.returncode == 0, created.stderr
    try:
        scaled = kubectl("scale", "ddpj/quickstart", "--replicas=3")
        assert scaled.returncode == 0, scaled.stderr
        got = kubectl("get", "ddpj/quickstart", "-o", "jsonpath={.spec.replicas}")
        assert got.stdout == "3"
        too_many = kubectl("scale", "ddpj/quickstart", "--replicas=4")
        assert too_many.returncode != 0
    finally:
        kubectl("delete", "ddpj/quickstart", "--wait=false")
