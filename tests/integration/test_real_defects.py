"""Issue 14's defects, checked on the real control plane where they can be.

The emulator variants of the executor's defects are in ``test_defects_operator.py`` and the pure
core's in ``tests/unit``; here the real API server, admission plugins, kubelets and garbage
collector decide:

* 2: the Pod Security level ``deploy/`` gives ``ddpjob-system`` admits the pods of a job there,
  and ``restricted`` would refuse them (the Baseline profile);
* 10: a pod deleted while no operator runs, confirmed by its kubelet (whose final delete with
  grace 0 moves ``deletionTimestamp``), counts as ``Deleted``, not charged;
* 11: a job deleted and created again under its name waits for the old pods (``NameInUse``)
  and never adopts or counts them;
* 12: a Service of the job's name that is not the job's is reported, and no pod starts;
* 16: a template change that CEL's map equality would skip (nodeSelector swapped for affinity)
  is refused while the job runs.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kube.fixtures import KubeTest

from .operator_env import RealEnv, real_env, wait_for

pytestmark = pytest.mark.slow
JSON = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def real(kube: KubeTest, tmp_path: Path) -> RealEnv:
    return real_env(kube, tmp_path)


def deploy_namespace_labels() -> dict[str, str]:
    docs = yaml.safe_load_all((ROOT / "deploy" / "ddpjob.yaml").read_text())
    namespace = next(d for d in docs if d and d.get("kind") == "Namespace")
    return dict(namespace["metadata"]["labels"])


def test_pod_security_of_deploys_namespace_admits_the_jobs_pods(real: RealEnv) -> None:
    labels = deploy_namespace_labels()
    admitted = real.add_namespace("deploy-level")
    real.k.api.patch(f"/api/v1/namespaces/{admitted}", {"metadata": {"labels": labels}})
    restricted = real.add_namespace("restricted")
    real.k.api.patch(
        f"/api/v1/namespaces/{restricted}",
        {"metadata": {"labels": {"pod-security.kubernetes.io/enforce": "restricted"}}},
    )
    real.start_operator(namespaces=(admitted, restricted))
    real.create_job("psa", namespace=admitted)
    real.create_job("psa", namespace=restricted)
    wait_for(lambda: len(real.pods("psa", admitted)) == 2, "pods under deploy/'s level", 60)

    def refused() -> list[JSON]:
        return [
            e
            for e in real.events(restricted, "ActionFailed")
            if "violates PodSecurity" in e.get("message", "")
        ]

    wait_for(refused, "the restricted namespace refusing the Baseline pods", 60)
    assert real.pods("psa", restricted) == []


def test_a_pod_deleted_while_no_operator_runs_counts_as_deleted(real: RealEnv) -> None:
    real.start_operator()
    real.create_job("lambda", replicas=2)
    real.run_pods("lambda")
    old = real.pod("lambda-worker-1")
    assert old is not None
    real.stop_operator(signal.SIGKILL)
    assert real.delete_pod("lambda-worker-1") == 200

    def confirmed() -> JSON | None:
        # Stopped by its kubelet, whose own final delete (grace 0) moved deletionTimestamp;
        # our finalizer holds it until an operator counts it.
        pod = real.pod("lambda-worker-1")
        if pod is None or pod["metadata"].get("deletionGracePeriodSeconds") != 0:
            return None
        return pod

    held = wait_for(confirmed, "the kubelet's final delete", timeout=60)
    assert held["metadata"]["finalizers"] == ["ddpjob.io/pod-tracking"]
    real.start_operator()
    new = real.replacement(old, "lambda-worker-1 replaced", timeout=60)
    status = real.status("lambda")
    assert [(f["reason"], f["charged"]) for f in status["failures"]] == [("Deleted", False)]
    assert (status["restarts"], status.get("backoffCount", 0)) == (1, 0)
    assert new["metadata"]["finalizers"] == ["ddpjob.io/pod-tracking"]


def test_a_job_created_again_under_its_name_does_not_adopt_the_old_pods(
    kube: KubeTest, tmp_path: Path
) -> None:
    env = real_env(kube, tmp_path, fake_trainer=False)
    env.start_operator()
    # A trainer that ignores SIGTERM: the old pods stay Terminating for their grace period.
    template = {
        "spec": {
            "terminationGracePeriodSeconds": 8,
            "containers": [
                {
                    "name": "trainer",
                    "image": "busybox",
                    "command": ["sh", "-c", "trap '' TERM; while true; do sleep 0.2; done"],
                }
            ],
        }
    }
    first = env.create_job("gamma", template=template)
    env.run_pods("gamma")
    old = {p["metadata"]["uid"] for p in env.pods("gamma")}
    assert env.delete_job("gamma") == 200
    wait_for(lambda: env.job("gamma") is None, "the first gamma gone", timeout=30)
    second = env.create_job("gamma", template=template)
    assert second["metadata"]["uid"] != first["metadata"]["uid"]
    status = wait_for(
        lambda: env.status("gamma").get("waiting") and env.status("gamma"), "status", timeout=30
    )
    assert {w["reason"] for w in status["waiting"]} == {"NameInUse"}
    assert {p["metadata"]["uid"] for p in env.pods("gamma")} <= old

    def own_pods() -> list[JSON] | None:
        pods = env.pods("gamma")
        mine = [
            p
            for p in pods
            if p["metadata"]["ownerReferences"][0]["uid"] == second["metadata"]["uid"]
        ]
        return mine if len(pods) == len(mine) == 2 else None

    wait_for(own_pods, "the new gamma's own pods, once the old ones are gone", timeout=60)
    status = env.status("gamma")
    assert (status.get("restarts", 0), status.get("backoffCount", 0)) == (0, 0)
    assert status.get("failures", []) == []


def test_a_service_of_the_jobs_name_that_is_not_its_own_is_reported(real: RealEnv) -> None:
    real.start_operator()
    other = {
        "metadata": {"name": "delta"},
        "spec": {"selector": {"app": "something-else"}, "ports": [{"port": 80}]},
    }
    real.k.api.create(f"/api/v1/namespaces/{real.namespace}/services", other)
    real.create_job("delta")
    events = wait_for(lambda: real.events(reason="ActionFailed"), "an ActionFailed event", 30)
    message = events[0]["message"]
    assert f"Service {real.namespace}/delta exists and is not DDPJob" in message, message
    time.sleep(2)
    assert real.pods("delta") == []


def test_a_template_change_that_cel_map_equality_would_skip_is_refused(real: RealEnv) -> None:
    template = real.manifest("eta", real.namespace)["spec"]["template"]
    template["spec"]["nodeSelector"] = {"kubernetes.io/os": "linux"}
    real.fake_trainer = False
    real.create_job("eta", template=template)
    real.fake_trainer = True
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "kubernetes.io/os", "operator": "In", "values": ["linux"]}
                        ]
                    }
                ]
            }
        }
    }
    swap = {"spec": {"template": {"spec": {"nodeSelector": None, "affinity": affinity}}}}
    response = real.try_patch_job("eta", swap)
    assert response.status_code == 422, response.text
    assert "spec.template cannot change while the job runs" in response.json()["message"]
