"""Issue 14's defects, checked on the real control plane where they can be.

The emulator variants of the executor's defects are in ``test_defects_operator.py`` and the pure
core's in ``tests/unit``; here the real API server, admission plugins, kubelets and garbage
collector decide:

* 2: the Pod Security level ``deploy/`` gives ``ddpjob-system`` admits the pods of a job there,
  and ``restricted`` would refuse them (the Baseline profile);
* 6: a privileged trainer, or one that adds SYS_ADMIN, gets its pods (the server refuses
  ``allowPrivilegeEscalation: false`` beside ``privileged: true`` or ``CAP_SYS_ADMIN``);
* 10: a pod deleted while no operator runs, confirmed by its kubelet (whose final delete with
  grace 0 moves ``deletionTimestamp``), counts as ``Deleted``, not charged;
* 11: a job deleted and created again under its name waits for the old pods (``NameInUse``)
  and never adopts or counts them;
* 11 (later): a store-key Secret deleted while the job is suspended is made anew on resume;
* 12: a Service of the job's name that is not the job's is reported, and no pod starts;
* 16: a template change that CEL's map equality would skip (nodeSelector swapped for affinity)
  is refused while the job runs;
* 18: the chart's aggregated ClusterRoles, once the real clusterrole-aggregation controller has
  folded them in, let whoever holds ``edit`` or ``admin`` in a namespace create, patch and scale
  DDPJobs there, and whoever holds ``view`` read them only;
* 19: ``kubectl get all`` does not list a DDPJob and ``kubectl delete all --all`` leaves it
  (its category is ``ddpjob``, not ``all``).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.harness import tools
from tests.harness.kube.fixtures import KubeTest
from tests.harness.operator_env import RealEnv, real_env, wait_for

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
    real.expect_failures(
        rf'reconcile failed \(403 Forbidden: pods "psa-worker-\d" is forbidden: violates '
        rf'PodSecurity "restricted:latest": .* \[DDPJob {restricted}/psa\]$'
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


def test_a_store_key_secret_deleted_while_suspended_is_made_anew_on_resume(
    real: RealEnv,
) -> None:
    # Without it the resumed job's pods would wait in CreateContainerConfigError (their env
    # reads the Secret) until the operator restarted.
    real.start_operator()
    real.create_job("mu", replicas=2)
    real.run_pods("mu")
    path = f"/api/v1/namespaces/{real.ns(None)}/secrets/mu-store-key"
    old = real.get_object("v1/secrets", real.ns(None), "mu-store-key")
    assert old is not None
    real.patch_job("mu", {"spec": {"suspend": True}})
    wait_for(lambda: real.pods("mu") == [], "the suspended job's pods gone", timeout=60)
    assert real.delete(path) == 200
    real.patch_job("mu", {"spec": {"suspend": False}})
    assert len(real.run_pods("mu")) == 2  # their containers started: the Secret was there
    new = real.get_object("v1/secrets", real.ns(None), "mu-store-key")
    assert new is not None and new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["metadata"]["ownerReferences"][0]["name"] == "mu"
    assert new["data"]["key"] != old["data"]["key"]


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
    real.expect_failures(
        rf"reconcile failed \(409 AlreadyExists: Service {real.namespace}/delta exists and is "
        rf"not DDPJob {real.namespace}/delta's"
    )
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


# ---- 6: a privileged or SYS_ADMIN trainer ----------------------------------------------------


@pytest.mark.parametrize(
    "security",
    [
        {"privileged": True},
        {"capabilities": {"add": ["CAP_SYS_ADMIN"]}},
        {"capabilities": {"add": ["SYS_ADMIN"]}},
    ],
    ids=["privileged", "CAP_SYS_ADMIN", "SYS_ADMIN"],
)
def test_a_privileged_or_sys_admin_trainer_gets_its_pods(real: RealEnv, security: JSON) -> None:
    """The server answers 422 to ``allowPrivilegeEscalation: false`` beside ``privileged: true``
    or ``capabilities.add: [CAP_SYS_ADMIN]``; the Baseline profile leaves the trainer's security
    context as the user wrote it there (``SYS_ADMIN``, which the server lets pass, too)."""
    template = real.manifest("theta", real.namespace)["spec"]["template"]
    template["spec"]["containers"][0]["securityContext"] = security
    real.start_operator()
    real.create_job("theta", template=template)
    real.run_pods("theta")
    pods = real.pods("theta")
    assert [p["metadata"]["name"] for p in pods] == ["theta-worker-0", "theta-worker-1"]
    for pod in pods:
        trainer = pod["spec"]["containers"][0]
        assert trainer["name"] == "trainer"
        assert trainer["securityContext"] == security, pod["metadata"]["name"]
    assert real.events(reason="ActionFailed") == []
    assert real.pod_creations() == 2


# ---- 18: DDPJobs through the built-in admin, edit and view roles -----------------------------


RBAC = "/apis/rbac.authorization.k8s.io/v1"
VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")
ACCESS = [(verb, "") for verb in VERBS] + [
    (verb, sub) for sub in ("scale", "status") for verb in ("get", "update", "patch")
]
"""(verb, subresource) on ``ddpjobs`` asked of the server for each user."""
READ = {("get", ""), ("list", ""), ("watch", ""), ("get", "scale"), ("get", "status")}
MANAGE = set(ACCESS) - {("update", "status"), ("patch", "status")}
"""Everything but writing the status, which is the operator's."""


