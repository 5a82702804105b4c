"""A real Kubernetes control plane on this machine, with process-kubelet nodes.

:class:`ControlPlane` starts, on loopback only:

* **etcd** (one member, ``--unsafe-no-fsync``);
* **kube-apiserver** with a serving certificate of our own CA, static bearer tokens for every
  component (:mod:`tests.harness.kube.pki`), service-account signing keys, ``Node,RBAC``
  authorization, the admission plugins enabled by default plus ``NodeRestriction`` and
  ``OwnerReferencesPermissionEnforcement``, and an audit log (every request but node
  heartbeats, at ``Metadata`` level) that tests count requests in;
* **kube-controller-manager** with all default controllers, each with its own service-account
  credentials, and node-monitor settings that notice a lost node in seconds:
  ``--node-monitor-period=1s --node-monitor-grace-period=6s`` (the kubelets renew their Lease
  every second);
* **kube-scheduler**;
* **cluster DNS** (:mod:`tests.harness.kube.dns`) on ``10.<c>.0.10:53`` and the ``kubernetes``
  Service on ``10.96.0.1:443`` (:func:`tests.harness.kube.network.forward`), in the cluster's hub;
* **N process kubelets** (:mod:`tests.harness.kube.kubelet`), ``node-1`` ... ``node-N``, each as PID 1
  of a PID namespace of its own: :meth:`lose_node` SIGKILLs one, and the kernel kills every
  process of its pods with it. Its heartbeats stop; nothing else is done for the controllers.
  :meth:`freeze_node` loses one silently instead: every process of its PID namespace stopped
  (SIGSTOP) and every packet to or from its addresses dropped (nftables), so its peers see
  neither an answer nor a reset; :meth:`heal_node` brings it back as it was.

The cluster's network lives in namespaces of its own (:mod:`tests.harness.kube.network`): nothing is
added to the machine's own. Each pod has a network namespace with its address in
``10.<c>.0.0/16`` on a bridge in the cluster's hub namespace, so it has its own port space, as
in a real cluster. Pod addresses cannot be loopback addresses: the API server refuses
127.0.0.0/8 in EndpointSlices ("may not be in the loopback range"), so headless Services, and
with them pod DNS names, would never work. ``<c>`` is picked per cluster, so two clusters can
run at once; node ``i`` has the pod CIDR ``10.<c>.<16 (i + 1)>.0/20``. The kubelets and the
API server stay in the machine's namespace, on loopback: node ``i``'s address is
``127.<c>.0.<i + 1>``, where its kubelet serves ``kubectl logs``. Tests reach a pod by entering
the hub for one connection (:func:`tests.harness.kube.network.connect`).

Every process is started with ``PR_SET_PDEATHSIG``: if the process that started the cluster
dies (a crash of pytest, a SIGKILL), the components die with it, and each node's kubelet takes
its pods along. :meth:`stop` stops everything in order; the work directory keeps every
component's log (``logs/<component>.log``).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import psutil
import requests
import yaml

from tests.harness.kube import build, network, pki, runtime
from tests.harness.kube.client import ApiError, Client, Endpoint

ROOT = Path(__file__).resolve().parents[3]
SERVICE_CIDR = "10.96.0.0/16"
DOMAIN = pki.CLUSTER_DOMAIN
ISSUER = f"https://kubernetes.default.svc.{DOMAIN}"
NODE_MONITOR_PERIOD = "1s"
NODE_MONITOR_GRACE = "6s"
LEASE_RENEW_SECONDS = 1.0
NODE_CAPACITY = {"cpu": "8", "memory": "32Gi", "pods": "250", "ephemeral-storage": "100Gi"}
START_TIMEOUT = 120.0
FEATURE_GATES = {"GenericWorkload": True}
"""Native gang scheduling (beta in 1.37, off by default): the scheduler places a PodGroup's
gang all at once or not at all. Pods that name no PodGroup are not affected."""
RUNTIME_CONFIG = {"scheduling.k8s.io/v1beta1": True}
"""The PodGroup API, beta and therefore not served by default."""
MAX_NODES = 14
"""Pod CIDRs are /20s of a /16; node names beyond ``nodes`` are for :meth:`add_node`."""
MAX_HOLLOW = 16
"""Hollow nodes (:mod:`tests.harness.kube.hollow_nodes`) share the last /20 of the pod range, a /24 each."""
HOLLOW_CAPACITY = {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "1Ti"}
HOLLOW_TAINT = {"key": "ddpjob.io/hollow", "value": "true", "effect": "NoSchedule"}
"""What hollow nodes added to a cluster of process nodes carry, so that only pods that
tolerate it land there (a test's pods must not be hollow by surprise)."""
AUDIT_POLICY = {
    "apiVersion": "audit.k8s.io/v1",
    "kind": "Policy",
    "omitStages": ["RequestReceived"],
    "rules": [
        {"level": "None", "resources": [{"group": "coordination.k8s.io", "resources": ["leases"]}]},
        {"level": "None", "resources": [{"group": "", "resources": ["nodes/status"]}]},
        {"level": "None", "nonResourceURLs": ["/healthz*", "/readyz*", "/livez*", "/version"]},
        {"level": "Metadata"},
    ],
}


class ControlPlaneError(RuntimeError):
    """The control plane did not come up; the message names the component and its log."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the process that started us dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


ROUTES = Path("/run/ddpjob-kube")
"""One file per cluster's pod range, holding the pid of the process that owns it."""
SERVICE_PORT = network.API_SERVICE_PORT


def _routes() -> str:
    return _ip("route", "show", "table", "all").stdout


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=False)


