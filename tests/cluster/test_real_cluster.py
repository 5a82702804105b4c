"""ddpjob on the real control plane: what only a real cluster can check.

The CRD as the real API server takes it (structural schema, CEL cost estimation, the rules
themselves, printer columns, the scale subresource), real ``kubectl`` and ``helm``, the
operator's own Deployment running through a process kubelet with a projected service-account
token, the chart's RBAC enforced by the server, the real garbage collector, a real node loss
handled by the real node lifecycle and taint eviction controllers, and the operator SIGKILLed
in the middle of a scale-up. The scenarios shared with the emulator are in
``test_operator.py`` (their ``[real]`` variants).
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import tools
from tests.harness.kube.fixtures import OPERATOR_ACCOUNT, OPERATOR_NAMESPACE, KubeTest
from tests.harness.operator_env import RealEnv, free_port, real_env, wait_for

pytestmark = pytest.mark.slow
JSON = dict[str, Any]
ROOT = Path(__file__).resolve().parents[2]
CRD_COPY = ROOT / "charts" / "ddpjob" / "crds" / "ddpjob.io_ddpjobs.yaml"
OPERATOR_USER = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"


@pytest.fixture
def real(kube: KubeTest, tmp_path: Path) -> RealEnv:
    return real_env(kube, tmp_path)


def one_pod_per_node(job: str) -> JSON:
    """Pod anti-affinity: losing a node loses one pod of the job."""
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"ddpjob.io/job-name": job}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }


def counts(env: RealEnv, name: str) -> tuple[int, int]:
    status = env.status(name)
    return status.get("restarts", 0), status.get("backoffCount", 0)


def live(env: RealEnv, job: str) -> list[JSON]:
    return [p for p in env.pods(job) if not p["metadata"].get("deletionTimestamp")]


# ---- the CRD ---------------------------------------------------------------------------------


def test_the_crd_is_established_and_the_charts_copy_is_accepted(kube: KubeTest) -> None:
    crd = kube.get("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/ddpjobs.ddpjob.io")
    assert crd is not None
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    # The chart's copy, through the server's full validation (CEL cost estimation included).
    result = kube.kubectl("apply", "--dry-run=server", "-f", str(CRD_COPY))
    assert "ddpjobs.ddpjob.io" in result.stdout


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"replicas": 2, "minReplicas": 3}, "replicas must lie within minReplicas..maxReplicas"),
        ({"replicas": 5, "maxReplicas": 4}, "replicas must lie within minReplicas..maxReplicas"),
        ({"replicas": 0}, "spec.replicas"),
        ({"backoffLimit": -2}, "spec.backoffLimit"),
        ({"maxRestarts": -1}, "spec.maxRestarts"),
        ({"nprocPerNode": 0}, "spec.nprocPerNode"),
        ({"nprocPerNode": "gpu"}, "spec.nprocPerNode"),
        ({"restartPolicy": "Always"}, "spec.restartPolicy"),
        ({"rendezvous": {"port": 70000}}, "spec.rendezvous.port"),
        ({"podBackoff": {"initialDelaySeconds": -1}}, "spec.podBackoff.initialDelaySeconds"),
        (
            {"podBackoff": {"initialDelaySeconds": 30, "maxDelaySeconds": 20}},
            "spec.podBackoff.maxDelaySeconds",
        ),
        ({"podBackoff": {"initialDelaySeconds": 400}}, "raise maxDelaySeconds"),
        ({"template": {"spec": {"containers": []}}}, "spec.template.spec.containers"),
        ({"template": {"spec": {"containers": [{"name": "t"}]}}}, "image"),
        ({"gangScheduling": "Volcano"}, "spec.gangScheduling"),
        (
            {
                "gangScheduling": "Native",
                "template": {
                    "spec": {
                        "schedulingGroup": {"podGroupName": "mine"},
                        "containers": [{"name": "t", "image": "i"}],
                    }
                },
            },
            "spec.gangScheduling: Invalid value: gangScheduling: Native makes the "
            "job's own PodGroup: remove template.spec.schedulingGroup",
        ),
    ],
)
def test_invalid_specs_are_refused_by_the_server_naming_the_field(
    real: RealEnv, spec: JSON, field: str
) -> None:
    manifest = real.manifest("bad", real.namespace)
    manifest["spec"].update(spec)
    response = real.create_raw(manifest)
    assert response.status_code == 422, response.text
    assert field in response.json()["message"], response.json()["message"]


def test_fields_baked_into_pods_change_only_while_suspended(real: RealEnv) -> None:
    real.create_job("frozen")
    refused = real.try_patch_job("frozen", {"spec": {"maxRestarts": 9}})
    assert refused.status_code == 422, refused.text
    assert "spec.maxRestarts cannot change while the job runs" in refused.json()["message"]
    refused = real.try_patch_job("frozen", {"spec": {"gangScheduling": "Native"}})
    assert refused.status_code == 422, refused.text
    assert "spec.gangScheduling cannot change while the job runs" in refused.json()["message"]
    # A group of the user's own cannot be swapped under running pods either (the template).
    refused = real.try_patch_job(
        "frozen", {"spec": {"template": {"spec": {"schedulingGroup": {"podGroupName": "b"}}}}}
    )
    assert refused.status_code == 422, refused.text
    real.patch_job("frozen", {"spec": {"maxRestarts": 9, "suspend": True}})
    real.patch_job("frozen", {"spec": {"replicas": 3}})


# ---- kubectl and helm ------------------------------------------------------------------------


def test_kubectl_apply_get_scale_and_describe(real: RealEnv) -> None:
    real.start_operator()
    manifest = real.manifest("kubectl-job", real.namespace)
    real.k.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(manifest))
    # Running needs only minReplicas (1) pods; the table is read once both are ready.
    wait_for(lambda: real.status("kubectl-job").get("readyReplicas") == 2, "2 ready", timeout=60)
    table = real.k.kubectl("get", "ddpj").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "REPLICAS", "READY", "WORLD", "RESTARTS", "AGE"]
    assert table[1].split()[:6] == ["kubectl-job", "Running", "2", "2", "-", "0"] or table[
        1
    ].split()[:4] == ["kubectl-job", "Running", "2", "2"]
    real.k.kubectl("scale", "ddpj/kubectl-job", "--replicas=3")
    wait_for(lambda: len(live(real, "kubectl-job")) == 3, "3 pods after kubectl scale", timeout=60)
    scale = real.k.get(
        f"/apis/ddpjob.io/v1alpha1/namespaces/{real.namespace}/ddpjobs/kubectl-job/scale"
    )
    assert scale is not None and scale["spec"]["replicas"] == 3
    assert scale["status"]["selector"] == "ddpjob.io/job-name=kubectl-job"
    wait_for(
        lambda: "CreatedPods" in real.k.kubectl("describe", "ddpj", "kubectl-job").stdout,
        "the operator's Events in kubectl describe",
    )
    described = real.k.kubectl("describe", "ddpj", "kubectl-job").stdout
    assert "Events:" in described and "ddpjob-operator" in described
    refused = real.k.kubectl("scale", "ddpj/kubectl-job", "--replicas=9", check=False)
    assert refused.returncode != 0
    assert "replicas must lie within minReplicas..maxReplicas" in refused.stderr


@pytest.fixture
def helm_release(kube: KubeTest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """charts/ddpjob installed with real helm: namespaced, serving the test's namespace."""
    release = f"r{kube.namespace[-6:]}"
    system = kube.namespace[:50] + "-sys"
    kube.create_namespace(system)
    kube.namespaces.append(system)
    values = {
        "watchNamespaces": [kube.namespace],
        "metrics": {"port": free_port()},
        "health": {"port": free_port()},
        "livenessProbe": {"initialDelaySeconds": 5, "periodSeconds": 5},
    }
    values_file = tmp_path / "values.json"
    values_file.write_text(json.dumps(values))
    env_kubeconfig = str(kube.cluster.kubeconfig)
    helm = tools.helm(
        "install", release, str(tools.CHART), "--namespace", system, "--values", str(values_file),
        "--kubeconfig", env_kubeconfig, "--wait", "--timeout", "120s", check=False,
    )  # fmt: skip
    assert helm.returncode == 0, helm.stderr + helm.stdout
    try:
        yield release, system
    finally:
        tools.helm("uninstall", release, "--namespace", system, "--kubeconfig", env_kubeconfig,
                   check=False)  # fmt: skip


