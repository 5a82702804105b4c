"""Hollow nodes: Nodes whose kubelet only says what it would do (kubemark's HollowKubelet, KWOK).

``python -m tests.harness.kube.hollow_nodes CONFIG.json`` runs every hollow node of a cluster in one process
(the control plane starts it: :meth:`tests.harness.kube.controlplane.ControlPlane.add_hollow_nodes`).
A process kubelet runs each pod as real processes in a network namespace of its own, which
costs too much for a thousand pods on two cores; a hollow node runs none. Each hollow node, as
seen by the API server and the controllers, is a kubelet that:

* registers its ``Node`` (capacity, addresses, a pod CIDR, ``Ready``, the taints it is given)
  with its own node credentials (``system:node:<name>``, under ``NodeRestriction``), renews its
  ``Lease`` every second and its conditions every 10 s;
* watches the pods bound to it, one watch per node with ``spec.nodeName`` (a kubelet's own
  watch, which the API server's watch cache serves from an index), and records each as started
  and running in one status write, as the kubelet's status manager does: phase ``Running``, an
  address from the node's pod CIDR, ``startTime``, the conditions the kubelet owns, every
  container running and ready (init containers completed). No process, no network namespace,
  no volume is made;
* stops a deleted pod at once: its containers terminated (exit 143, a SIGTERM'd process), the
  final status, then its own ``DELETE`` with ``gracePeriodSeconds: 0`` and a uid precondition
  (finalizers hold the pod until they are removed), as the process kubelet does;
* forgets a pod the API no longer has.

**Faults**, through an HTTP control endpoint on loopback (:class:`Control`; the control plane's
``hollow_exit``, ``lose_node`` and ``revive_node`` call it):

* ``POST /exit`` ``{"namespace", "pods": [names] | "selector": {label: value}, "code"}``: the
  pods' containers exit with ``code``; a ``Never`` pod ends ``Succeeded`` (0) or ``Failed``,
  and an ``Always`` or ``OnFailure`` one restarts its container, as a kubelet does;
* ``POST /lose`` ``{"node"}``: the node stops reporting, as a hung machine or a partition: no
  Lease, no status, no deletion confirmed, and its pods' agents are silent. The node lifecycle
  controller and the taint eviction controller do what they do with a lost node;
* ``POST /revive`` ``{"node"}``: it reports again: the pods the API deleted meanwhile are
  forgotten (a force-deleted pod's processes are killed), the deletions made meanwhile are
  confirmed, and the other pods run on (a partition healed), their status written again.

**Hollow agents.** Inside the cluster's hub namespace (:mod:`tests.harness.kube.network`) the hollow
pod range is local (``ip route add local``), and one listener on the agents' directory port
(the rendezvous port + 1, 29401 by default) answers for every hollow pod: a connection to pod
*P*'s address gets the line a ddpjob-agent would send (``ddpjob_worker.membership.advert``): its index,
``running``, the world it trains in and whether it hosts the store. The world is the count of
the job's running pods on nodes that report, but for ``cut_seconds`` after a node is lost (the
time real agents take to cut a silent member, 2.6 to 5.7 s measured at 8 to 24 pods): until
then the lost pods still count. The store host is the lowest index in the world. The pods of a
lost node never answer (the connection is held until the asker gives up), as across a
partition. ``GET /stats`` counts the connections per second.

What it does not do: probes (every container is ready once running), logs, events, resource
accounting beyond what the scheduler reads from the Node.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import http.server
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import requests

from tests.harness.kube import network, runtime
from tests.harness.kube.client import ApiError, Client, Endpoint
from tests.harness.kube.node import NodeIdentity
from tests.harness.kube.podstatus import (
    KUBELET_OWNED,
    condition,
    pod_status,
    rfc3339,
    watch_bound,
)

JSON = dict[str, Any]
log = logging.getLogger("hollow-kubelet")

RESYNC_SECONDS = 5.0
"""How often the API's copy of a pod's status is compared with ours (a lost node's pods were
marked not ready by the node lifecycle controller meanwhile, say)."""
STOPPED_EXIT = 143
SILENT_HOLD_SECONDS = 10.0
"""How long a connection to a lost node's pod is held without an answer."""
AGENT_PORT = 29401