@pytest.fixture
def user_roles(kube: KubeTest) -> Iterator[dict[str, JSON]]:
    """The chart's aggregated ClusterRoles, rendered by the real helm for a release of this
    test's own and applied; deleted afterwards (cluster-scoped: the test namespace's deletion
    leaves them).

    The session's RBAC (``tests/harness/kube/fixtures.py``) leaves them out: cluster-scoped objects
    that kubectl applied under a release's names carry no helm ownership, and ``helm install``
    of that release would refuse to take them over. A release name of its own avoids that."""
    release = f"agg-{uuid.uuid4().hex[:6]}"
    values = {"rbac": {"create": True, "aggregateToDefaultRoles": True}}
    docs = tools.render(values, release=release, namespace=kube.namespace)
    roles = {d["metadata"]["name"]: d for d in docs if tools.aggregated(d)}
    assert sorted(roles) == [f"{release}-ddpjob-edit", f"{release}-ddpjob-view"]
    assert {d["kind"] for d in roles.values()} == {"ClusterRole"}
    kube.kubectl("apply", "-f", "-", stdin="\n---\n".join(json.dumps(d) for d in roles.values()))
    try:
        yield {"edit": roles[f"{release}-ddpjob-edit"], "view": roles[f"{release}-ddpjob-view"]}
    finally:
        kube.kubectl("delete", "clusterrole", *roles, "--ignore-not-found", check=False)


def bind(kube: KubeTest, cluster_role: str, user: str) -> None:
    binding = {
        "metadata": {"name": f"{cluster_role}-{user}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": cluster_role},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
    }  # fmt: skip
    kube.api.create(f"{RBAC}/namespaces/{kube.namespace}/rolebindings", binding)


def granted(kube: KubeTest, user: str, namespace: str) -> set[tuple[str, str]]:
    """What the server's authorizer (RBAC) allows ``user`` on ``ddpjobs`` in ``namespace``:
    a SubjectAccessReview per (verb, subresource) of ACCESS, as ``kubectl auth can-i --as``."""
    allowed = set()
    for verb, subresource in ACCESS:
        attributes = {"namespace": namespace, "verb": verb, "group": "ddpjob.io",
                      "resource": "ddpjobs", "subresource": subresource}  # fmt: skip
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {"user": user, "groups": ["system:authenticated"],
                     "resourceAttributes": attributes},
        }  # fmt: skip
        answer = kube.api.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", review)
        if answer["status"].get("allowed") is True:
            allowed.add((verb, subresource))
    return allowed