def test_helm_install_runs_the_operator_pod_with_its_service_account(
    real: RealEnv, helm_release: tuple[str, str]
) -> None:
    release, system = helm_release
    kube = real.k

    def ready_operator() -> JSON | None:
        pods = kube.get(f"/api/v1/namespaces/{system}/pods") or {}
        for pod in pods.get("items") or []:
            conditions = {c["type"]: c["status"] for c in pod["status"].get("conditions") or []}
            if conditions.get("Ready") == "True":
                return dict(pod)
        return None

    operator = wait_for(ready_operator, "the operator pod Ready", timeout=120)
    assert operator["metadata"]["name"].startswith(release)
    assert operator["status"]["phase"] == "Running", operator["status"]
    ready = {c["type"]: c["status"] for c in operator["status"]["conditions"]}["Ready"]
    assert ready == "True", operator["status"]
    volumes = {v["name"] for v in operator["spec"]["volumes"]}
    assert any(v.startswith("kube-api-access-") for v in volumes), volumes
    real.create_job("helmed")
    wait_for(lambda: len(real.pods("helmed")) == 2, "pods made by the in-cluster operator", 60)
    account = operator["spec"]["serviceAccountName"]
    user = f"system:serviceaccount:{system}:{account}"
    creators = {
        (e.get("user") or {}).get("username")
        for e in kube.cluster.audit(since=kube.audit_offset)
        if e.get("verb") == "create"
        and (e.get("objectRef") or {}).get("resource") == "pods"
        and not (e.get("objectRef") or {}).get("subresource")  # the scheduler's bindings
        and (e.get("objectRef") or {}).get("namespace") == real.namespace
    }
    assert creators == {user}
    denied = [
        e
        for e in kube.cluster.audit(since=kube.audit_offset)
        if (e.get("user") or {}).get("username") == user
        and (e.get("responseStatus") or {}).get("code") == 403
    ]
    assert denied == [], [(e["verb"], e.get("objectRef")) for e in denied]


