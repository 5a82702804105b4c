"""The clusters of the e2e tests: the real control plane of ``tests/harness/kube``, and kind.

Every test here runs twice: ``[real]`` on the session's real control plane (etcd,
kube-apiserver, kube-controller-manager and kube-scheduler built from Go modules, process
kubelets; part of ``make test``), ``[kind]`` on a kind cluster (``make e2e``; opt-in). On the
real control plane the chart is installed with real ``helm`` and its operator Deployment runs
through a process kubelet (image ``ghcr.io/ddpjob/ddpjob-operator``: ``ddpjob operator`` from
the dev venv), with the projected service-account token a kubelet mounts.

kind: one cluster per session, shared by every test in this directory:

1. ``kind create cluster --name ddpjob-e2e`` (``--image $KIND_NODE_IMAGE`` if set, else kind's
   default node image), with a kubeconfig of its own: the user's ``~/.kube/config`` is never
   touched;
2. (``ddpjob_install``, only for the tests that need the operator) ``docker build --target
   operator`` and ``--target worker-cpu``, ``kind load docker-image`` of both, then
   ``helm upgrade --install`` of charts/ddpjob into ``ddpjob-system`` with the local operator
   image (``pullPolicy: Never``), serving the test namespace ``ddpjob-e2e``;
3. at the end: if a test failed, diagnostics (DDPJobs, pods, events, the operator's and the
   job pods' logs, ``kind export logs``) in ``$DDPJOB_E2E_ARTIFACTS``; then
   ``kind delete cluster``, unless ``KEEP_CLUSTER=1`` or the cluster was reused.

Without kind or a Docker daemon that answers, every test here is skipped with the reason; with
``DDPJOB_E2E=1`` (``make e2e``) it fails instead, and ``DDPJOB_E2E=0`` skips it even where kind
and Docker exist (``make test`` in CI, whose ``e2e`` job runs the suite). kubectl and helm come from PATH, else from
the dev extra's wheel (tests/harness/tools.py).

Environment:

=========================  ===================================================================
``KIND_NODE_IMAGE``        node image (Kubernetes version), e.g. ``kindest/node:v1.30.13@sha256:...``
``DDPJOB_E2E_CLUSTER``     cluster name (``ddpjob-e2e``)
``DDPJOB_E2E_REUSE=1``     run on an existing cluster of that name (else: fail if one exists);
                           a reused cluster is never deleted. ``DDPJOB_KIND_CLUSTER=NAME`` is
                           the older spelling of both.
``KEEP_CLUSTER=1``         do not delete the cluster at the end
``DDPJOB_E2E_TAG``         tag of the images built and loaded (``e2e``)
``DDPJOB_E2E_BUILD=0``     do not build: use the existing ``ddpjob-operator:<tag>`` and
                           ``ddpjob-worker-cpu:<tag>`` (e.g. from ``make images-offline``)
``DDPJOB_E2E_BUILD_ARGS``  extra ``docker build`` arguments, shell-split
``DDPJOB_E2E_ARTIFACTS``   where build logs and diagnostics go (``.cache/e2e-artifacts``)
``DDPJOB_E2E_TIMEOUT``     per-test timeout in seconds, fixture setup included (3600)
``DDPJOB_KIND_NODES``      nodes of the offline kind cluster, the control plane's included (4)
``KUBECTL``, ``HELM``      binaries to use instead of PATH's
=========================  ===================================================================
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path

import pytest

from tests.harness import tools
from tests.harness.install import (
    CHART,
    TEST_NAMESPACE,
    artifacts_dir,
    install_on_real,
)
from tests.harness.kind import docker, gobuild
from tests.harness.kind.__main__ import build_all
from tests.harness.kind.cluster import KindCluster
from tests.harness.kube.controlplane import ControlPlane
from tests.harness.kubectl import (
    ROOT,
    Installed,
    Kube,
    disabled,
    kind_mode,
    missing_requirements,
    required,
    resolve_tool,
    run,
)

DEFAULT_CLUSTER = "ddpjob-e2e"
OPERATOR_NAMESPACE = "ddpjob-system"
RELEASE = "ddpjob"
OPERATOR_REPOSITORY = "ddpjob-operator"
WORKER_REPOSITORY = "ddpjob-worker-cpu"

FAILED = pytest.StashKey[bool]()


def _flag(name: str) -> bool:
    return os.environ.get(name, "").lower() in ("1", "true", "yes")


# ---- hooks ---------------------------------------------------------------------------------


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Image builds, cluster creation and torch start-up take far longer than pyproject's 300 s
    per test; the first test of the session also pays for the session fixtures."""
    timeout = int(os.environ.get("DDPJOB_E2E_TIMEOUT", "3600"))
    for item in items:
        if item.get_closest_marker("e2e") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(timeout))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.failed:
        item.session.stash[FAILED] = True
    return report