# ---- configuration -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    name: str
    pod_cidr: str
    node_ip: str
    kubeconfig: Path


@dataclasses.dataclass(frozen=True)
class Config:
    nodes: list[NodeConfig]
    capacity: Mapping[str, str]
    control_port: int
    taints: list[JSON] = dataclasses.field(default_factory=list)
    hub: str | None = None
    """The cluster's hub namespace (its path): where the hollow agents answer. None: no agents."""
    agent_range: str | None = None
    """Every hollow pod's address is in this range (made local in the hub)."""
    agent_port: int = AGENT_PORT
    cut_seconds: float = 5.0
    lease_seconds: int = 10
    renew_seconds: float = 1.0
    status_seconds: float = 10.0
    version: str = "v0.0.0"

    @classmethod
    def load(cls, path: Path) -> Config:
        raw = json.loads(path.read_text())
        raw["nodes"] = [
            NodeConfig(**{**n, "kubeconfig": Path(n["kubeconfig"])}) for n in raw["nodes"]
        ]
        return cls(**raw)

    def dump(self) -> str:
        raw = dataclasses.asdict(self)
        for node in raw["nodes"]:
            node["kubeconfig"] = str(node["kubeconfig"])
        return json.dumps(raw, indent=1)


# ---- a pod and its status (pure) ------------------------------------------------------------


@dataclasses.dataclass
class HollowContainer:
    name: str
    image: str
    started_at: str
    restart_count: int = 0
    terminated: JSON | None = None
    last_terminated: JSON | None = None

    def status(self) -> JSON:
        state: JSON = {"waiting": None, "running": None, "terminated": None}
        if self.terminated is not None:
            state["terminated"] = self.terminated
        else:
            state["running"] = {"startedAt": self.started_at}
        return {
            "name": self.name,
            "image": self.image,
            "imageID": f"hollow://{self.image}",
            "containerID": f"hollow://{self.name}-{self.restart_count}",
            "ready": self.terminated is None,
            "started": self.terminated is None,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": {"terminated": self.last_terminated},
        }


