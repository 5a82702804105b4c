"""The real Kueue controller, run against the tests' control plane (:mod:`tests.harness.kube`).

:class:`Kueue` starts the binary :mod:`tests.harness.kueue.build` made, on loopback only, as one more
component of a :class:`~tests.harness.kube.controlplane.ControlPlane` (its log is
``logs/kueue.log`` in the cluster's work directory, and the cluster's report of a failed test
shows its last lines):

* Kueue's CRDs (:func:`tests.harness.kueue.build.crd_bases`) are applied server-side (the workloads
  CRD is 1.4 MB, too big for a client-side apply's annotation) and waited for Established;
* a ``Configuration`` (``config.kueue.x-k8s.io/v1beta2``): leader election off, the health
  probe and the webhook server on free ports of 127.0.0.1, metrics off, internal certificate
  management off (the webhook's certificate is ours, :func:`tests.harness.kube.pki.serving_cert`),
  ``batch/job`` and DDPJob (``DDPJob.v1alpha1.ddpjob.io``, an external framework) as
  integrations; ``--feature-gates=VisibilityOnDemand=false`` (else it serves an aggregated
  visibility API on :8082);
* Kueue runs with the admin kubeconfig, dies with the process that started it
  (``PR_SET_PDEATHSIG``), and in a mount namespace of its own: v0.19.2 reads a metrics
  certificate from the hard-coded ``/etc/kueue/metrics/certs`` whenever internal certificate
  management is off, even with metrics off. There a tmpfs (on ``/etc/kueue`` if the machine
  has one, else under an overlay of ``/etc``) holds a certificate we mint; the machine's
  ``/etc`` is never written;
* only Kueue's own webhooks (those whose rules are all in ``kueue.x-k8s.io``: workloads,
  clusterqueues, resourceflavors, cohorts) are registered, by URL on 127.0.0.1, never the
  pod, job or other frameworks' webhooks: those would catch every pod of the shared cluster,
  and fail them all once Kueue is gone (failurePolicy Fail). :meth:`Kueue.stop` removes them
  first.

Ready means ``/readyz`` answers 200 and a dry-run create of a ResourceFlavor passes both of
its webhooks.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import subprocess
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import requests
import yaml

from tests.harness import tools
from tests.harness.kube import pki
from tests.harness.kube.client import ApiError
from tests.harness.kube.controlplane import Component, ControlPlane, free_port
from tests.harness.kueue import build

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API = f"/apis/{GROUP}/{VERSION}"
NAMESPACE = "kueue-system"
COMPONENT = "kueue"
START_TIMEOUT = 120.0
FEATURE_GATES = {"VisibilityOnDemand": False}
FRAMEWORKS = ("batch/job",)
EXTERNAL_FRAMEWORKS = ("DDPJob.v1alpha1.ddpjob.io",)
METRICS_CERTS = Path("/etc/kueue/metrics/certs")
"""Where Kueue v0.19.2 reads its metrics certificate from, whatever it is told
(``cmd/kueue/main.go``), inside its own mount namespace."""
WEBHOOK_CONFIGS = {
    "MutatingWebhookConfiguration": "ddpjob-tests-kueue-mutating",
    "ValidatingWebhookConfiguration": "ddpjob-tests-kueue-validating",
}
JSON = dict[str, Any]

# Run by `unshare --mount --propagation private` (so no mount leaves the namespace):
# $1 a directory to hold a tmpfs, $2 the metrics certificate's directory, then Kueue's argv.
_IN_NAMESPACE = """\
set -eu
tmp=$1 certs=$2
shift 2
mount -t tmpfs -o mode=0700 ddpjob-kueue "$tmp"
if [ -d /etc/kueue ]; then
  mount -t tmpfs -o mode=0755 ddpjob-kueue-etc /etc/kueue
else
  mkdir "$tmp/upper" "$tmp/work"
  mount -t overlay ddpjob-kueue-etc -o "lowerdir=/etc,upperdir=$tmp/upper,workdir=$tmp/work" /etc