# ---- the cluster ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def e2e_requirements() -> str:
    """The kind to use (:func:`tests.harness.kubectl.kind_mode`), once its requirements are met."""
    if disabled():
        pytest.skip("DDPJOB_E2E=0: the kind e2e suite is turned off (run it with make e2e)")
    try:
        mode = kind_mode()
    except ValueError as exc:
        pytest.fail(str(exc), pytrace=False)
    reason = missing_requirements(mode)
    if reason is None:
        return mode
    if required():
        pytest.fail(reason, pytrace=False)
    pytest.skip(reason)
    raise AssertionError("unreachable")  # pragma: no cover


def _existing_clusters() -> list[str]:
    return run(["kind", "get", "clusters"]).stdout.split()


def dump_diagnostics(backend: KindBackend, target: Path) -> None:
    """Everything needed to understand a failure, written before the cluster goes away."""
    kube = backend.kube
    target.mkdir(parents=True, exist_ok=True)
    every = ["--all-namespaces"]
    commands = {
        "ddpjobs.yaml": ["get", "ddpjobs", *every, "-o", "yaml"],
        "pods.txt": ["get", "pods", *every, "-o", "wide"],
        "pods.yaml": ["get", "pods", "-n", TEST_NAMESPACE, "-o", "yaml"],
        "events.txt": ["get", "events", *every, "--sort-by=.lastTimestamp"],
        "operator.log": [
            "logs", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/component=operator",
            "--tail=-1", "--prefix",
        ],
    }  # fmt: skip
    for name, args in commands.items():
        result = kube.kubectl(*args, check=False, timeout=120)
        (target / name).write_text(result.stdout + result.stderr)
    pods = kube.in_namespace(TEST_NAMESPACE).kubectl(
        "get", "pods", "-o", "jsonpath={.items[*].metadata.name}", check=False
    )
    for pod in pods.stdout.split():
        result = kube.kubectl(
            "logs", "-n", TEST_NAMESPACE, pod, "--all-containers", check=False, timeout=60
        )
        (target / f"pod-{pod}.log").write_text(result.stdout + result.stderr)
    backend.export_logs(target / "kind")


@dataclasses.dataclass
class KindBackend:
    """How the suite drives its kind cluster: the user's kind (``upstream``) or the one built
    here (``offline``, :mod:`tests.harness.kind`)."""

    kube: Kube
    offline: KindCluster | None = None
    dockerd: docker.Dockerd | None = None

    def load(self, image: str, nodes: Sequence[str] = ()) -> None:
        if self.offline is not None:
            self.offline.load(image, nodes)
        else:
            load_image(image, self.kube.cluster)

    def export_logs(self, target: Path) -> None:
        if self.offline is not None:
            self.offline.diagnose(target)
        else:
            run(["kind", "export", "logs", str(target), "--name", self.kube.cluster],
                check=False, timeout=300)  # fmt: skip

    def env(self) -> dict[str, str]:
        """The environment of ``docker`` commands against the cluster's daemon."""
        return self.dockerd.env() if self.dockerd is not None else dict(os.environ)

    def workers(self) -> list[str]:
        """The nodes that run the job's pods: the workers, if the cluster has any."""
        if self.offline is None:
            return []
        return [n for n in self.offline.node_names() if not n.endswith("-control-plane")]