@dataclasses.dataclass
class HollowPod:
    uid: str
    namespace: str
    name: str
    node: str
    ip: str
    start_time: str
    restart_policy: str
    labels: Mapping[str, str]
    containers: list[HollowContainer]
    init: list[str]
    deleting: bool = False
    confirmed: bool = False
    written: JSON | None = None
    checked: float = 0.0
    transitions: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)

    @classmethod
    def admit(cls, body: Mapping[str, Any], node: str, ip: str) -> HollowPod:
        meta, spec = body["metadata"], body.get("spec") or {}
        now = rfc3339()
        return cls(
            uid=meta["uid"],
            namespace=meta["namespace"],
            name=meta["name"],
            node=node,
            ip=ip,
            start_time=now,
            restart_policy=str(spec.get("restartPolicy") or "Always"),
            labels=dict(meta.get("labels") or {}),
            containers=[
                HollowContainer(str(c["name"]), str(c.get("image", "")), now)
                for c in spec.get("containers") or []
            ],
            init=[str(c["name"]) for c in spec.get("initContainers") or []],
        )

    @property
    def phase(self) -> str:
        if any(c.terminated is None for c in self.containers):
            return "Running"
        codes = [int((c.terminated or {}).get("exitCode", 1)) for c in self.containers]
        return "Succeeded" if not any(codes) else "Failed"

    @property
    def running(self) -> bool:
        return self.phase == "Running"

    def exit(self, code: int, now: float | None = None) -> None:
        """Every running container ends with ``code``; one the restart policy restarts runs
        again at once (a hollow node has no back-off to wait)."""
        finished = rfc3339(now)
        for c in self.containers:
            if c.terminated is not None:
                continue
            ended: JSON = {
                "exitCode": code,
                "reason": "Completed" if code == 0 else "Error",
                "startedAt": c.started_at,
                "finishedAt": finished,
                "containerID": f"hollow://{c.name}-{c.restart_count}",
                "message": None,
                "signal": None,
            }
            restarts = self.restart_policy == "Always" or (
                self.restart_policy == "OnFailure" and code != 0
            )
            if restarts and not self.deleting:
                c.last_terminated = ended
                c.restart_count += 1
                c.started_at = finished
            else:
                c.terminated = ended

    def status(self, host_ip: str) -> JSON:
        phase = self.phase
        terminal = phase != "Running"
        ready = not terminal
        not_ready = "PodCompleted" if terminal else ""
        conditions = [
            condition(self.transitions, "PodReadyToStartContainers", not terminal),
            condition(self.transitions, "Initialized", True),
            condition(self.transitions, "ContainersReady", ready, not_ready),
            condition(self.transitions, "Ready", ready, not_ready),
        ]
        init = [
            {
                "name": name,
                "image": "",
                "imageID": "hollow://",
                "ready": True,
                "restartCount": 0,
                "state": {
                    "terminated": {
                        "exitCode": 0,
                        "reason": "Completed",
                        "startedAt": self.start_time,
                        "finishedAt": self.start_time,
                    }
                },
            }
            for name in self.init
        ]
        containers = [c.status() for c in self.containers]
        return pod_status(phase, host_ip, self.ip, self.start_time, conditions, containers, init)


def drifted(api_status: Mapping[str, Any], ours: Mapping[str, Any]) -> bool:
    """The API's copy of what we own disagrees with ours: the phase, or a condition we own (the
    node lifecycle controller marks a lost node's pods not ready)."""
    if api_status.get("phase") != ours.get("phase"):
        return True
    theirs = {
        c.get("type"): c.get("status")
        for c in api_status.get("conditions") or []
        if c.get("type") in KUBELET_OWNED
    }
    mine = {c["type"]: c["status"] for c in ours.get("conditions") or []}
    return any(theirs.get(kind) != value for kind, value in mine.items())


# ---- one hollow node -------------------------------------------------------------------------