# ---- the operator on the real server ---------------------------------------------------------


def test_the_charts_rbac_is_all_the_operator_needs(real: RealEnv) -> None:
    """A whole lifecycle with every option on; the server answers no request of the operator
    with 403 (the chart grants cluster-wide, with NetworkPolicies and peering)."""
    real.create_peering("ddpjob")
    real.start_operator("--peering", "ddpjob", "--network-policy")
    real.create_job("chi", ttlSecondsAfterFinished=1)
    real.run_pods("chi")
    real.finish_pod("chi-worker-1", exit_code=1)
    wait_for(lambda: counts(real, "chi") == (1, 1), "failure counted", timeout=30)
    real.scale("chi", 3)
    wait_for(lambda: len(live(real, "chi")) == 3, "scaled up", timeout=30)
    real.run_pods("chi")
    for pod in live(real, "chi"):
        real.finish_pod(pod["metadata"]["name"], exit_code=0, reason="Completed")
    wait_for(lambda: real.job("chi") is None, "the job TTL-deleted", timeout=60)
    mine = [
        e
        for e in real.k.cluster.audit(since=real.k.audit_offset)
        if (e.get("user") or {}).get("username") == OPERATOR_USER
    ]
    assert mine, "no request of the operator in the audit log"
    denied = [
        (e["verb"], e.get("objectRef"), e.get("responseStatus"))
        for e in mine
        if (e.get("responseStatus") or {}).get("code") == 403
    ]
    assert denied == []