OFFLINE_NODES = int(os.environ.get("DDPJOB_KIND_NODES") or 4)
"""The offline cluster: the control plane (which runs the operator) and three workers (which run
the jobs), so a worker can be killed, paused or cut off while the API and the operator live,
and a job of three pods, one per worker, keeps a majority of two. ``DDPJOB_KIND_NODES=3`` (two
workers) is enough for test_kind_operator and costs a third less disk: the worker image takes
about 11 GB per worker it is loaded into (the fault tests then skip, they need three)."""

CKPT_HOST_PATH = "/var/lib/ddpjob-example-ckpt"
"""examples/kind-cpu.yaml's hostPath for checkpoints; one directory of this machine is mounted
there in every node of the offline cluster, so every node sees the same checkpoints."""


@pytest.fixture(scope="session")
def kind_cluster(kind_backend: KindBackend) -> Kube:
    return kind_backend.kube


@pytest.fixture(scope="session")
def kind_backend(e2e_requirements: str, request: pytest.FixtureRequest) -> Iterator[KindBackend]:
    """A kind cluster, created for the session (or reused on request), deleted at the end."""
    if e2e_requirements == "offline":
        yield from _offline_backend(request)
        return
    legacy = os.environ.get("DDPJOB_KIND_CLUSTER")
    name = os.environ.get("DDPJOB_E2E_CLUSTER") or legacy or DEFAULT_CLUSTER
    reuse = _flag("DDPJOB_E2E_REUSE") or bool(legacy)
    exists = name in _existing_clusters()
    if exists and not reuse:
        pytest.fail(
            f"a kind cluster named {name!r} already exists: set DDPJOB_E2E_REUSE=1 to run on it, "
            f"or delete it first (kind delete cluster --name {name})",
            pytrace=False,
        )
    if reuse and not exists and legacy:
        pytest.fail(f"DDPJOB_KIND_CLUSTER={legacy}: no such kind cluster", pytrace=False)
    workdir = Path(tempfile.mkdtemp(prefix="ddpjob-e2e-"))
    kubeconfig = workdir / "kubeconfig"
    created = not exists
    if created:
        create = ["kind", "create", "cluster", "--name", name, "--kubeconfig", str(kubeconfig)]
        image = os.environ.get("KIND_NODE_IMAGE")
        if image:
            create += ["--image", image]
        run([*create, "--wait", "300s"], timeout=1200)
    else:
        kubeconfig.write_text(run(["kind", "get", "kubeconfig", "--name", name]).stdout)
    backend = KindBackend(
        Kube(kubeconfig, resolve_tool("kubectl"), resolve_tool("helm"), cluster=name)
    )
    try:
        _say_version(backend.kube)
        yield backend
    finally:
        _diagnose_if_failed(backend, request)
        if created and not _flag("KEEP_CLUSTER"):
            delete = ["kind", "delete", "cluster", "--name", name, "--kubeconfig", str(kubeconfig)]
            run(delete, check=False, timeout=600)
        elif created:
            print(f"KEEP_CLUSTER: kind cluster {name} kept; kubeconfig: kind get kubeconfig "
                  f"--name {name}")  # fmt: skip