class HollowNode:
    """One node's kubelet: its pods, its watch, its sync loop. ``lost``: it reports nothing."""

    def __init__(self, config: NodeConfig, hollow: Hollow) -> None:
        self.config = config
        self.hollow = hollow
        self.endpoint = Endpoint.from_kubeconfig(config.kubeconfig)
        self.api = Client(self.endpoint, f"hollow-kubelet/{hollow.config.version} ({config.name})")
        self.addresses = runtime.Addresses(config.pod_cidr)
        self.pods: dict[str, HollowPod] = {}
        self.seen: dict[str, JSON] = {}
        self.deleted: set[str] = set()
        self.exits: dict[str, int] = {}
        """uid -> the exit code its containers were told to exit with."""
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.lost = False
        self.lost_at = 0.0
        self.identity = NodeIdentity(
            name=config.name,
            pod_cidr=config.pod_cidr,
            node_ip=config.node_ip,
            capacity=hollow.config.capacity,
            kubelet_version=hollow.config.version,
            runtime="hollow",
            kernel="hollow",
            labels={"ddpjob.io/hollow": "true"},
            taints=list(hollow.config.taints),
        )

    @property
    def name(self) -> str:
        return self.config.name

    # ---- the node object and its heartbeats ----------------------------------------------

    def register(self) -> None:
        self.identity.register(self.api)

    def post_status(self, api: Client | None = None) -> None:
        self.identity.post_status(api or self.api)

    def renew_lease(self, api: Client | None = None) -> None:
        self.identity.renew_lease(api or self.api, self.hollow.config.lease_seconds)

    # ---- its pods ------------------------------------------------------------------------

    def watch(self, stop: threading.Event) -> None:
        api = Client(self.endpoint, self.api.session.headers["User-Agent"])
        watch_bound(api, self.name, self, stop)

    def tell_exit(self, uids: Iterable[str], code: int) -> None:
        with self.lock:
            for uid in uids:
                self.exits[uid] = code
        self.wake.set()

    def run(self, stop: threading.Event) -> None:
        """The sync loop: act on what the watch shows, unless the node is lost."""
        while not stop.is_set():
            self.wake.wait(1.0)
            self.wake.clear()
            if self.lost:
                continue
            with self.lock:
                seen = dict(self.seen)
                exits, self.exits = self.exits, {}
            for uid, pod in list(self.pods.items()):
                if uid not in seen:  # the API no longer has it: its processes are killed
                    self.forget(pod)
            for uid, body in seen.items():
                try:
                    self.sync(uid, body, exits.get(uid))
                except (ApiError, requests.RequestException) as exc:
                    log.warning("%s: syncing %s: %s", self.name, body["metadata"]["name"], exc)
                    self.wake.set()

    def sync(self, uid: str, body: JSON, exit_code: int | None) -> None:
        meta = body["metadata"]
        pod = self.pods.get(uid)
        if pod is None:
            if (body.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return  # ended before this kubelet knew it (a restart): nothing to run
            pod = HollowPod.admit(body, self.name, self.addresses.take())
            self.pods[uid] = pod
            self.hollow.agents_changed()
        if exit_code is not None:
            pod.exit(exit_code)
            self.hollow.agents_changed()
        if meta.get("deletionTimestamp") and not pod.deleting:
            pod.deleting = True
            pod.exit(STOPPED_EXIT)
            self.hollow.agents_changed()
        status = pod.status(self.config.node_ip)
        now = time.monotonic()
        if status != pod.written or (
            now - pod.checked > RESYNC_SECONDS and drifted(body.get("status") or {}, status)
        ):
            pod.checked = now
            self.write_status(pod, status)
        if pod.deleting and not pod.confirmed and pod.written == status:
            path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}"
            with contextlib.suppress(ApiError):  # 404, 409: gone, or another pod of the name
                self.api.delete(path, {"gracePeriodSeconds": 0, "preconditions": {"uid": uid}})
            pod.confirmed = True

    def write_status(self, pod: HollowPod, status: JSON) -> None:
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status"
        try:
            self.api.patch(path, {"metadata": {"uid": pod.uid}, "status": status})
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise
        pod.written = status

    def forget(self, pod: HollowPod) -> None:
        self.pods.pop(pod.uid, None)
        self.addresses.give_back(pod.ip)
        self.hollow.agents_changed()


# ---- the hollow agents -----------------------------------------------------------------------


@dataclasses.dataclass
class Agent:
    index: int
    job: tuple[str, str]
    node: HollowNode