def test_deleting_the_job_leaves_no_pod_service_secret_or_network_policy(real: RealEnv) -> None:
    real.start_operator()
    real.create_job("gone", networkPolicy=True)
    real.run_pods("gone")
    wait_for(
        lambda: real.get_object(
            "networking.k8s.io/v1/networkpolicies", real.namespace, "gone-ddpjob"
        ),
        "the NetworkPolicy",
    )
    assert real.get_object("v1/services", real.namespace, "gone") is not None
    assert real.get_object("v1/secrets", real.namespace, "gone-store-key") is not None
    assert real.delete_job("gone") == 200

    def everything_gone() -> bool:
        return (
            real.pods("gone") == []
            and real.get_object("v1/services", real.namespace, "gone") is None
            and real.get_object("v1/secrets", real.namespace, "gone-store-key") is None
            and real.get_object(
                "networking.k8s.io/v1/networkpolicies", real.namespace, "gone-ddpjob"
            )
            is None
            and real.job("gone") is None
        )

    wait_for(everything_gone, "the GC to remove pods, Service, Secret, NetworkPolicy", 60)


KILL_JUMPS = (24, 64)
"""The scale-ups the SIGKILL test tries, from 2 pods: 22, then 40 pods to create, more than the
operator has in flight at once (16, ``controller.CONCURRENCY``), so the creations of one pass
take several rounds of API calls and a kill at the first new pod leaves some uncreated."""


def scale_and_kill_at_first_new_pod(real: RealEnv, job: str, replicas: int) -> set[str]:
    """Scale ``job`` to ``replicas`` and SIGKILL the operator the moment a watch on the job's
    pods shows a pod that did not exist before. Returns the pods the watch had seen by then."""
    process = real.process
    assert process is not None and process.poll() is None, "the operator is not running"
    api = real.k.api
    path = f"/api/v1/namespaces/{real.namespace}/pods"
    selector = f"ddpjob.io/job-name={job}"
    listed = api.get(path, labelSelector=selector)
    before = {p["metadata"]["name"] for p in listed.get("items") or []}
    seen = set(before)
    query = {
        "labelSelector": selector,
        "watch": "1",
        "resourceVersion": listed["metadata"]["resourceVersion"],
        "timeoutSeconds": "60",
    }
    deadline = time.monotonic() + 60
    with api.session.get(
        api.endpoint.server + path, params=query, stream=True, timeout=(10, 60)
    ) as response:
        assert response.status_code == 200, response.text
        real.scale(job, replicas)  # the watch is open: the first new pod cannot be missed
        for line in response.iter_lines():
            if not line:
                continue
            event = json.loads(line)
            assert event["type"] != "ERROR", event
            name = event["object"]["metadata"]["name"]
            if event["type"] == "ADDED":
                seen.add(name)
                if name not in before:
                    process.kill()
                    return seen
            if time.monotonic() > deadline:
                break
    pytest.fail(f"no new pod within 60 s of scaling {job} to {replicas}; pods: {sorted(seen)}")


def settled_pods(real: RealEnv, job: str) -> dict[str, str]:
    """The job's pods, name -> uid, once two listings half a second apart agree (the requests
    a SIGKILLed operator had in flight have landed)."""
    listings: list[dict[str, str]] = []

    def settled() -> dict[str, str] | None:
        time.sleep(0.5)
        listings.append({p["metadata"]["name"]: p["metadata"]["uid"] for p in real.pods(job)})
        return listings[-1] if len(listings) > 1 and listings[-1] == listings[-2] else None

    return wait_for(settled, f"the pods of {job} to stop changing", timeout=30)


