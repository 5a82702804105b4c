"""A kind cluster on the node image built here, reachable from the machine's own namespace.

``kind create cluster`` runs against the Docker daemon of :mod:`tests.harness.kind.docker`, which lives
in a network namespace of its own: the nodes, their bridge (``kind``) and the API server's
published port exist only there. This module then does what kind's default CNI (kindnetd, which
the module proxy does not serve and this project does not vendor) would have done, and makes
the API server reachable on 127.0.0.1:

1. **The config**: ``networking.disableDefaultCNI: true``, the API server on the daemon
   namespace's 127.0.0.1, ``failCgroupV1: false`` for the kubelets (this machine has cgroup v1;
   the node image sets the flag too), one control-plane node and ``nodes - 1`` workers.
2. **The pod network**: once the controller-manager has given each node its ``spec.podCIDR``,
   every node gets a CNI conflist (``ptp`` with ``host-local`` IPAM on its range, IP masquerade,
   ``portmap``; the plugins are in the node image) and a route to every other node's range
   through that node's address on the ``kind`` bridge. The nodes' kubelets then go Ready, and
   CoreDNS starts.
3. **The API server on 127.0.0.1**: a :class:`Forwarder` listens on a free port of the
   machine's loopback and connects each client into the daemon's namespace, to the port Docker
   published there. The kubeconfig this module writes points at the forwarder; the API
   server's certificate names 127.0.0.1 (kind asks kubeadm for it), so TLS checks out.

Faults act on the node containers as on real machines: :meth:`KindCluster.kill` (``docker
kill``: loud, its connections end), :meth:`KindCluster.pause` (``docker pause``: frozen,
nothing answers and nothing is refused) and :meth:`KindCluster.disconnect` (``docker network
disconnect``: partitioned).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.harness.kind.docker import MADE_MODULES_MARKER
from tests.harness.kube import network

log = logging.getLogger("tests.harness.kind.cluster")

NETWORK = "kind"
"""The Docker network kind puts its nodes on."""
POD_SUBNET = "10.244.0.0/16"
SERVICE_SUBNET = "10.96.0.0/16"
CNI_CONFLIST = "/etc/cni/net.d/10-ddpjob.conflist"
MODULES_DIR = Path("/lib/modules")


class ClusterError(RuntimeError):
    """The cluster could not be made or reached; the message names the step and where to look."""


def kind_config(nodes: int, mounts: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The kind ``Cluster`` config for ``nodes`` nodes (one of them the control plane).

    ``mounts`` maps a directory of this machine to a path in every node: a ``hostPath``
    volume at that path is then one directory that every node shares (the e2e suite keeps the
    example's checkpoints there, so a pod replaced on another node resumes from them).
    """
    if nodes < 1:
        raise ValueError(f"a kind cluster needs at least 1 node, not {nodes}")
    extra = [{"hostPath": host, "containerPath": path} for host, path in (mounts or {}).items()]
    node: dict[str, Any] = {"extraMounts": extra} if extra else {}
    return {
        "kind": "Cluster",
        "apiVersion": "kind.x-k8s.io/v1alpha4",
        "networking": {
            "disableDefaultCNI": True,
            "apiServerAddress": "127.0.0.1",
            "podSubnet": POD_SUBNET,
            "serviceSubnet": SERVICE_SUBNET,
            "kubeProxyMode": "iptables",
        },
        "kubeadmConfigPatches": [
            "kind: KubeletConfiguration\nfailCgroupV1: false\n",
        ],
        "nodes": [{"role": "control-plane", **node}]
        + [{"role": "worker", **node} for _ in range(nodes - 1)],
    }