class Agents:
    """Who answers at which address, what each says, and the connections counted."""

    def __init__(self, hollow: Hollow) -> None:
        self.hollow = hollow
        self.by_ip: dict[str, Agent] = {}
        self.connections: dict[int, int] = {}
        self.lock = threading.Lock()
        self.hosts: dict[tuple[str, str], tuple[int, int]] = {}
        """job -> (its store host's index, the store's generation)."""
        self.rounds: dict[tuple[str, str], tuple[tuple[int, ...], int]] = {}
        """job -> (the members of its last round, the round's number)."""

    def refresh(self) -> None:
        found: dict[str, Agent] = {}
        for node in self.hollow.nodes.values():
            for pod in list(node.pods.values()):
                job = pod.labels.get("ddpjob.io/job-name")
                if job is None or not pod.running or pod.deleting:
                    continue
                index = int(pod.labels.get("ddpjob.io/replica-index", pod.name.rsplit("-", 1)[1]))
                found[pod.ip] = Agent(index, (pod.namespace, job), node)
        with self.lock:
            self.by_ip = found

    def answer(self, address: str, now: float) -> bytes | None:
        """The line the agent at ``address`` sends, or None: it is silent (its node is lost)
        or there is none."""
        with self.lock:
            agent = self.by_ip.get(address)
            if agent is None or agent.node.lost:
                return None
            cut = self.hollow.config.cut_seconds
            world = sorted(
                a.index
                for a in self.by_ip.values()
                if a.job == agent.job and (not a.node.lost or now - a.node.lost_at < cut)
            )
            host, gen = self.hosts.get(agent.job, (-1, 0))
            if world and world[0] != host:
                host, gen = world[0], gen + 1
                self.hosts[agent.job] = (host, gen)
            members, rdzv_round = self.rounds.get(agent.job, ((), 0))
            if tuple(world) != members:  # a new round with the members of now
                rdzv_round += 1
                self.rounds[agent.job] = (tuple(world), rdzv_round)
        line = {
            "v": 1,
            "run": f"{agent.job[0]}-{agent.job[1]}",
            "index": agent.index,
            "gen": gen,
            "established": True,
            "host": agent.index == host,
            "phase": "running",
            "world": len(world),
            "round": rdzv_round,
        }
        return json.dumps(line).encode() + b"\n"

    def count(self, now: float) -> None:
        second = int(now)
        with self.lock:
            self.connections[second] = self.connections.get(second, 0) + 1

    async def serve(self, listener: socket.socket) -> None:
        async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            now = time.time()
            self.count(now)
            address = str(writer.get_extra_info("sockname")[0])
            line = self.answer(address, now)
            try:
                if line is None:
                    await asyncio.sleep(SILENT_HOLD_SECONDS)
                else:
                    writer.write(line)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(one, sock=listener, backlog=1024)
        async with server:
            await server.serve_forever()


# ---- the process -----------------------------------------------------------------------------