def kill_during_scale_up(
    real: RealEnv, job: str, replicas: int
) -> tuple[dict[str, str], dict[str, str]]:
    """Scale ``job`` up to ``replicas``, SIGKILL the operator at the first new pod; the job's
    pods (name -> uid) before the scale and once what was in flight has landed."""
    before = {p["metadata"]["name"]: p["metadata"]["uid"] for p in live(real, job)}
    seen = scale_and_kill_at_first_new_pod(real, job, replicas)
    assert real.stop_operator(signal.SIGKILL) == -signal.SIGKILL
    assert len(seen) > len(before), seen
    after = settled_pods(real, job)
    assert {n: after.get(n) for n in before} == before, "a pod of before the scale went"
    wanted = {f"{job}-worker-{i}" for i in range(len(before), replicas)}
    assert set(after) - set(before) <= wanted, sorted(after)
    wait_for(
        lambda: once_each(real, after),
        "one creation per pod in the audit log (none twice) before the restart",
        timeout=10,
    )
    return before, after


def once_each(real: RealEnv, pods: dict[str, str]) -> bool:
    """Every pod in ``pods`` was created by exactly one request in the audit log: answered
    201, or cut short by the SIGKILL (504, logged though the server stored the pod). No name
    was answered 201 twice."""
    answers = real.pod_create_answers()
    if any(codes.count(201) > 1 for codes in answers.values()):
        return False
    return all(
        sum(1 for code in answers.get(name, []) if code == 201 or code >= 500) == 1 for name in pods
    )


def all_running(real: RealEnv, job: str, replicas: int) -> None:
    """``replicas`` live pods, all running and ready, and the job's status says so."""
    wait_for(lambda: len(live(real, job)) == replicas, f"{replicas} pods", timeout=60)
    real.run_pods(job, timeout=120)
    wait_for(
        lambda: real.status(job).get("readyReplicas") == replicas, f"{replicas} ready", timeout=60
    )


def test_the_operator_sigkilled_mid_scale_makes_no_duplicate_and_counts_exactly(
    real: RealEnv,
) -> None:
    """The operator SIGKILLed while it creates the pods of a scale-up, then restarted.

    A watch on the job's pods kills it as the first new pod appears. Once the requests it had
    in flight have landed, some of the new pods must exist and not all: the kill landed
    mid-scale (if the operator had made them all first, the test lets the restarted operator
    settle and tries a bigger jump, and fails if no kill landed mid-scale; it never passes
    without one). The restarted operator must then make exactly the missing pods: every name
    once, every pod the killed one made kept (same uid), one creation per pod in the API
    server's audit log, and the job's counts exact."""
    real.start_operator()
    real.create_job("kappa", replicas=2, maxReplicas=KILL_JUMPS[-1])
    real.run_pods("kappa")
    tried: list[str] = []
    kept: dict[str, str] = {}
    target = 0
    for target in KILL_JUMPS:
        before, at_kill = kill_during_scale_up(real, "kappa", target)
        made = len(set(at_kill) - set(before))
        tried.append(f"{len(before)} -> {target}: {made} of {target - len(before)} new pods made")
        real.start_operator()
        if 0 < made < target - len(before):
            kept = at_kill
            break
        # The operator made every pod before the kill landed: settle, try a bigger jump.
        all_running(real, "kappa", target)
    assert kept, "the SIGKILL never landed mid-scale:\n" + "\n".join(tried)
    print("; ".join(tried))

    all_running(real, "kappa", target)
    time.sleep(2)  # a duplicate creation or a replacement would show by now
    pods = real.pods("kappa")
    names = sorted(p["metadata"]["name"] for p in pods)
    uids = [p["metadata"]["uid"] for p in pods]
    assert names == sorted(f"kappa-worker-{i}" for i in range(target))
    assert len(set(uids)) == len(uids) == target
    now = {p["metadata"]["name"]: p["metadata"]["uid"] for p in pods}
    assert {n: now.get(n) for n in kept} == kept, "a pod the killed operator made was replaced"
    # One 201 per pod, but for a pod the killed operator's request stored after the kill cut
    # it short (504 in the log; its uid is in kept). 409s are not creations.
    answers = real.pod_create_answers()
    for name in names:
        codes = answers.get(name, [])
        if codes.count(201) == 0:
            assert name in kept and any(code >= 500 for code in codes), (name, codes)
        else:
            assert codes.count(201) == 1, f"{name} was created twice: {codes}"
    status = real.status("kappa")
    counted = {k: status.get(k) for k in ("phase", "replicas", "readyReplicas", "restarts")}
    assert counted == {
        "phase": "Running", "replicas": target, "readyReplicas": target, "restarts": 0
    }, status  # fmt: skip
    assert status.get("backoffCount", 0) == 0, status
    assert status.get("succeeded", 0) == 0, status
    assert status["failures"] == [], status
    assert status.get("accountedPods", []) == [], status