def cni_conflist(pod_cidr: str) -> dict[str, Any]:
    """The CNI config of a node whose pods get addresses in ``pod_cidr``."""
    ipaddress.ip_network(pod_cidr)  # a ValueError names a bad range before a node sees it
    return {
        "cniVersion": "1.0.0",
        "name": "ddpjob",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": True,
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": pod_cidr}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def routes(node_ranges: Mapping[str, tuple[str, str]]) -> dict[str, list[str]]:
    """``ip route`` arguments per node: every other node's pod range through that node.

    ``node_ranges`` maps a node's container name to ``(its address on the kind network, its
    pod CIDR)``.
    """
    return {
        node: [
            f"{cidr} via {address}"
            for other, (address, cidr) in sorted(node_ranges.items())
            if other != node
        ]
        for node in node_ranges
    }


# ---- the API server on the machine's loopback ----------------------------------------------


class Forwarder:
    """TCP from ``127.0.0.1:<port>`` in this namespace to ``target`` inside ``netns``.

    Each accepted connection gets its own socket made inside ``netns`` (a thread enters it only
    to create the socket), and bytes are copied both ways until either side closes.
    """

    def __init__(self, netns: Path | str, target: tuple[str, int]) -> None:
        self.netns = Path(netns)
        self.target = target
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port: int = self._listener.getsockname()[1]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kind-forwarder", daemon=True)
        self._stopped = threading.Event()

    def start(self) -> Forwarder:
        self._thread.start()
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(self._client, sock=self._listener)
        async with server:
            while not self._stopped.is_set():
                await asyncio.sleep(0.2)

    def _inner_socket(self) -> socket.socket:
        with network.inside(self.netns):
            inner = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        inner.setblocking(False)
        return inner

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        inner = self._inner_socket()
        try:
            await asyncio.wait_for(self._loop.sock_connect(inner, self.target), timeout=10)
            up_reader, up_writer = await asyncio.open_connection(sock=inner)
        except (OSError, TimeoutError) as exc:
            inner.close()
            log.warning("cannot reach %s:%d in %s: %s", *self.target, self.netns, exc)
            writer.close()
            return
        await asyncio.gather(network.pipe(reader, up_writer), network.pipe(up_reader, writer))

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._listener.close()


# ---- the cluster ----------------------------------------------------------------------------


class KindCluster:
    """One kind cluster: created, networked, reachable; deleted by :meth:`delete`.

    ``docker_env`` has ``DOCKER_HOST`` for the daemon of :mod:`tests.harness.kind.docker` and
    ``netns`` is that daemon's network namespace; ``kind`` is the CLI that
    :mod:`tests.harness.kind.gobuild` built (or a user's), ``kubectl`` any kubectl.
    """

    def __init__(
        self,
        name: str,
        *,
        image: str,
        nodes: int,
        workdir: Path,
        docker_env: Mapping[str, str],
        netns: Path | str,
        kind: str,
        kubectl: str,
        mounts: Mapping[str, str] | None = None,
        marker_dir: Path | None = None,
    ) -> None:
        self.name = name
        self.image = image
        self.nodes = nodes
        self.workdir = workdir
        self.docker_env = dict(docker_env)
        self.netns = Path(netns)
        self.kind = kind
        self.kubectl_bin = kubectl
        self.mounts = dict(mounts or {})
        self.marker_dir = marker_dir
        """The Docker daemon's run directory: a marker there tells its teardown (or its
        reaper, when this process dies first) to remove the /lib/modules that kind made."""
        self.kubeconfig = workdir / "kubeconfig"
        self._inner_kubeconfig = workdir / "kubeconfig.inner"
        self._forwarder: Forwarder | None = None
        self.created = False
        # kind mounts /lib/modules into its nodes (docker run -v), which makes an empty one on a
        # machine that has none; delete() takes away what create() made.
        self._made_modules_dir = False
        self._stopped: dict[str, list[int]] = {}

    # -- commands --

    def _env(self) -> dict[str, str]:
        return {**os.environ, **self.docker_env}

    def _run(
        self, argv: Sequence[str], *, timeout: float = 120, check: bool = True, stdin: str = ""
    ) -> subprocess.CompletedProcess[str]:
        """A command in the daemon's network namespace (kind picks and publishes ports there)."""
        wrapped = ["nsenter", f"--net={self.netns}", *argv]
        result = subprocess.run(
            wrapped, input=stdin, capture_output=True, text=True, env=self._env(),
            timeout=timeout, check=False,
        )  # fmt: skip
        if check and result.returncode != 0:
            raise ClusterError(
                f"`{' '.join(argv)}` exited {result.returncode}: "
                f"{(result.stderr or result.stdout).strip()[-2000:]}"
            )
        return result

    def docker(self, *args: str, timeout: float = 120, check: bool = True) -> str:
        return self._run(["docker", *args], timeout=timeout, check=check).stdout

    def kubectl(self, *args: str, timeout: float = 60, stdin: str = "") -> str:
        """kubectl through the forwarder, as a user on this machine would run it."""
        result = subprocess.run(
            [self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), *args], input=stdin,
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip
        if result.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)}: {result.stderr.strip()[-2000:]}")
        return result.stdout

    # -- life cycle --

    def exists(self) -> bool:
        listed = self._run([self.kind, "get", "clusters"], check=False).stdout.split()
        return self.name in listed

    def create(self, *, timeout: float = 900) -> None:
        """Create the cluster, give it a pod network and a forwarder; wait for every node and
        CoreDNS to be Ready. A failure leaves the nodes for :meth:`diagnose` (``--retain``)."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "kind-config.yaml"
        config.write_text(yaml.safe_dump(kind_config(self.nodes, self.mounts), sort_keys=False))
        started = time.monotonic()
        self.created = True
        self._made_modules_dir = not MODULES_DIR.exists()
        if self._made_modules_dir and self.marker_dir is not None:
            (self.marker_dir / MADE_MODULES_MARKER).touch()
        self._run(
            [
                self.kind, "create", "cluster", "--name", self.name, "--image", self.image,
                "--config", str(config), "--kubeconfig", str(self._inner_kubeconfig),
                "--retain",
            ],
            timeout=timeout,
        )  # fmt: skip
        log.info("kind create cluster: %.0f s", time.monotonic() - started)
        self._reach()
        self.network(deadline=started + timeout)
        self.wait_ready(deadline=started + timeout)

    def _reach(self) -> None:
        """Start the forwarder and write the kubeconfig that uses it."""
        inner = yaml.safe_load(self._inner_kubeconfig.read_text())
        server = inner["clusters"][0]["cluster"]["server"]
        host, _, port = server.removeprefix("https://").rpartition(":")
        self._forwarder = Forwarder(self.netns, (host.strip("[]"), int(port))).start()
        for entry in inner["clusters"]:
            entry["cluster"]["server"] = f"https://127.0.0.1:{self._forwarder.port}"
        self.kubeconfig.write_text(yaml.safe_dump(inner, sort_keys=False))
        self.kubeconfig.chmod(0o600)

    def node_names(self) -> list[str]:
        """The node containers of the cluster (their names are the Kubernetes node names)."""
        out = self._run([self.kind, "get", "nodes", "--name", self.name]).stdout
        return sorted(out.split())

    def address(self, node: str) -> str:
        """The node's address on the kind network."""
        return self.docker(
            "inspect", "-f", f"{{{{(index .NetworkSettings.Networks {json.dumps(NETWORK)}).IPAddress}}}}",
            node,
        ).strip()  # fmt: skip

    def _pod_cidrs(self, deadline: float) -> dict[str, str]:
        while True:
            nodes = json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]
            found = {n["metadata"]["name"]: n["spec"].get("podCIDR") for n in nodes}
            if len(found) == self.nodes and all(found.values()):
                return {name: str(cidr) for name, cidr in found.items()}
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"nodes without spec.podCIDR after the deadline: {found} (is the "
                    "controller-manager running with --allocate-node-cidrs?)"
                )
            time.sleep(1)

    def network(self, deadline: float | None = None) -> None:
        """Write every node's CNI config and its routes to the other nodes' pod ranges (again:
        a node that restarted or came back on the network may have another address)."""
        deadline = time.monotonic() + 120 if deadline is None else deadline
        cidrs = self._pod_cidrs(deadline)
        ranges = {node: (self.address(node), cidr) for node, cidr in cidrs.items()}
        for node, node_routes in routes(ranges).items():
            conflist = json.dumps(cni_conflist(ranges[node][1]), indent=2)
            self._run(
                ["docker", "exec", "-i", node, "sh", "-c", f"cat > {CNI_CONFLIST}"],
                stdin=conflist,
            )
            for route in node_routes:
                self.docker("exec", node, "sh", "-c", f"ip route replace {route}")

    def wait_ready(self, deadline: float) -> None:
        """Every node Ready and CoreDNS's pods Ready, or a :class:`ClusterError` saying what
        was not."""
        waiting = "nodes"
        while True:
            with contextlib.suppress(ClusterError):
                nodes = json.loads(self.kubectl("get", "nodes", "-o", "json"))["items"]
                if len(nodes) == self.nodes and all(_ready(n) for n in nodes):
                    waiting = "coredns"
                    dns = ("get", "pods", "-n", "kube-system", "-l", "k8s-app=kube-dns")
                    pods = json.loads(self.kubectl(*dns, "-o", "json"))["items"]
                    if pods and all(_ready(p) for p in pods):
                        return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"the kind cluster {self.name} is not ready ({waiting}); "
                    f"kubectl --kubeconfig {self.kubeconfig} get nodes,pods -A says more"
                )
            time.sleep(2)

    def delete(self) -> None:
        """Delete the cluster (if this object created it) and stop the forwarder."""
        if self._forwarder is not None:
            self._forwarder.stop()
            self._forwarder = None
        if self.created:
            self._run([self.kind, "delete", "cluster", "--name", self.name], timeout=300,
                      check=False)  # fmt: skip
            self.created = False
        if self._made_modules_dir:
            with contextlib.suppress(OSError):  # not empty: someone else's now
                MODULES_DIR.rmdir()
            self._made_modules_dir = False

    def diagnose(self, target: Path) -> None:
        """``kind export logs`` into ``target`` (kubelet, containerd and pod logs per node)."""
        target.mkdir(parents=True, exist_ok=True)
        self._run([self.kind, "export", "logs", str(target), "--name", self.name],
                  timeout=300, check=False)  # fmt: skip

    def load(self, image: str, nodes: Sequence[str] = ()) -> None:
        """Put a local image of the daemon into ``nodes`` (all by default): ``kind load
        docker-image``."""
        only = ["--nodes", ",".join(nodes)] if nodes else []
        self._run(
            [self.kind, "load", "docker-image", image, "--name", self.name, *only], timeout=1800
        )

    # -- faults on the nodes --

    def kill(self, node: str) -> None:
        """A loud loss: the node's container is SIGKILLed (``docker kill``)."""
        self.docker("kill", node)

    def pause(self, node: str) -> str:
        """A silent loss: every process of the node frozen; its network stays up, so the kernel
        still takes packets and nothing answers. ``docker pause`` (the freezer cgroup) where it
        works; where runc gives up on the freezer ("unable to freeze": seen on this machine's
        cgroup v1 with a loaded kind node), SIGSTOP of every process in the node's cgroups until
        all are stopped, as a hung machine. Returns which of the two it was."""
        paused = self._run(["docker", "pause", node], check=False)
        if paused.returncode == 0:
            return "docker pause"
        log.warning("docker pause %s failed (%s): SIGSTOP instead", node, paused.stderr.strip())
        self._stopped[node] = _stop_all(lambda: self._node_pids(node))
        return f"SIGSTOP of {len(self._stopped[node])} processes"

    def unpause(self, node: str) -> None:
        stopped = self._stopped.pop(node, None)
        if stopped is None:
            self.docker("unpause", node)
            return
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def _node_pids(self, node: str) -> list[int]:
        """Every process of the node: its container's cgroup subtree (nested containers
        included: they have PID namespaces of their own, but their cgroups are below)."""
        pid_text, container = self.docker("inspect", "-f", "{{.State.Pid}} {{.Id}}", node).split()
        relative = ""
        for line in Path(f"/proc/{pid_text}/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            # systemd in the node moved itself below the container's cgroup (init.scope)
            if "pids" in controllers.split(",") and container in path:
                relative = path[: path.index(container) + len(container)]
        if not relative:
            raise ClusterError(f"no pids cgroup of container {container[:12]} for {node}")
        root = Path("/sys/fs/cgroup/pids") / relative.lstrip("/")
        return sorted(
            {int(p) for f in root.rglob("cgroup.procs") for p in f.read_text().split() if p}
        )

    def disconnect(self, node: str) -> None:
        """A partition: the node's link to the kind network is removed."""
        self.docker("network", "disconnect", NETWORK, node)

    def connect(self, node: str) -> None:
        """Heal a partition. Docker may give the node another address on the network, so
        every node's routes to the pod ranges are written again."""
        self.docker("network", "connect", NETWORK, node)
        self.network()

    def restart(self, node: str) -> None:
        """Bring a killed node back (``docker start``): systemd boots it again, its kubelet
        rejoins, and every node's routes are written again."""
        self.docker("start", node)
        self.network()


def _stop_all(members: Callable[[], list[int]], timeout: float = 30.0) -> list[int]:
    """SIGSTOP every process ``members()`` lists, again and again until a pass finds all of
    them stopped (one forked during a pass is caught by the next; a stopped one forks no
    more). Returns every pid stopped."""
    seen: list[int] = []
    deadline = time.monotonic() + timeout
    while True:
        running = []
        for pid in members():
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if pid not in seen:
                seen.append(pid)
            if state not in ("T", "t", "Z", "X"):
                running.append(pid)
        if not running:
            return seen
        if time.monotonic() > deadline:
            raise ClusterError(f"could not stop {running} within {timeout:g}s")
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        time.sleep(0.05)


def _ready(obj: Mapping[str, Any]) -> bool:
    conditions = obj.get("status", {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