NFT_PACKAGE = "nftables"
"""The Debian package of ``nft``, which :meth:`ControlPlane.freeze_node` drops packets with."""


def nft_table(octet: int) -> str:
    """The ``inet`` table of the cluster of pod range ``10.<octet>.0.0/16``: its set ``frozen``
    holds the pod CIDRs of its frozen nodes, and its ``input`` chain drops every packet from or
    to them. Removed with the range (:func:`_release_pod_range`)."""
    return f"ddpjob-kube-{octet}"


def _nft_command() -> str | None:
    return shutil.which("nft") or shutil.which("nft", path="/usr/sbin:/sbin")


def _nft(*args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    command = _nft_command()
    if command is None:
        raise ControlPlaneError(
            "freezing a node drops its packets with nftables, and `nft` is not installed: "
            f"install Debian's {NFT_PACKAGE} package (apt-get install -y {NFT_PACKAGE}); "
            ".ci/run does"
        )
    argv = [command, *(("-f", "-") if script is not None else args)]
    return subprocess.run(argv, input=script, capture_output=True, text=True, check=False)


def _nft_drop_table(octet: int) -> None:
    """Remove the cluster's table, if there is one (and nft, without which there is none)."""
    if _nft_command() is not None:
        _nft("delete", "table", "inet", nft_table(octet))


def _claim_pod_range() -> int:
    """A second octet ``c`` for the pods' ``10.<c>.0.0/16`` that no route of this machine and no
    other cluster uses, and the cluster's hub namespace. Ranges whose owner died are released
    first."""
    release_abandoned_ranges()
    taken = _routes()
    for _ in range(200):
        octet = random.randint(100, 250)
        if f"10.{octet}." in taken or octet in network.hubs():
            continue
        claim = ROUTES / str(octet)
        try:
            with claim.open("x") as f:
                f.write(str(os.getpid()))
        except FileExistsError:
            continue
        try:
            network.make_hub(octet)
        except network.NetworkError as exc:
            _release_pod_range(octet)
            raise ControlPlaneError(
                f"cannot make the cluster's network ({exc}); the process kubelet needs root "
                "(CAP_NET_ADMIN, CAP_SYS_ADMIN)"
            ) from exc
        return octet
    raise ControlPlaneError("no free 10.<c>.0.0/16 range for the pods of a cluster")


def release_abandoned_ranges() -> list[int]:
    """Release the ranges (hub namespaces, nftables tables, cgroups) of clusters whose starter
    died without cleaning up (a SIGKILL): the kernel removes none of them. Returns their
    octets."""
    ROUTES.mkdir(parents=True, exist_ok=True)
    released = []
    for octet in network.hubs():
        if not (ROUTES / str(octet)).exists():  # its starter died between the two
            network.remove_hub(octet)
    for claim in ROUTES.glob("*"):
        with contextlib.suppress(OSError, ValueError):
            if not Path(f"/proc/{int(claim.read_text())}").exists():
                _release_pod_range(int(claim.name))
                released.append(int(claim.name))
    return released


def _release_pod_range(octet: int) -> None:
    """The cluster's hub namespace, its nftables table and its kubelets' cgroups (its nodes are
    dead by now, and their pods' namespaces with them)."""
    network.remove_hub(octet)
    _nft_drop_table(octet)
    mine = runtime.Cgroups.named("")
    if mine is not None:
        for path in mine.root.glob(f"ddpjob-kube-{octet}-*"):
            runtime.Cgroups(path, mine.v2).remove_all()
    (ROUTES / str(octet)).unlink(missing_ok=True)


@dataclasses.dataclass
class Component:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited after ``timeout`` seconds."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=timeout)

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclasses.dataclass
class ControlPlane:
    workdir: Path
    nodes: int = 3
    images: list[dict[str, Any]] = dataclasses.field(default_factory=runtime.default_images)
    node_capacity: dict[str, str] = dataclasses.field(default_factory=lambda: dict(NODE_CAPACITY))
    components: dict[str, Component] = dataclasses.field(default_factory=dict)
    octet: int = 0
    api_port: int = 0
    bin_dir: Path = dataclasses.field(default_factory=Path)
    pki: pki.Pki | None = None
    frozen: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Frozen node -> the pids (this machine's) stopped when it froze, its kubelet first."""
    nft_ready: bool = False
    feature_gates: dict[str, bool] = dataclasses.field(default_factory=lambda: dict(FEATURE_GATES))
    """Given to the API server, the controller manager and the scheduler."""
    runtime_config: dict[str, bool] = dataclasses.field(
        default_factory=lambda: dict(RUNTIME_CONFIG)
    )
    """API versions the API server serves beyond its defaults (``--runtime-config``)."""
    node_monitor_period: str = NODE_MONITOR_PERIOD
    node_monitor_grace: str = NODE_MONITOR_GRACE
    """How long a node may be silent before it is NotReady (Kubernetes' default is 50 s; the
    tests notice a lost node in seconds)."""
    hollow: int = 0
    """Hollow nodes (:mod:`tests.harness.kube.hollow_nodes`) started with the cluster, untainted."""
    hollow_capacity: dict[str, str] = dataclasses.field(
        default_factory=lambda: dict(HOLLOW_CAPACITY)
    )
    hollow_cut_seconds: float = 5.0
    """How long the hollow agents take to cut the pods of a lost node out of their world."""
    hollow_port: int = 0
    """The hollow process's control endpoint on loopback (0: none runs)."""
    hollow_nodes: list[str] = dataclasses.field(default_factory=list)
    before_controllers: Callable[[ControlPlane], None] | None = None
    """Runs once the API server is up and before the controllers start: CRDs installed then
    are known to the garbage collector from its start (it picks up new kinds only every 30 s,
    and does not collect the dependents of an owner of a kind it did not know)."""

    # ---- addresses and credentials --------------------------------------------------------

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    @property
    def dns_ip(self) -> str:
        return network.dns_address(self.octet)

    @property
    def hub(self) -> Path:
        """The cluster's hub namespace (:mod:`tests.harness.kube.network`): enter it to reach a pod."""
        return network.hub_path(self.octet)

    def node_ip(self, index: int) -> str:
        """Node ``index``'s address, on this machine's loopback (where its kubelet runs)."""
        return f"127.{self.octet}.0.{index + 1}"

    def node_name(self, index: int) -> str:
        return f"node-{index + 1}"

    def hollow_name(self, index: int) -> str:
        return f"hollow-{index + 1}"

    def hollow_cidr(self, index: int) -> str:
        return f"10.{self.octet}.{240 + index}.0/24"

    def is_hollow(self, name: str) -> bool:
        return name in self.hollow_nodes

    def cgroup_name(self, node: str) -> str:
        return f"ddpjob-kube-{self.octet}-{node}"

    def node_names(self) -> list[str]:
        return [self.node_name(i) for i in range(self.nodes)]

    def pod_cidr(self, index: int) -> str:
        return f"10.{self.octet}.{16 * (index + 1)}.0/20"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (``system:masters``)."""
        return self.workdir / "admin.kubeconfig"

    @property
    def audit_log(self) -> Path:
        return self.workdir / "logs" / "audit.log"

    @property
    def ca_cert(self) -> Path:
        assert self.pki is not None
        return self.pki.ca_cert

    def kubeconfig_for(self, user: str, token: str, path: Path) -> Path:
        return pki.write_kubeconfig(
            path, server=self.server, ca_cert=self.ca_cert, token=token, user=user
        )

    def admin(self, agent: str = "ddpjob-tests") -> Client:
        return Client(Endpoint.from_kubeconfig(self.kubeconfig), agent)

    @property
    def fakepod_dir(self) -> Path:
        """Where tests tell :mod:`tests.harness.kube.fakepod` trainers what to do."""
        return self.workdir / "fakepod"

    def audit_size(self) -> int:
        try:
            return self.audit_log.stat().st_size
        except OSError:
            return 0

    def audit(self, since: int = 0) -> list[dict[str, Any]]:
        """The API server's audit events (one per request) written after byte ``since``, a
        size of the log taken earlier (:meth:`audit_size`)."""
        try:
            with self.audit_log.open("rb") as log:
                log.seek(max(0, since - 1))
                data = log.read()
        except OSError:
            return []
        if since > 0:
            # ``since`` may have been taken while the API server wrote a line (it came out
            # mid-line in a whole-suite run): that line began before it, and is not ours.
            data = data[data.find(b"\n") + 1 :]
        # The API server may be writing the last line: only whole lines are read.
        whole = data[: data.rfind(b"\n") + 1]
        return [json.loads(line) for line in whole.splitlines() if line.strip()]

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> ControlPlane:
        if os.geteuid() != 0:
            raise ControlPlaneError(
                "the process kubelets need root (a PID and mount namespace per node, mounts and "
                "hostnames per container, pod addresses on lo): run as root, e.g. sudo -E make test"
            )
        self.bin_dir = build.build()
        self.fakepod_dir.mkdir(parents=True, exist_ok=True)
        self.images = [*self.images, runtime.fake_trainer_image(self.fakepod_dir)]
        for sub in ("logs", "etcd", "nodes"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        self.octet = _claim_pod_range()
        nodes = self.node_names()
        every_node = [self.node_name(i) for i in range(MAX_NODES)]
        every_node += [self.hollow_name(i) for i in range(MAX_HOLLOW)]
        self.pki = pki.make_pki(
            self.workdir / "pki", ips=["127.0.0.1", "10.96.0.1"], nodes=every_node
        )
        self.api_port = free_port()
        self.kubeconfigs = {
            user: self.kubeconfig_for(
                user, self.pki.token(user), self.workdir / f"{user.replace(':', '_')}.kubeconfig"
            )
            for user in self.pki.tokens
        }
        kubeconfigs = self.kubeconfigs
        self.kubeconfig_for("admin", self.pki.token("admin"), self.kubeconfig)
        try:
            self._start_etcd()
            self._start_apiserver()
            if self.before_controllers is not None:
                self.before_controllers(self)
            self._start_controllers(kubeconfigs)
            self._spawn(
                "dns",
                [sys.executable, "-m", "tests.harness.kube.dns", "--kubeconfig", str(self.kubeconfig),
                 "--netns", str(self.hub), "--listen", self.dns_ip, "--domain", DOMAIN],
            )  # fmt: skip
            self._spawn(
                "kubernetes-service",
                [sys.executable, "-m", "tests.harness.kube.network", "--netns", str(self.hub),
                 "--listen", f"{network.API_SERVICE_IP}:{network.API_SERVICE_PORT}",
                 "--to", f"127.0.0.1:{self.api_port}"],
            )  # fmt: skip
            for index in range(len(nodes)):
                self._start_node(index)
            if self.hollow:
                self.add_hollow_nodes(self.hollow, taints=())
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str, argv: Sequence[str], **kwargs: Any) -> Component:
        log_path = self.workdir / "logs" / f"{name}.log"
        log: IO[bytes] = log_path.open("ab")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        env.pop("KUBECONFIG", None)
        process = subprocess.Popen(
            list(argv), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            cwd=ROOT, env=env, preexec_fn=_die_with_parent, **kwargs,  # noqa: PLW1509
        )  # fmt: skip
        log.close()
        component = Component(name, process, log_path)
        self.components[name] = component
        return component

    def _bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def _start_etcd(self) -> None:
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self._spawn(
            "etcd",
            [
                self._bin("etcd"), "--name", "default",
                "--data-dir", str(self.workdir / "etcd"),
                "--listen-client-urls", self.etcd_url,
                "--advertise-client-urls", self.etcd_url,
                "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                "--initial-cluster", f"default=http://127.0.0.1:{peer}",
                "--listen-metrics-urls", f"http://127.0.0.1:{free_port()}",
                "--unsafe-no-fsync", "--log-level", "warn",
            ],
        )  # fmt: skip
        self._wait("etcd", lambda: requests.get(f"{self.etcd_url}/health", timeout=2).ok)

    def _start_apiserver(self) -> None:
        assert self.pki is not None
        policy = self.workdir / "audit-policy.yaml"
        policy.write_text(yaml.safe_dump(AUDIT_POLICY))
        self._spawn(
            "kube-apiserver",
            [
                self._bin("kube-apiserver"),
                f"--etcd-servers={self.etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--tls-cert-file={self.pki.serving_cert}",
                f"--tls-private-key-file={self.pki.serving_key}",
                f"--client-ca-file={self.pki.ca_cert}",
                f"--token-auth-file={self.pki.token_file}",
                f"--service-account-issuer={ISSUER}",
                f"--api-audiences={ISSUER}",
                f"--service-account-key-file={self.pki.sa_pub}",
                f"--service-account-signing-key-file={self.pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction,OwnerReferencesPermissionEnforcement",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--kubelet-preferred-address-types=InternalIP",
                f"--audit-policy-file={policy}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-maxsize=0",
                "--profiling=false",
                *self._gates(),
                *(
                    [f"--runtime-config={_pairs(self.runtime_config)}"]
                    if self.runtime_config
                    else []
                ),
            ],
        )
        self._wait("kube-apiserver", self._apiserver_ready)

    def _apiserver_ready(self) -> bool:
        assert self.pki is not None
        response = requests.get(
            f"{self.server}/readyz",
            headers={"Authorization": f"Bearer {self.pki.token('admin')}"},
            verify=str(self.pki.ca_cert),
            timeout=2,
        )
        return response.status_code == 200

    def _start_controllers(self, kubeconfigs: dict[str, Path]) -> None:
        assert self.pki is not None
        self._spawn(
            "kube-controller-manager",
            [
                self._bin("kube-controller-manager"),
                f"--kubeconfig={kubeconfigs['system:kube-controller-manager']}",
                "--leader-elect=false",
                "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.pki.sa_key}",
                f"--root-ca-file={self.pki.ca_cert}",
                f"--node-monitor-period={self.node_monitor_period}",
                f"--node-monitor-grace-period={self.node_monitor_grace}",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                *self._gates(),
            ],
        )
        self._spawn(
            "kube-scheduler",
            [
                self._bin("kube-scheduler"),
                f"--kubeconfig={kubeconfigs['system:kube-scheduler']}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                "--secure-port=0",
                *self._gates(),
            ],
        )

    def _gates(self) -> list[str]:
        return [f"--feature-gates={_pairs(self.feature_gates)}"] if self.feature_gates else []

    def _start_node(self, index: int) -> None:
        name = self.node_name(index)
        # The pod range is this node's again (a lost node's was answered for by the hub), and
        # no port of an earlier node of this range is left to collide with its pods' veths.
        network.answer_for(self.octet, self.pod_cidr(index), on=False)
        network.remove_ports(self.octet, self.pod_cidr(index))
        kubeconfig = self.kubeconfigs[f"system:node:{name}"]
        root = self.workdir / "nodes" / name
        root.mkdir(parents=True, exist_ok=True)
        config = {
            "node": name,
            "pod_cidr": self.pod_cidr(index),
            "kubeconfig": str(kubeconfig),
            "api_host": "127.0.0.1",
            "api_port": self.api_port,
            "dns": self.dns_ip,
            "octet": self.octet,
            "node_ip": self.node_ip(index),
            "domain": DOMAIN,
            "root": str(root),
            "capacity": self.node_capacity,
            "images": self.images,
            "lease_seconds": 10,
            "renew_seconds": LEASE_RENEW_SECONDS,
            "status_seconds": 10.0,
            "version": build.kubernetes_version(),
            "cgroup": self.cgroup_name(name),
        }
        config_path = root / "config.json"
        config_path.write_text(json.dumps(config, indent=1))
        self._spawn(
            name,
            [
                "unshare", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
                sys.executable, "-m", "tests.harness.kube.kubelet", str(config_path),
            ],
        )  # fmt: skip

    def _wait(self, name: str, ready: Callable[[], bool], timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        component = self.components[name]
        while time.monotonic() < deadline:
            if not component.alive():
                raise ControlPlaneError(
                    f"{name} exited with code {component.process.returncode} while starting; "
                    f"its log ({component.log_path}) ends with:\n{component.tail()}"
                )
            with contextlib.suppress(requests.RequestException, ApiError, OSError):
                if ready():
                    return
            time.sleep(0.2)
        raise ControlPlaneError(
            f"{name} was not ready after {timeout:.0f}s; its log ({component.log_path}) ends "
            f"with:\n{component.tail()}"
        )

    def _wait_ready(self) -> None:
        """Every node Ready and untainted, and the default ServiceAccount and root CA there."""
        admin = self.admin()
        self._wait_nodes(self.node_names())
        self._wait(
            "kube-controller-manager",
            lambda: (
                bool(admin.get("/api/v1/namespaces/default/serviceaccounts/default"))
                and bool(admin.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt"))
            ),
        )

    def _wait_nodes(self, names: Sequence[str]) -> None:
        admin = self.admin()

        def nodes_ready() -> bool:
            for node in names:
                component = self.components["hollow" if self.is_hollow(node) else node]
                if not component.alive():
                    raise ControlPlaneError(
                        f"{node}'s kubelet exited; its log ends with:\n{component.tail()}"
                    )
            items = admin.get("/api/v1/nodes").get("items") or []
            ready = {
                n["metadata"]["name"]
                for n in items
                if any(
                    c["type"] == "Ready" and c["status"] == "True"
                    for c in n.get("status", {}).get("conditions") or []
                )
                and not [
                    t
                    for t in (n.get("spec") or {}).get("taints") or []
                    if t.get("key") != HOLLOW_TAINT["key"]
                ]
            }
            return ready >= set(names)

        self._wait(
            "hollow" if any(map(self.is_hollow, names)) else "kube-controller-manager", nodes_ready
        )
        self._wait(
            "kube-controller-manager",
            lambda: (
                bool(admin.get("/api/v1/namespaces/default/serviceaccounts/default"))
                and bool(admin.get("/api/v1/namespaces/default/configmaps/kube-root-ca.crt"))
            ),
        )

    # ---- faults ---------------------------------------------------------------------------

    def add_node(self) -> str:
        """One more node, Ready when this returns."""
        index = next(i for i in range(MAX_NODES) if self.node_name(i) not in self.components)
        self._start_node(index)
        self._wait_nodes([self.node_name(index)])
        return self.node_name(index)

    def revive_node(self, name: str) -> None:
        """A lost node comes back: a new kubelet for it (its processes are gone), Ready again.
        A hollow node reports again instead, its pods as they were (:mod:`tests.harness.kube.hollow_nodes`)."""
        if self.is_hollow(name):
            self._hollow_call("POST", "/revive", {"node": name})
            self._wait_nodes([name])
            return
        self._let_through(name)
        index = self._index(name)
        self._start_node(index)
        self._wait_nodes([name])

    def remove_node(self, name: str) -> None:
        """The node is gone for good: its kubelet (if any) and its Node object."""
        self._let_through(name)
        component = self.components.pop(name, None)
        if component is not None and component.alive():
            component.process.kill()
            component.process.wait(timeout=30)
        with contextlib.suppress(ApiError):
            self.admin().delete(f"/api/v1/nodes/{name}")

    def lose_node(self, name: str) -> None:
        """The node is gone, loudly: its kubelet and every process of its pods die at once
        (SIGKILL of its PID namespace), so their connections are reset or ended, and the hub
        answers for its pod range from then on (a connect is refused, as by a machine whose
        processes died). Its heartbeats stop; the controllers must notice by themselves.
        :meth:`freeze_node` is the silent loss. A hollow node stops reporting (its pods' agents
        fall silent): :mod:`tests.harness.kube.hollow_nodes`."""
        if self.is_hollow(name):
            self._hollow_call("POST", "/lose", {"node": name})
            return
        component = self.components[name]
        component.process.send_signal(signal.SIGKILL)
        component.process.wait(timeout=30)
        network.answer_for(self.octet, self.node_addresses(name), on=True)

    def freeze_node(self, name: str) -> list[int]:
        """The node is lost silently (a machine hung, or cut off without a reset): its pods'
        bridge ports go down and every packet from or to its node address is dropped, then
        every process of its PID namespace is stopped (SIGSTOP), its kubelet first. Its peers'
        connects and requests time out; nothing answers, nothing resets. The controllers and
        the operator see what :meth:`lose_node` shows them (the heartbeats stop).

        Returns the pids stopped (this machine's), the kubelet's first. Needs ``nft``
        (:data:`NFT_PACKAGE`) for the node address on loopback: without it this fails with the
        package to install."""
        if name in self.frozen:
            raise ControlPlaneError(f"{name} is already frozen")
        if self.is_hollow(name):  # a hollow node's loss is silent already
            self.lose_node(name)
            self.frozen[name] = []
            return []
        kubelet = self._kubelet(name)
        self._drop_packets(name)
        self.frozen[name] = [kubelet.pid]
        try:
            self.frozen[name] = _stop_namespace(kubelet)
        except BaseException:
            self.heal_node(name, wait=False)
            raise
        return list(self.frozen[name])

    def heal_node(self, name: str, *, wait: bool = True) -> None:
        """A frozen node comes back as it was: its packets pass again, then every process of
        its PID namespace continues (SIGCONT), its kubelet first. With ``wait``, returns once
        the node is Ready and untainted again (its kubelet's next heartbeats)."""
        self.frozen.pop(name, None)
        if self.is_hollow(name):
            self._hollow_call("POST", "/revive", {"node": name})
            if wait:
                self._wait_nodes([name])
            return
        self._let_through(name)
        component = self.components.get(name)
        if component is not None and component.alive():
            kubelet = self._kubelet(name)
            for process in [kubelet, *_namespace_members(kubelet)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    process.send_signal(signal.SIGCONT)
            if wait:
                self._wait_nodes([name])

    # ---- hollow nodes ---------------------------------------------------------------------

    def add_hollow_nodes(
        self,
        count: int,
        *,
        taints: Sequence[dict[str, str]] = (HOLLOW_TAINT,),
        capacity: dict[str, str] | None = None,
    ) -> list[str]:
        """``count`` hollow nodes (:mod:`tests.harness.kube.hollow_nodes`), run by one process, Ready when
        this returns; by default tainted :data:`HOLLOW_TAINT`. One set per cluster."""
        if self.hollow_nodes:
            raise ControlPlaneError(f"hollow nodes run already: {', '.join(self.hollow_nodes)}")
        if not 1 <= count <= MAX_HOLLOW:
            raise ControlPlaneError(f"hollow nodes: 1 to {MAX_HOLLOW}, not {count}")
        from tests.harness.kube import hollow_nodes as hollow  # noqa: PLC0415 - only with hollow nodes

        names = [self.hollow_name(i) for i in range(count)]
        self.hollow_port = free_port()
        config = hollow.Config(
            nodes=[
                hollow.NodeConfig(
                    name=name,
                    pod_cidr=self.hollow_cidr(i),
                    node_ip=f"127.{self.octet}.1.{i + 1}",
                    kubeconfig=self.kubeconfigs[f"system:node:{name}"],
                )
                for i, name in enumerate(names)
            ],
            capacity=capacity or self.hollow_capacity,
            control_port=self.hollow_port,
            taints=[dict(t) for t in taints],
            hub=str(self.hub),
            agent_range=f"10.{self.octet}.240.0/20",
            cut_seconds=self.hollow_cut_seconds,
            renew_seconds=LEASE_RENEW_SECONDS,
            version=build.kubernetes_version(),
        )
        path = self.workdir / "hollow.json"
        path.write_text(config.dump())
        self._spawn("hollow", [sys.executable, "-m", "tests.harness.kube.hollow_nodes", str(path)])
        self.hollow_nodes = names
        self._wait_nodes(names)
        return names

    def remove_hollow_nodes(self) -> None:
        """Stop the hollow process and delete its Node objects."""
        component = self.components.pop("hollow", None)
        if component is not None:
            component.stop()
        admin = self.admin()
        for name in self.hollow_nodes:
            with contextlib.suppress(ApiError):
                admin.delete(f"/api/v1/nodes/{name}")
        self.hollow_nodes = []
        self.hollow_port = 0

    def hollow_exit(
        self,
        namespace: str,
        pods: Sequence[str] = (),
        selector: dict[str, str] | None = None,
        code: int = 0,
    ) -> int:
        """The containers of hollow pods (by name, or by label) exit with ``code``; how many
        pods were told."""
        body = {"namespace": namespace, "pods": list(pods), "selector": selector or {}}
        answer = self._hollow_call("POST", "/exit", {**body, "code": code})
        return int(answer["told"])

    def hollow_stats(self) -> dict[str, Any]:
        """The hollow agents' connections per second, pods per node, lost nodes."""
        return self._hollow_call("GET", "/stats")

    def _hollow_call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        if not self.hollow_port:
            raise ControlPlaneError("no hollow nodes run in this cluster")
        response = requests.request(
            method, f"http://127.0.0.1:{self.hollow_port}{path}", json=body, timeout=30
        )
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def node_addresses(self, name: str) -> str:
        """The node's pod range (its pods' addresses, in the hub)."""
        return self.pod_cidr(self._index(name))

    def container_log(self, node: str, uid: str, container: str, restart: int = 0) -> Path:
        """Where the node's kubelet writes a container's log (moved to the node's ``gone/``
        directory, ``<namespace>_<pod>_<uid>/logs/``, once it forgets the pod)."""
        return self.workdir / "nodes" / node / "pods" / uid / "logs" / container / f"{restart}.log"

    def _index(self, name: str) -> int:
        return int(name.rsplit("-", 1)[1]) - 1

    def _kubelet(self, name: str) -> psutil.Process:
        """The node's kubelet: the child of its ``unshare``, PID 1 of the node's namespace."""
        component = self.components[name]
        if not component.alive():
            raise ControlPlaneError(f"{name}'s kubelet is not running (a lost node?)")
        children = psutil.Process(component.process.pid).children()
        if len(children) != 1:
            raise ControlPlaneError(f"{name}: unshare has {len(children)} children, not 1")
        return children[0]

    def _drop_packets(self, name: str) -> None:
        if not self.nft_ready:
            table = nft_table(self.octet)
            created = _nft(
                script=(
                    f"table inet {table} {{\n"
                    "  set frozen { type ipv4_addr; flags interval; }\n"
                    # Input, not output: a packet between two addresses on lo goes out and
                    # comes back in; dropped on its way in, it is lost as on a wire (a drop on
                    # the way out tells a UDP sender EPERM).
                    "  chain input {\n"
                    "    type filter hook input priority filter; policy accept;\n"
                    "    ip saddr @frozen drop\n"
                    "    ip daddr @frozen drop\n"
                    "  }\n"
                    "}\n"
                )
            )
            if created.returncode != 0:
                raise ControlPlaneError(f"nft: cannot make table {table}: {created.stderr.strip()}")
            self.nft_ready = True
        address = self.node_ip(self._index(name))
        added = _nft("add", "element", "inet", nft_table(self.octet), "frozen", f"{{ {address} }}")
        if added.returncode != 0:
            raise ControlPlaneError(f"nft: cannot drop {address}: {added.stderr.strip()}")
        network.set_ports(self.octet, self.node_addresses(name), up=False)

    def _let_through(self, name: str) -> None:
        network.set_ports(self.octet, self.node_addresses(name), up=True)
        if self.nft_ready:
            address = self.node_ip(self._index(name))
            _nft("delete", "element", "inet", nft_table(self.octet), "frozen", f"{{ {address} }}")

    def node_of(self, namespace: str, pod: str) -> str:
        body = self.admin().get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        return str(body["spec"]["nodeName"])

    # ---- diagnostics and the end ----------------------------------------------------------

    def tails(self, lines: int = 30) -> str:
        parts = []
        for name, component in self.components.items():
            state = "running" if component.alive() else f"exited {component.process.returncode}"
            parts.append(f"---- {name} ({state}) {component.log_path}\n{component.tail(lines)}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Nodes first (their pods die with them; frozen ones are healed first, so that their
        kubelets stop as the others do), then the controllers, the API server, etcd."""
        for name in list(self.frozen):
            self.heal_node(name, wait=False)
        order = [n for n in self.components if n.startswith("node-") or n == "hollow"]
        order += [
            n
            for n in ("dns", "kubernetes-service", "kube-scheduler", "kube-controller-manager")
            if n in self.components
        ]
        order += [n for n in ("kube-apiserver", "etcd") if n in self.components]
        for name in order:
            self.components[name].stop()
        if self.octet:
            _release_pod_range(self.octet)
            self.octet = 0

    def __enter__(self) -> ControlPlane:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


FREEZE_PASS_SECONDS = 0.01
FREEZE_TIMEOUT = 10.0


def _pairs(settings: dict[str, bool]) -> str:
    return ",".join(f"{name}={str(on).lower()}" for name, on in sorted(settings.items()))


def _namespace_members(kubelet: psutil.Process) -> list[psutil.Process]:
    """Every process of the PID namespace whose PID 1 is ``kubelet``, but the kubelet (every
    process of the node's pods, orphans re-parented to the kubelet included)."""
    namespace = os.readlink(f"/proc/{kubelet.pid}/ns/pid")
    members = []
    for process in psutil.process_iter():
        if process.pid == kubelet.pid:
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{process.pid}/ns/pid") == namespace:
                members.append(process)
    return members


def _stop_namespace(kubelet: psutil.Process) -> list[int]:
    """SIGSTOP the kubelet, then every process of its PID namespace, until a walk finds all of
    them stopped: a process forked while a walk ran is caught by the next (a stopped process
    forks no more). Returns their pids, the kubelet's first."""
    stopped = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
    seen = [kubelet.pid]
    deadline = time.monotonic() + FREEZE_TIMEOUT
    while True:
        running = []
        for process in [kubelet, *_namespace_members(kubelet)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                state = process.status()
                if process.pid not in seen:
                    seen.append(process.pid)
                if state not in stopped and state != psutil.STATUS_ZOMBIE:
                    running.append(process)
        if not running:
            return seen
        if time.monotonic() > deadline:
            raise ControlPlaneError(
                f"could not stop {[p.pid for p in running]} within {FREEZE_TIMEOUT:g}s "
                "(a process in uninterruptible sleep?)"
            )
        for process in running:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(signal.SIGSTOP)
        time.sleep(FREEZE_PASS_SECONDS)


@contextlib.contextmanager
def control_plane(workdir: Path, nodes: int = 3) -> Iterator[ControlPlane]:
    with ControlPlane(workdir, nodes=nodes) as cluster:
        yield cluster