def test_pod0s_node_lost_it_is_force_deleted_and_replaced_uncharged(real: RealEnv) -> None:
    """The real node lifecycle controller notices, the taint eviction controller evicts with
    DisruptionTarget; no kubelet confirms, so the pod stays Terminating; the operator counts it
    once (NodeLost, not charged), force-deletes it at its bound and creates pod 0 again."""
    real.start_operator()
    template = real.manifest("iota", real.namespace)["spec"]["template"]
    template["spec"]["terminationGracePeriodSeconds"] = 3
    template["spec"]["affinity"] = one_pod_per_node("iota")
    real.fake_trainer = False  # the template is already the fake one
    # The operator's own NoExecute tolerations (nodeLostTolerationSeconds), not the 300 s the
    # DefaultTolerationSeconds admission plugin would give every pod.
    real.create_job(
        "iota", forceDeleteAfterSeconds=3, nodeLostTolerationSeconds=2, template=template
    )
    real.fake_trainer = True
    real.run_pods("iota")
    old = real.pod("iota-worker-0")
    assert old is not None
    node = old["spec"]["nodeName"]
    survivor = real.pod("iota-worker-1")
    assert survivor is not None
    lost_at = time.monotonic()
    real.k.lose_node(node)

    def terminating() -> JSON | None:
        pod = real.pod("iota-worker-0")
        if pod is None or pod["metadata"]["uid"] != old["metadata"]["uid"]:
            return None
        return pod if pod["metadata"].get("deletionTimestamp") else None

    evicted = wait_for(terminating, "the taint eviction controller's delete", timeout=60)
    reasons = {c["type"]: c.get("reason") for c in evicted["status"]["conditions"]}
    assert reasons.get("DisruptionTarget") == "DeletionByTaintManager", reasons
    new = real.replacement(old, "pod 0 force-deleted and created again", timeout=90)
    elapsed = time.monotonic() - lost_at
    status = real.status("iota")
    assert [f["reason"] for f in status["failures"]] == ["NodeLost"]
    assert counts(real, "iota") == (1, 0)
    assert new["metadata"]["name"] == "iota-worker-0"
    assert survivor["spec"]["nodeName"] != node
    current = real.pod("iota-worker-1")
    assert current is not None and current["metadata"]["uid"] == survivor["metadata"]["uid"]
    print(f"node lost -> pod 0 replaced: {elapsed:.1f}s")
    time.sleep(2)
    assert counts(real, "iota") == (1, 0), "counted once"


STEP_RE = re.compile(r"DDPJOB step=(\d+) rank=(\d+) world=(\d+)")
DONE_RE = re.compile(r"DDPJOB done steps=(\d+)")


def last_world(kube: KubeTest, pod: str) -> int | None:
    found = STEP_RE.findall(kube.kubectl("logs", pod, "-c", "trainer", check=False).stdout)
    return int(found[-1][2]) if found else None