class Hollow:
    """Every hollow node of a cluster, their agents and the control endpoint."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.stop = threading.Event()
        self.nodes = {n.name: HollowNode(n, self) for n in config.nodes}
        self.agents = Agents(self)
        self._agents_dirty = threading.Event()

    def agents_changed(self) -> None:
        self._agents_dirty.set()

    def heartbeat(self, node: HollowNode) -> None:
        """One node's Lease every second and its conditions every 10 s, in a thread of its
        own (with its own connection), as each kubelet renews its own: a node whose status
        writes are slow does not hold back the others' Leases."""
        api = Client(node.endpoint, node.api.session.headers["User-Agent"])
        next_status = time.monotonic() + self.config.status_seconds
        while not self.stop.is_set():
            if not node.lost:
                try:
                    node.renew_lease(api)
                    if time.monotonic() >= next_status:
                        node.post_status(api)
                        next_status = time.monotonic() + self.config.status_seconds
                except (ApiError, requests.RequestException) as exc:
                    log.warning("%s: heartbeat: %s", node.name, exc)
            self.stop.wait(self.config.renew_seconds)

    def refresh_agents(self) -> None:
        while not self.stop.is_set():
            if self._agents_dirty.wait(0.2):
                self._agents_dirty.clear()
                self.agents.refresh()

    def serve_agents(self) -> None:
        assert self.config.hub is not None
        if self.config.agent_range is not None:
            subprocess.run(
                ["nsenter", f"--net={self.config.hub}", "ip", "route", "replace", "local",
                 self.config.agent_range, "dev", "lo"],
                check=True, capture_output=True,
            )  # fmt: skip
        with network.inside(self.config.hub):
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("0.0.0.0", self.config.agent_port))  # the hub's own addresses only
        listener.listen(1024)
        asyncio.run(self.agents.serve(listener))

    # ---- faults --------------------------------------------------------------------------

    def exit(
        self, namespace: str, names: Iterable[str], selector: Mapping[str, str], code: int
    ) -> int:
        wanted = set(names)
        told = 0
        for node in self.nodes.values():
            uids = [
                p.uid
                for p in list(node.pods.values())
                if p.namespace == namespace
                and (
                    p.name in wanted
                    or (selector and all(p.labels.get(k) == v for k, v in selector.items()))
                )
            ]
            node.tell_exit(uids, code)
            told += len(uids)
        return told

    def lose(self, name: str) -> None:
        node = self.nodes[name]
        node.lost_at = time.time()
        node.lost = True
        log.warning("%s lost: it reports nothing until revived", name)

    def revive(self, name: str) -> None:
        node = self.nodes[name]
        node.lost = False
        with contextlib.suppress(ApiError, requests.RequestException):
            node.renew_lease()
            node.post_status()  # Ready again now, not at the next status period
        for pod in node.pods.values():
            pod.checked = 0.0  # written again if the API's copy differs
        node.wake.set()
        self.agents_changed()
        log.warning("%s revived", name)

    def stats(self) -> JSON:
        with self.agents.lock:
            per_second = dict(self.agents.connections)
        return {
            "agent_connections": sum(per_second.values()),
            "per_second": {str(k): v for k, v in sorted(per_second.items())},
            "pods": {n.name: len(n.pods) for n in self.nodes.values()},
            "lost": [n.name for n in self.nodes.values() if n.lost],
        }

    # ---- running -------------------------------------------------------------------------

    def run(self) -> None:
        for node in self.nodes.values():
            node.register()
        threads: list[Callable[[], None]] = [self.refresh_agents]
        for node in self.nodes.values():
            threads.append(lambda node=node: self.heartbeat(node))  # type: ignore[misc]
            threads.append(lambda node=node: node.watch(self.stop))  # type: ignore[misc]
            threads.append(lambda node=node: node.run(self.stop))  # type: ignore[misc]
        if self.config.hub is not None:
            threads.append(self.serve_agents)
        for target in threads:
            threading.Thread(target=target, daemon=True).start()
        control = Control(self)
        threading.Thread(target=control.serve_forever, daemon=True).start()
        log.info("%d hollow nodes up", len(self.nodes))
        self.stop.wait()
        control.shutdown()


class Control(http.server.ThreadingHTTPServer):
    """The fault endpoint on loopback (see the module doc)."""

    daemon_threads = True

    def __init__(self, hollow: Hollow) -> None:
        self.hollow = hollow
        super().__init__(("127.0.0.1", hollow.config.control_port), _ControlHandler)


class _ControlHandler(http.server.BaseHTTPRequestHandler):
    server: Control

    def log_message(self, format: str, *args: Any) -> None:
        log.debug(format, *args)

    def do_GET(self) -> None:
        if self.path == "/stats":
            self.reply(200, self.server.hollow.stats())
        else:
            self.reply(404, {"error": self.path})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        hollow = self.server.hollow
        try:
            if self.path == "/exit":
                told = hollow.exit(
                    str(body["namespace"]),
                    body.get("pods") or (),
                    body.get("selector") or {},
                    int(body.get("code", 0)),
                )
                self.reply(200, {"told": told})
            elif self.path == "/lose":
                hollow.lose(str(body["node"]))
                self.reply(200, {})
            elif self.path == "/revive":
                hollow.revive(str(body["node"]))
                self.reply(200, {})
            else:
                self.reply(404, {"error": self.path})
        except KeyError as exc:
            self.reply(400, {"error": f"unknown {exc}"})

    def reply(self, code: int, body: JSON) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kube.hollow_nodes")
    parser.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    hollow = Hollow(Config.load(args.config))
    signal.signal(signal.SIGTERM, lambda *_: hollow.stop.set())
    signal.signal(signal.SIGINT, lambda *_: hollow.stop.set())
    hollow.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