def _offline_backend(request: pytest.FixtureRequest) -> Iterator[KindBackend]:
    """The kind built here (tests/harness/kind) in the harness's own Docker daemon, with 3 nodes."""
    name = os.environ.get("DDPJOB_E2E_CLUSTER") or DEFAULT_CLUSTER
    workdir = Path(tempfile.mkdtemp(prefix="ddpjob-e2e-"))
    shared = workdir / "ckpt"
    shared.mkdir()
    dockerd = docker.Dockerd()
    dockerd.start()
    cluster: KindCluster | None = None
    try:
        image = build_all(dockerd)
        cluster = KindCluster(
            name, image=image, nodes=OFFLINE_NODES, workdir=workdir,
            docker_env=dockerd.env(), netns=dockerd.netns,
            kind=str(gobuild.bin_dir() / "kind"), kubectl=resolve_tool("kubectl"),
            mounts={str(shared): CKPT_HOST_PATH}, marker_dir=dockerd.run_dir,
        )  # fmt: skip
        if cluster.exists():
            pytest.fail(
                f"a kind cluster named {name!r} already exists in the harness's Docker daemon: "
                f"delete it (python -m tests.harness.kind.docker exec -- kind delete cluster --name "
                f"{name}) or stop the daemon (python -m tests.harness.kind.docker stop)",
                pytrace=False,
            )
        cluster.create()
        backend = KindBackend(
            Kube(cluster.kubeconfig, resolve_tool("kubectl"), resolve_tool("helm"), cluster=name),
            offline=cluster,
            dockerd=dockerd,
        )
        _say_version(backend.kube)
        try:
            yield backend
        finally:
            _diagnose_if_failed(backend, request)
    finally:
        if cluster is not None:
            cluster.delete()
        dockerd.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _say_version(kube: Kube) -> None:
    version = kube.kubectl("version", "-o", "json", check=False)
    if version.returncode == 0:
        server = json.loads(version.stdout).get("serverVersion", {}).get("gitVersion")
        print(f"kind cluster {kube.cluster}: Kubernetes {server}")


def _diagnose_if_failed(backend: KindBackend, request: pytest.FixtureRequest) -> None:
    if request.session.stash.get(FAILED, False):
        target = artifacts_dir() / "diagnostics"
        dump_diagnostics(backend, target)
        print(f"e2e diagnostics in {target}")


# ---- images and the operator ---------------------------------------------------------------


def build_image(target: str, image: str, logs: Path) -> None:
    log = logs / f"docker-build-{target}.log"
    extra = shlex.split(os.environ.get("DDPJOB_E2E_BUILD_ARGS", ""))
    args = ["docker", "build", "--target", target, "--tag", image, *extra, str(ROOT)]
    print(f"$ {shlex.join(args)}  (log: {log})")
    with log.open("w") as out:
        result = subprocess.run(
            args, stdout=out, stderr=subprocess.STDOUT, check=False, timeout=3600
        )
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise AssertionError(f"`{shlex.join(args)}` exited {result.returncode}:\n{tail}")


def load_image(image: str, cluster: str) -> None:
    """``kind load docker-image``; through an image archive if that fails (kind cannot read
    some images from Docker's containerd image store directly)."""
    loaded = run(["kind", "load", "docker-image", image, "--name", cluster], check=False,
                 timeout=900)  # fmt: skip
    if loaded.returncode == 0:
        return
    with tempfile.TemporaryDirectory(prefix="ddpjob-e2e-image-") as tmp:
        archive = str(Path(tmp) / "image.tar")
        run(["docker", "save", "--output", archive, image], timeout=900)
        run(["kind", "load", "image-archive", archive, "--name", cluster], timeout=900)


def build_offline_images(tag: str, backend: KindBackend, logs: Path) -> None:
    """``make images-offline`` into the cluster's own daemon: no registry, no network in the
    builds. torch is PyPI's where the CPU index cannot be reached (``TORCH_BUILD=any``)."""
    log = logs / "images-offline.log"
    env = {**backend.env(), "TAG": tag, "TORCH_BUILD": os.environ.get("TORCH_BUILD", "any")}
    print(f"$ TAG={tag} scripts/images-offline.sh  (log: {log})")
    with log.open("w") as out:
        result = subprocess.run(
            [str(ROOT / "scripts" / "images-offline.sh")], cwd=ROOT, env=env, stdout=out,
            stderr=subprocess.STDOUT, check=False, timeout=3600,
        )  # fmt: skip
    if result.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise AssertionError(f"scripts/images-offline.sh exited {result.returncode}:\n{tail}")
    # The harness's own daemon: what a rebuild left untagged is 5 GB a time (the worker image).
    run(["docker", "image", "prune", "--force"], env=backend.env(), timeout=600)