def test_training_goes_on_when_the_store_hosts_node_is_lost(kube: KubeTest, tmp_path: Path) -> None:
    """Real training: pod 0 (the c10d store host) loses its node. The real controllers evict
    it after the operator's 2 s toleration, the operator force-deletes it (no kubelet confirms)
    and creates it again under the same DNS name; pod 1's agent waits for it and rejoins; the
    job finishes every step, with one restart, NodeLost, and nothing charged."""
    env = real_env(kube, tmp_path, fake_trainer=False)
    env.start_operator()
    steps = 160
    template = {
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "affinity": one_pod_per_node("lost"),
            "containers": [
                {
                    "name": "trainer",
                    "image": "ghcr.io/ddpjob/ddpjob-worker-cpu:0.1.0",
                    "command": ["ddpjob-agent"],
                    "args": [
                        "/opt/ddpjob/examples/train.py",
                        f"--steps={steps}",
                        "--step-sleep=0.2",
                        "--ckpt-every=10",
                        "--ckpt-dir=/ckpt",
                    ],
                    "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
                }
            ],
            "volumes": [
                {
                    "name": "ckpt",
                    "hostPath": {"path": str(tmp_path / "ckpt"), "type": "DirectoryOrCreate"},
                }
            ],
        }
    }
    env.create_job(
        "lost", replicas=2, minReplicas=1, maxReplicas=2, nodeLostTolerationSeconds=2,
        forceDeleteAfterSeconds=3, template=template,
    )  # fmt: skip
    pods = ["lost-worker-0", "lost-worker-1"]
    wait_for(lambda: all(last_world(kube, p) == 2 for p in pods), "training at world 2", 240)
    old = env.pod("lost-worker-0")
    assert old is not None
    lost_at = time.monotonic()
    kube.lose_node(old["spec"]["nodeName"])
    new = env.replacement(old, "pod 0 created again after its node was lost", timeout=120)
    replaced = time.monotonic() - lost_at

    def training_again() -> bool:
        pod = env.pod("lost-worker-0")
        return bool(pod and pod["metadata"]["uid"] == new["metadata"]["uid"]) and all(
            last_world(kube, p) == 2 for p in pods
        )

    wait_for(training_again, "both pods training at world 2 again", 240)
    again = time.monotonic() - lost_at
    print(f"store host's node lost: pod 0 replaced after {replaced:.1f}s, training at world 2 "
          f"again after {again:.1f}s")  # fmt: skip
    status = wait_for(
        lambda: env.status("lost").get("phase") in ("Succeeded", "Failed") and env.status("lost"),
        "the job to finish",
        timeout=600,
    )
    assert status["phase"] == "Succeeded", status
    assert [(f["pod"], f["reason"], f["charged"]) for f in status["failures"]] == [
        ("lost-worker-0", "NodeLost", False)
    ]
    assert (status["restarts"], status.get("backoffCount", 0)) == (1, 0)
    for pod in pods:
        done = DONE_RE.search(kube.kubectl("logs", pod, "-c", "trainer").stdout)
        assert done is not None and int(done.group(1)) == steps, pod


def test_the_quickstart_example_succeeds_as_written(kube: KubeTest, tmp_path: Path) -> None:
    """examples/quickstart.yaml, applied as a user would, trains to the end on real pods."""
    env = real_env(kube, tmp_path, fake_trainer=False)
    env.start_operator()
    kube.kubectl("apply", "-f", str(ROOT / "examples" / "quickstart.yaml"))
    status = wait_for(
        lambda: (
            env.status("quickstart").get("phase") in ("Succeeded", "Failed")
            and env.status("quickstart")
        ),
        "the quickstart job to finish",
        timeout=400,
    )
    assert status["phase"] == "Succeeded", status
    assert (status["restarts"], status.get("backoffCount", 0)) == (0, 0)
    for pod in ("quickstart-worker-0", "quickstart-worker-1"):
        done = DONE_RE.search(kube.kubectl("logs", pod, "-c", "trainer").stdout)
        assert done is not None and int(done.group(1)) == 400, pod