fi
mkdir -p /etc/kueue/metrics/certs
cp "$certs/tls.crt" "$certs/tls.key" /etc/kueue/metrics/certs/
exec "$@"
"""


class KueueError(RuntimeError):
    """Kueue did not start; the message is one line that names its log."""


def kubectl(cluster: ControlPlane, *args: str, stdin: str | None = None) -> str:
    """Real ``kubectl`` as admin; a failure raises :class:`KueueError` with its stderr."""
    result = subprocess.run(
        [str(tools.tool("kubectl")), f"--kubeconfig={cluster.kubeconfig}", *args],
        input=stdin, capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    if result.returncode != 0:
        raise KueueError(f"kubectl {' '.join(args[:3])} failed: {result.stderr.strip()[:500]}")
    return result.stdout


def crd_names() -> list[str]:
    """``<plural>.kueue.x-k8s.io`` for every CRD file of :func:`build.crd_bases`."""
    names = []
    for path in sorted(build.crd_bases().glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        names.append(str(doc["metadata"]["name"]))
    return names


def install_crds(cluster: ControlPlane) -> None:
    """Apply Kueue's CRDs server-side and wait until each is Established. Usable as a
    ``before_controllers`` hook too, so that the garbage collector knows Workloads from its
    start."""
    kubectl(cluster, "apply", "--server-side", "--force-conflicts", "-f", str(build.crd_bases()))
    crds = [f"crd/{name}" for name in crd_names()]
    kubectl(cluster, "wait", "--for=condition=Established", *crds, "--timeout=60s")


def own_webhooks(manifests: str, url: str, ca_bundle: bytes) -> list[JSON]:
    """Kueue's webhook configurations with only the webhooks whose every rule is in
    ``kueue.x-k8s.io``, each called at ``url`` + its path and trusting ``ca_bundle``."""
    configs = []
    for doc in yaml.safe_load_all(manifests):
        if not doc or doc.get("kind") not in WEBHOOK_CONFIGS:
            continue
        hooks = []
        for hook in doc.get("webhooks") or []:
            groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups") or []}
            if groups != {GROUP}:
                continue
            path = hook["clientConfig"]["service"]["path"]
            hooks.append(
                {
                    **hook,
                    "clientConfig": {
                        "url": f"{url}{path}",
                        "caBundle": base64.b64encode(ca_bundle).decode(),
                    },
                    "timeoutSeconds": 10,
                }
            )
        if hooks:
            configs.append(
                {
                    "apiVersion": doc["apiVersion"],
                    "kind": doc["kind"],
                    "metadata": {"name": WEBHOOK_CONFIGS[doc["kind"]]},
                    "webhooks": hooks,
                }
            )
    return configs


@dataclasses.dataclass
class Kueue:
    """The Kueue controller of one :class:`ControlPlane`: :meth:`start`, :meth:`stop`, or use
    it as a context manager."""

    cluster: ControlPlane
    feature_gates: dict[str, bool] = dataclasses.field(default_factory=lambda: dict(FEATURE_GATES))
    frameworks: tuple[str, ...] = FRAMEWORKS
    external_frameworks: tuple[str, ...] = EXTERNAL_FRAMEWORKS
    webhook_port: int = 0
    health_port: int = 0
    component: Component | None = None
    webhooks: list[str] = dataclasses.field(default_factory=list)
    """``<kind>/<name>`` of the webhooks registered (``validating/vworkload.kb.io``...)."""
    started_seconds: float = 0.0
    """How long :meth:`start` took, CRDs included."""

    @property
    def workdir(self) -> Path:
        return self.cluster.workdir / "kueue"

    @property
    def log_path(self) -> Path:
        return self.cluster.workdir / "logs" / f"{COMPONENT}.log"

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.webhook_port}"

    def configuration(self, cert_dir: Path) -> JSON:
        return {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "namespace": NAMESPACE,
            "leaderElection": {"leaderElect": False},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.health_port}"},
            "metrics": {"bindAddress": "0"},
            "webhook": {"host": "127.0.0.1", "port": self.webhook_port, "certDir": str(cert_dir)},
            "internalCertManagement": {"enable": False},
            "integrations": {
                "frameworks": list(self.frameworks),
                "externalFrameworks": list(self.external_frameworks),
            },
        }

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> Kueue:
        began = time.monotonic()
        binary = build.build(quiet=True) / build.BINARY
        etc_had_kueue = Path("/etc/kueue").exists()
        install_crds(self.cluster)
        with contextlib.suppress(ApiError):  # 409: there already
            self.cluster.admin().create("/api/v1/namespaces", {"metadata": {"name": NAMESPACE}})
        self.workdir.mkdir(parents=True, exist_ok=True)
        webhook_cert = pki.serving_cert(self.workdir / "webhook-certs", "kueue-webhook")
        metrics_cert = pki.serving_cert(self.workdir / "metrics-certs", "kueue-metrics")
        self.webhook_port, self.health_port = free_port(), free_port()
        config_path = self.workdir / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.configuration(webhook_cert.cert.parent)))
        mount_dir = self.workdir / "etc-mount"
        mount_dir.mkdir(exist_ok=True)
        gates = ",".join(f"{k}={str(v).lower()}" for k, v in sorted(self.feature_gates.items()))
        argv = [
            "unshare", "--mount", "--propagation", "private", "--",
            "sh", "-c", _IN_NAMESPACE, "kueue-etc", str(mount_dir), str(metrics_cert.cert.parent),
            str(binary), f"--config={config_path}", f"--kubeconfig={self.cluster.kubeconfig}",
            *([f"--feature-gates={gates}"] if gates else []),
        ]  # fmt: skip
        # The cluster's own spawn: PR_SET_PDEATHSIG, its logs directory, its failure report.
        self.component = self.cluster._spawn(COMPONENT, argv)
        try:
            self._wait(self._healthy, "/readyz")
            self._register_webhooks(webhook_cert.ca_cert.read_bytes())
            self._wait(self._webhooks_answer, "a dry-run create through its webhooks")
        except BaseException:
            self.stop()
            raise
        if not etc_had_kueue and Path("/etc/kueue").exists():
            self.stop()
            raise KueueError("/etc/kueue appeared on the machine: the mount namespace leaked")
        self.started_seconds = time.monotonic() - began
        return self

    def stop(self) -> None:
        """Unregister the webhooks (every write of a Kueue object would fail without Kueue),
        then SIGTERM Kueue (SIGKILL after 10 s)."""
        admin = self.cluster.admin()
        for kind, name in WEBHOOK_CONFIGS.items():
            plural = kind.lower() + "s"
            with contextlib.suppress(ApiError):
                admin.delete(f"/apis/admissionregistration.k8s.io/v1/{plural}/{name}")
        self.webhooks = []
        if self.component is not None and self.component.alive():
            self.component.stop()

    def __enter__(self) -> Kueue:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def alive(self) -> bool:
        return self.component is not None and self.component.alive()

    # ---- readiness ------------------------------------------------------------------------

    def _healthy(self) -> bool:
        answer = requests.get(f"http://127.0.0.1:{self.health_port}/readyz", timeout=2)
        return answer.status_code == 200

    def _webhooks_answer(self) -> bool:
        probe = {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "ResourceFlavor",
            "metadata": {"name": "ddpjob-tests-webhook-probe"},
        }
        self.cluster.admin().request(
            "POST", f"{API}/resourceflavors", probe, params={"dryRun": "All"}
        )
        return True

    def _register_webhooks(self, ca_bundle: bytes) -> None:
        configs = own_webhooks(build.webhook_manifests().read_text(), self.webhook_url, ca_bundle)
        kubectl(
            self.cluster, "apply", "--server-side", "--force-conflicts", "-f", "-",
            stdin="\n---\n".join(json.dumps(c) for c in configs),
        )  # fmt: skip
        self.webhooks = [
            f"{c['kind'].removesuffix('WebhookConfiguration').lower()}/{h['name']}"
            for c in configs
            for h in c["webhooks"]
        ]

    def _wait(self, ready: Callable[[], bool], what: str, timeout: float = START_TIMEOUT) -> None:
        assert self.component is not None
        deadline = time.monotonic() + timeout
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not self.component.alive():
                raise KueueError(
                    f"Kueue exited with code {self.component.process.returncode} while "
                    f"starting; see its log {self.log_path}: {self._last_line()}"
                )
            try:
                if ready():
                    return
            except (requests.RequestException, ApiError, OSError) as exc:
                last = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            time.sleep(0.3)
        raise KueueError(
            f"Kueue was not ready ({what}) after {timeout:.0f}s (last: {last}); see its log "
            f"{self.log_path}: {self._last_line()}"
        )

    def _last_line(self) -> str:
        assert self.component is not None
        lines = self.component.tail(1).splitlines()
        return lines[-1][:300] if lines else "(empty)"

    # ---- objects --------------------------------------------------------------------------

    def path(self, resource: str, name: str = "", namespace: str = "") -> str:
        """The API path of a Kueue object (or collection)."""
        where = f"/namespaces/{namespace}" if namespace else ""
        return f"{API}{where}/{resource}" + (f"/{name}" if name else "")

    def apply(self, obj: Mapping[str, Any]) -> JSON:
        """Server-side apply one object as the tests' field manager; returns it."""
        meta = obj["metadata"]
        plural = str(obj["kind"]).lower() + "s"
        return self.cluster.admin().request(
            "PATCH",
            self.path(plural, meta["name"], meta.get("namespace", "")),
            dict(obj),
            params={"fieldManager": "ddpjob-tests", "force": "true"},
            content_type="application/apply-patch+yaml",
        )