def test_namespace_users_manage_or_read_ddpjobs_through_the_built_in_roles(
    real: RealEnv, user_roles: dict[str, JSON]
) -> None:
    kube = real.k
    users = {"admin": "ddpjob-admin-user", "edit": "ddpjob-edit-user", "view": "ddpjob-view-user"}
    for cluster_role, user in users.items():
        bind(kube, cluster_role, user)
    folded_in = {
        "admin": user_roles["edit"],
        "edit": user_roles["edit"],
        "view": user_roles["view"],
    }

    def aggregated() -> bool:
        # The real clusterrole-aggregation controller copies the rules of every ClusterRole
        # whose labels the built-in role's aggregationRule selects.
        for builtin, ours in folded_in.items():
            rules = (kube.get(f"{RBAC}/clusterroles/{builtin}") or {}).get("rules") or []
            if any(rule not in rules for rule in ours["rules"]):
                return False
        return True

    wait_for(aggregated, "the chart's rules in the built-in admin, edit and view roles", 30)
    namespace = real.namespace
    # The authorizer reads roles and bindings from its informers: it may lag the writes.
    expected = {"admin": MANAGE, "edit": MANAGE, "view": READ}
    wait_for(
        lambda: all(
            granted(kube, users[role], namespace) == want for role, want in expected.items()
        ),
        "the authorizer granting the admin, edit and view users what the roles say",
        30,
    )
    assert granted(kube, users["edit"], "default") == set()  # bound in this namespace only

    # What the server grants, done: kubectl as the edit user creates, patches and scales.
    editor, viewer = ("--as", users["edit"]), ("--as", users["view"])
    manifest = yaml.safe_dump(real.manifest("rho", namespace))
    kube.kubectl(*editor, "create", "-f", "-", stdin=manifest)
    labels = json.dumps({"metadata": {"labels": {"team": "vision"}}})
    kube.kubectl(*editor, "patch", "ddpj", "rho", "--type=merge", "-p", labels)
    kube.kubectl(*editor, "scale", "ddpj/rho", "--replicas=3")
    job = real.job("rho")
    assert job is not None
    assert (job["metadata"]["labels"], job["spec"]["replicas"]) == ({"team": "vision"}, 3)
    # The view user reads, and is refused the rest.
    assert kube.kubectl(*viewer, "get", "ddpj", "-o", "name").stdout.split() == [
        "ddpjob.ddpjob.io/rho"
    ]
    assert (
        kube.kubectl(*viewer, "get", "ddpj", "rho", "-o", "jsonpath={.spec.replicas}").stdout == "3"
    )
    other = yaml.safe_dump(real.manifest("sigma", namespace))
    refused = kube.kubectl(*viewer, "create", "-f", "-", stdin=other, check=False)
    assert refused.returncode == 1
    assert (
        f'User "{users["view"]}" cannot create resource "ddpjobs" in API group "ddpjob.io" '
        f'in the namespace "{namespace}"'
    ) in refused.stderr, refused.stderr
    refused = kube.kubectl(*viewer, "scale", "ddpj/rho", "--replicas=2", check=False)
    assert refused.returncode == 1
    assert (
        f'User "{users["view"]}" cannot patch resource "ddpjobs/scale" in API group "ddpjob.io"'
    ) in refused.stderr, refused.stderr
    assert real.job("sigma") is None
    job = real.job("rho")
    assert job is not None and job["spec"]["replicas"] == 3


# ---- 19: not in the category "all" ----------------------------------------------------------


def test_kubectl_get_all_does_not_list_a_job_and_delete_all_leaves_it(
    real: RealEnv, tmp_path: Path
) -> None:
    namespace = real.namespace
    real.start_operator()
    job = real.create_job("omega")
    real.run_pods("omega")
    service = real.get_object("v1/services", namespace, "omega")
    assert service is not None

    def kubectl(*args: str) -> str:
        # A discovery cache of its own: the shared one, written by the session's first kubectl
        # before the CRD existed, would hide the kind from "all" whatever its categories.
        return real.k.kubectl("--cache-dir", str(tmp_path / "kubectl-cache"), *args).stdout

    listed = kubectl("get", "all", "-o", "name").split()
    assert {"pod/omega-worker-0", "pod/omega-worker-1", "service/omega"} <= set(listed), listed
    assert [name for name in listed if "ddpjob" in name] == []
    assert kubectl("get", "ddpjob", "-o", "name").split() == ["ddpjob.ddpjob.io/omega"]

    old = {p["metadata"]["uid"] for p in real.pods("omega")}
    deleted = kubectl("delete", "all", "--all", "--wait=false", "-o", "name")
    assert sorted(deleted.split()) == ["pod/omega-worker-0", "pod/omega-worker-1", "service/omega"]
    # The job is untouched, and puts back what kubectl deleted: training goes on.
    current = real.job("omega")
    assert current is not None
    assert current["metadata"]["uid"] == job["metadata"]["uid"]
    assert "deletionTimestamp" not in current["metadata"]

    def restored() -> bool:
        pods = [p for p in real.pods("omega") if not p["metadata"].get("deletionTimestamp")]
        fresh = {p["metadata"]["uid"] for p in pods}
        again = real.get_object("v1/services", namespace, "omega")
        return (
            len(pods) == 2
            and not fresh & old
            and again is not None
            and again["metadata"]["uid"] != service["metadata"]["uid"]
        )

    wait_for(restored, "the job's pods and Service created again", timeout=60)
    real.run_pods("omega")
    status = real.status("omega")
    assert [(f["reason"], f["charged"]) for f in status["failures"]] == [("Deleted", False)] * 2
    assert (status["restarts"], status.get("backoffCount", 0)) == (2, 0)
    # Why: the server's discovery gives the kind the CRD's category only.
    resources = (real.k.get("/apis/ddpjob.io/v1alpha1") or {})["resources"]
    ddpjobs = next(r for r in resources if r["name"] == "ddpjobs")
    assert ddpjobs["categories"] == ["ddpjob"]