@pytest.fixture(scope="session")
def kind_install(kind_backend: KindBackend) -> Installed:
    """The local images in the kind cluster and the chart installed, serving ``ddpjob-e2e``."""
    kind_cluster = kind_backend.kube
    tag = os.environ.get("DDPJOB_E2E_TAG", "e2e")
    operator_image = f"{OPERATOR_REPOSITORY}:{tag}"
    worker_image = f"{WORKER_REPOSITORY}:{tag}"
    logs = artifacts_dir()
    if os.environ.get("DDPJOB_E2E_BUILD", "1") != "0":
        if kind_backend.offline is not None:
            build_offline_images(tag, kind_backend, logs)
        else:
            build_image("operator", operator_image, logs)
            build_image("worker-cpu", worker_image, logs)
    else:
        for image in (operator_image, worker_image):
            found = run(["docker", "image", "inspect", image], env=kind_backend.env(),
                        check=False)  # fmt: skip
            assert found.returncode == 0, (
                f"DDPJOB_E2E_BUILD=0 but there is no image {image}: build it (docker build "
                f"--target ... -t {image} ., or TAG={tag} make images-offline)"
            )
    workers = kind_backend.workers()
    control_plane = [f"{kind_cluster.cluster}-control-plane"] if workers else []
    kind_backend.load(operator_image, control_plane)
    kind_backend.load(worker_image, workers)

    # The chart's watchNamespaces must exist before the install (a Role goes into each).
    namespace = kind_cluster.kubectl(
        "create", "namespace", TEST_NAMESPACE, "--dry-run=client", "-o", "yaml"
    ).stdout
    kind_cluster.kubectl("apply", "-f", "-", stdin=namespace)
    values: dict[str, object] = {
        "image": {"repository": OPERATOR_REPOSITORY, "tag": tag, "pullPolicy": "Never"},
        "watchNamespaces": [TEST_NAMESPACE],
    }
    if control_plane:
        # The operator on the control plane's node: faults on the workers leave it running.
        values["nodeSelector"] = {"node-role.kubernetes.io/control-plane": ""}
        values["tolerations"] = [
            {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
             "effect": "NoSchedule"},
        ]  # fmt: skip
    values_file = logs / "helm-values.json"
    values_file.write_text(json.dumps(values))
    kind_cluster.helm(
        "upgrade", "--install", RELEASE, str(CHART),
        "--namespace", OPERATOR_NAMESPACE, "--create-namespace",
        "--values", str(values_file), "--wait", "--timeout", "10m",
    )  # fmt: skip
    operator = kind_cluster.in_namespace(OPERATOR_NAMESPACE)
    deployments = operator.items("deployments", "-l", f"app.kubernetes.io/instance={RELEASE}")
    assert len(deployments) == 1, [d["metadata"]["name"] for d in deployments]
    operator.kubectl(
        "rollout", "status", f"deployment/{deployments[0]['metadata']['name']}",
        "--timeout=300s", timeout=330,
    )  # fmt: skip
    return Installed(
        kind_cluster.in_namespace(TEST_NAMESPACE), operator_image, worker_image, RELEASE,
        OPERATOR_NAMESPACE,
    )  # fmt: skip


# ---- either cluster --------------------------------------------------------------------------


@pytest.fixture(scope="session", params=["real", "kind"])
def e2e_cluster(request: pytest.FixtureRequest) -> Kube:
    """kubectl and helm on the real control plane, or on the kind cluster."""
    if request.param == "kind":
        kind: Kube = request.getfixturevalue("kind_cluster")
        return kind
    cluster: ControlPlane = request.getfixturevalue("kube_cluster")
    return Kube(cluster.kubeconfig, str(tools.tool("kubectl")), str(tools.tool("helm")))


@pytest.fixture(scope="session")
def ddpjob_install(e2e_cluster: Kube, request: pytest.FixtureRequest) -> Installed:
    if e2e_cluster.cluster:
        installed: Installed = request.getfixturevalue("kind_install")
        return installed
    return install_on_real(e2e_cluster)
