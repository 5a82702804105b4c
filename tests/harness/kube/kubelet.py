"""The process kubelet: a Node of the test cluster whose pods are real local processes.

``python -m tests.harness.kube.kubelet CONFIG.json`` (the control plane starts one per node, each as
PID 1 of a PID namespace of its own, so that losing the node kills every process of its pods
at once). It does what a kubelet does that matters to ddpjob and to the controllers that watch
kubelets:

* registers its ``Node`` (capacity, allocatable, addresses, its pod CIDR, a ``Ready``
  condition) and keeps it fresh: its ``Lease`` in ``kube-node-lease`` every
  ``renewSeconds``, the node's conditions every ``statusSeconds``. The node lifecycle
  controller watches exactly these;
* watches the pods bound to it (``spec.nodeName``) and runs each: a sandbox (a network
  namespace of its own joined to the cluster's bridge, :mod:`tests.harness.kube.network`; a hosts
  file, resolv.conf and volumes, :mod:`tests.harness.kube.runtime`), then its init
  containers in order, then its containers, each a process tree of the shared process layer
  (:class:`ddpjob_operator.local.pods.ContainerProcess`), with the env resolved as a kubelet
  does (``fieldRef``, ``resourceFieldRef``, ConfigMap and Secret references, ``$(VAR)``);
* writes pod status as the kubelet's status manager does, a strategic merge patch guarded by
  the pod's uid: phase, podIP(s), hostIP(s), startTime, the conditions it owns
  (PodReadyToStartContainers, Initialized, ContainersReady, Ready) next to those others wrote
  (PodScheduled, DisruptionTarget), ``containerStatuses`` sorted by name with state, lastState,
  restartCount, exit codes and reasons (``Completed``, ``Error``, ``OOMKilled``,
  ``StartError``, ``ErrImagePull``, ``CreateContainerConfigError``, ``CrashLoopBackOff``);
* runs readiness and liveness probes (exec inside the container's namespaces, httpGet,
  tcpSocket) with their period, timeout and thresholds;
* restarts containers of ``Always``/``OnFailure`` pods with the kubelet's back-off;
* on a graceful deletion: SIGTERM, the grace period, SIGKILL, the final status, then its own
  ``DELETE`` with ``gracePeriodSeconds: 0`` and a uid precondition, so a pod with finalizers
  stays until they are removed; a pod deleted from the API meanwhile is killed at once;
* kills the pods the API no longer has (SIGTERM, then SIGKILL a second later), as a kubelet
  kills every pod outside its desired set; after a stall (its node frozen, say), it lists its
  pods again before it syncs any, so a pod force-deleted meanwhile is killed at once;
* serves ``/containerLogs`` on its node address (a loopback address of this machine's own
  namespace, where the kubelet itself runs), so ``kubectl logs`` works through the API
  server; emits the Events ``kubectl describe pod`` shows.

What it does not do: images (a table of known images, :func:`tests.harness.kube.runtime.default_images`),
``runAsUser``, startup probes,
lifecycle hooks, ephemeral containers, PersistentVolumeClaims, token rotation.
"""

from __future__ import annotations

import argparse
import base64
import concurrent.futures
import contextlib
import dataclasses
import functools
import http.client
import http.server
import json
import logging
import math
import os
import platform
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import psutil
import requests

from ddpjob_operator.builders import parse_quantity
from ddpjob_operator.local.pods import (
    ContainerProcess,
    LocalPodError,
    container_argv,
    container_env,
    spawn,
)
from tests.harness.kube import network, pki, podstatus, runtime
from tests.harness.kube.client import ApiError, Client, Endpoint
from tests.harness.kube.node import NodeIdentity
from tests.harness.kube.podstatus import condition, rfc3339

JSON = dict[str, Any]
log = logging.getLogger("process-kubelet")

TICK = 0.1
TREE_WALK_SECONDS = 1.0
RESYNC_SECONDS = 5.0
"""How often the API's copy of a pod's status is compared with ours."""
"""Without a cgroup, how often a running container's process tree is walked (to remember the
processes to kill if its root dies first)."""
STALL_SECONDS = 3.0
"""A pass of the sync loop this long after the one before: the kubelet was stopped (its node
frozen) or starved. It lists its pods again before it syncs any: the API server may have
force-deleted some meanwhile, and those must be killed now, whatever its watch still holds."""
GONE_GRACE = 1.0
"""The grace period of a pod the API no longer has (deleted with a grace period of 0)."""
BACKOFF_START = 10.0
BACKOFF_MAX = 300.0
VOLUME_RETRY = 5.0
DEFAULT_GRACE = 30


# ---- configuration -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    node: str
    pod_cidr: str
    kubeconfig: Path
    api_host: str
    api_port: int
    dns: str
    octet: int
    """The second octet of the cluster's pod range, which names its hub (:mod:`network`)."""
    node_ip: str
    """The node's address: on loopback, where the API server reaches the kubelet."""
    domain: str
    root: Path
    capacity: Mapping[str, str]
    images: list[JSON]
    lease_seconds: int = 10
    renew_seconds: float = 1.0
    status_seconds: float = 10.0
    port: int = 10250
    version: str = "v0.0.0"
    cgroup: str = "ddpjob-kubelet"
    """The kubelet's memory cgroup, under its own (the control plane removes it at the end)."""

    @classmethod
    def load(cls, path: Path) -> Config:
        raw = json.loads(path.read_text())
        raw["kubeconfig"] = Path(raw["kubeconfig"])
        raw["root"] = Path(raw["root"])
        return cls(**raw)


# ---- runtime records -----------------------------------------------------------------------


@dataclasses.dataclass
class Probe:
    spec: JSON
    kind: str
    """readiness or liveness"""
    next_due: float
    successes: int = 0
    failures: int = 0
    ok: bool = False
    running: bool = False


@dataclasses.dataclass
class Container:
    spec: JSON
    index: int
    init: bool
    proc: ContainerProcess | None = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    cgroup: Path | None = None
    restart_count: int = 0
    started_at: str | None = None
    waiting: tuple[str, str] = ("ContainerCreating", "")
    terminated: JSON | None = None
    last_terminated: JSON | None = None
    next_start: float = 0.0
    backoff: float = 0.0
    probes: list[Probe] = dataclasses.field(default_factory=list)
    ever_started: bool = False
    walked: float = 0.0
    """When the process tree was last walked (only without a cgroup)."""

    @property
    def name(self) -> str:
        return str(self.spec["name"])

    @property
    def where(self) -> str:
        return f"spec.{'initContainers' if self.init else 'containers'}[{self.index}]"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.terminated is None

    @property
    def ready(self) -> bool:
        if not self.running:
            return False
        readiness = [p for p in self.probes if p.kind == "readiness"]
        return all(p.ok for p in readiness)

    def log_path(self, pod_dir: Path, restart: int | None = None) -> Path:
        number = self.restart_count if restart is None else restart
        return pod_dir / "logs" / self.name / f"{number}.log"

    def status(self, image_id: str) -> JSON:
        # Every state key is sent, the others as null: a strategic merge patch merges maps, so
        # a "terminated" would otherwise sit next to the old "running".
        state: JSON = {"waiting": None, "running": None, "terminated": None}
        if self.terminated is not None:
            state["terminated"] = self.terminated
        elif self.running:
            state["running"] = {"startedAt": self.started_at}
        else:
            reason, message = self.waiting
            state["waiting"] = {"reason": reason, "message": message or None}
        out: JSON = {
            "name": self.name,
            "image": self.spec.get("image", ""),
            "imageID": image_id,
            "ready": self.ready,
            "restartCount": self.restart_count,
            "started": self.running,
            "state": state,
            "lastState": {"terminated": self.last_terminated},
        }
        if self.ever_started:
            out["containerID"] = f"process://{self.name}-{self.restart_count}"
        return out


@dataclasses.dataclass
class Pod:
    uid: str
    namespace: str
    name: str
    api: JSON
    dir: Path
    ip: str
    netns: Path | None
    """Where the pod's network namespace is bound (None: ``hostNetwork``)."""
    start_time: str
    init: list[Container]
    containers: list[Container]
    volumes: dict[str, runtime.Mount] | None = None
    volume_error: str = ""
    next_volume_try: float = 0.0
    transitions: dict[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    deleting: bool = False
    gone: bool = False
    """The API no longer has it."""
    killed: bool = False
    """Its containers were stopped because it is gone."""
    confirmed: bool = False
    written: JSON | None = None
    failed_init: bool = False
    checked: float = 0.0
    """When the API's copy of its status was last compared with ours."""

    @property
    def restart_policy(self) -> str:
        return str(self.api.get("spec", {}).get("restartPolicy") or "Always")

    @property
    def grace(self) -> float:
        meta = self.api.get("metadata", {})
        if meta.get("deletionGracePeriodSeconds") is not None:
            return float(meta["deletionGracePeriodSeconds"])
        return float(self.api.get("spec", {}).get("terminationGracePeriodSeconds", DEFAULT_GRACE))

    def all(self) -> list[Container]:
        return [*self.init, *self.containers]

    def processes_gone(self) -> bool:
        return all(c.proc is None for c in self.all())


# ---- status (pure) -------------------------------------------------------------------------


def pod_phase(pod: Pod) -> str:
    """The phase from the containers, as the kubelet computes it for its restart policy."""
    if pod.failed_init:
        return "Failed"
    if pod.init and any(
        c.terminated is None or c.terminated.get("exitCode") != 0 for c in pod.init
    ):
        return "Pending"
    main = pod.containers
    if any(c.running for c in main):
        return "Running"
    if not all(c.terminated is not None for c in main):
        # Waiting to start, or to restart after a back-off.
        return "Running" if any(c.ever_started for c in main) else "Pending"
    codes = [int((c.terminated or {}).get("exitCode", 1)) for c in main]
    if pod.restart_policy == "Always" and not pod.deleting:
        return "Running"
    if pod.restart_policy == "OnFailure" and not pod.deleting and any(codes):
        return "Running"
    return "Succeeded" if not any(codes) else "Failed"


def _condition(pod: Pod, kind: str, status: bool, reason: str = "", message: str = "") -> JSON:
    return condition(pod.transitions, kind, status, reason, message)


def pod_conditions(pod: Pod, phase: str) -> list[JSON]:
    terminal = phase in ("Succeeded", "Failed")
    pending_init = [c.name for c in pod.init if (c.terminated or {}).get("exitCode") != 0]
    unready = [c.name for c in pod.containers if not c.ready]
    ready = not unready and not terminal
    not_ready_reason = "PodCompleted" if terminal else "ContainersNotReady"
    not_ready_message = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
    return [
        _condition(pod, "PodReadyToStartContainers", pod.volumes is not None and not terminal),
        _condition(
            pod,
            "Initialized",
            not pending_init,
            "" if not pending_init else "ContainersNotInitialized",
            ""
            if not pending_init
            else f"containers with incomplete status: [{' '.join(pending_init)}]",
        ),
        _condition(
            pod,
            "ContainersReady",
            ready,
            "" if ready else not_ready_reason,
            "" if ready else not_ready_message,
        ),
        _condition(
            pod,
            "Ready",
            ready,
            "" if ready else not_ready_reason,
            "" if ready else not_ready_message,
        ),
    ]


def pod_status(pod: Pod, host_ip: str) -> JSON:
    phase = pod_phase(pod)
    image_id = "process-kubelet://"
    containers = [c.status(image_id + str(c.spec.get("image", ""))) for c in pod.containers]
    init = [c.status(image_id + str(c.spec.get("image", ""))) for c in pod.init]
    conditions = pod_conditions(pod, phase)
    return podstatus.pod_status(
        phase, host_ip, pod.ip, pod.start_time, conditions, containers, init
    )


# ---- the kubelet ---------------------------------------------------------------------------


class Kubelet:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.endpoint = Endpoint.from_kubeconfig(config.kubeconfig)
        self.api = Client(self.endpoint, f"process-kubelet/{config.version} ({config.node})")
        self.images = runtime.Images.from_json(config.images)
        self.addresses = runtime.Addresses(config.pod_cidr)
        self.node_ip = config.node_ip
        self.cgroups = runtime.Cgroups.find(config.cgroup)
        self.pods: dict[str, Pod] = {}
        self.seen: dict[str, JSON] = {}
        self.deleted: set[str] = set()
        """The uids of pods the API no longer has: an event a stale watch still delivers for
        one of them must not bring it back (a uid is never reused)."""
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.stop = threading.Event()
        self.probe_pool = concurrent.futures.ThreadPoolExecutor(max_workers=8)
        self.identity = NodeIdentity(
            name=config.node,
            pod_cidr=config.pod_cidr,
            node_ip=config.node_ip,
            capacity=config.capacity,
            kubelet_version=config.version,
            runtime="process",
            kernel=platform.release(),
            kubelet_port=config.port,
            ready_message="process kubelet is posting ready status",
        )
        self.zombies: set[int] = set()
        self.zombies_checked = 0.0
        config.root.mkdir(parents=True, exist_ok=True)

    # ---- node ---------------------------------------------------------------------------

    def register(self) -> None:
        while not self.stop.is_set():
            try:
                self.identity.register(self.api)
                return
            except (ApiError, requests.RequestException) as exc:
                log.warning("registering the node: %s", exc)
            self.stop.wait(1)

    def heartbeat(self) -> None:
        api = Client(self.endpoint, self.api.session.headers["User-Agent"])
        next_status = time.monotonic() + self.config.status_seconds
        while not self.stop.is_set():
            try:
                self.identity.renew_lease(api, self.config.lease_seconds)
                if time.monotonic() >= next_status:
                    self.identity.post_status(api)
                    next_status = time.monotonic() + self.config.status_seconds
            except (ApiError, requests.RequestException) as exc:
                log.warning("heartbeat: %s", exc)
            self.stop.wait(self.config.renew_seconds)

    # ---- watching the pods bound here ----------------------------------------------------

    def watch_pods(self) -> None:
        api = Client(self.endpoint, self.api.session.headers["User-Agent"])
        podstatus.watch_bound(api, self.config.node, self, self.stop)

    # ---- the sync loop --------------------------------------------------------------------

    def run(self) -> None:
        self.register()
        for target in (self.heartbeat, self.watch_pods, self.serve_logs):
            threading.Thread(target=target, daemon=True, name=target.__name__).start()
        last_pass = time.monotonic()
        relist = False
        while not self.stop.is_set():
            self.wake.wait(TICK)
            self.wake.clear()
            now = time.monotonic()
            if now - last_pass > STALL_SECONDS:
                log.warning(
                    "the sync loop stalled for %.1fs: listing the pods again", now - last_pass
                )
                relist = True
            last_pass = now
            if relist:
                relist = not self.relist()
            with self.lock:
                seen = dict(self.seen)
            for uid, body in seen.items():
                pod = self.pods.get(uid)
                if pod is None:
                    self.admit(body)  # deleted before it started: confirmed at once by sync
                else:
                    pod.api = body
            for uid, pod in list(self.pods.items()):
                if uid not in seen:
                    pod.gone = True
                try:
                    self.sync(pod)
                except Exception:
                    log.exception("syncing pod %s/%s", pod.namespace, pod.name)
            self.reap_zombies()

    def relist(self) -> bool:
        """List the pods bound here (the watch may be far behind): every pod known before the
        list that it lacks is gone from the API, and is killed in this pass. False when the
        API did not answer (the next pass tries again)."""
        with self.lock:
            known = set(self.seen)
        try:
            listed = self.api.get("/api/v1/pods", fieldSelector=f"spec.nodeName={self.config.node}")
        except (ApiError, requests.RequestException) as exc:
            log.warning("listing the pods again: %s", exc)
            return False
        gone = known - {p["metadata"]["uid"] for p in listed.get("items") or []}
        with self.lock:
            self.deleted |= gone
            for uid in gone:
                self.seen.pop(uid, None)
        if gone:
            log.warning("pods deleted while the kubelet stalled: %s", ", ".join(sorted(gone)))
        return True

    def reap_zombies(self) -> None:
        """As PID 1 of the node, wait for the orphans re-parented to us once they exit.

        Only zombies already seen a second ago: a probe's process is a zombie for a moment
        until its own ``subprocess`` call reaps it, and must not lose its exit status to us.
        """
        now = time.monotonic()
        if now - self.zombies_checked < 1.0:
            return
        self.zombies_checked = now
        roots = {c.proc.pid for pod in self.pods.values() for c in pod.all() if c.proc}
        try:
            zombies = {
                child.pid
                for child in psutil.Process().children()
                if child.pid not in roots and child.status() == psutil.STATUS_ZOMBIE
            }
        except psutil.Error:
            return
        for pid in zombies & self.zombies:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
        self.zombies = zombies

    def admit(self, body: JSON) -> None:
        meta = body["metadata"]
        spec = body.get("spec") or {}
        uid = meta["uid"]
        directory = self.config.root / "pods" / uid
        if spec.get("hostNetwork") is True:
            ip, netns = self.node_ip, None
        else:
            ip, netns = self.addresses.take(), directory / "netns"
            try:
                network.add_pod(netns, self.config.octet, ip)
            except network.NetworkError as exc:  # tried again in the next pass
                self.addresses.give_back(ip)
                log.error("no sandbox for %s/%s: %s", meta["namespace"], meta["name"], exc)
                return
        pod = Pod(
            uid=uid,
            namespace=meta["namespace"],
            name=meta["name"],
            api=body,
            dir=directory,
            ip=ip,
            netns=netns,
            start_time=rfc3339(),
            init=[Container(c, i, True) for i, c in enumerate(spec.get("initContainers") or [])],
            containers=[Container(c, i, False) for i, c in enumerate(spec.get("containers") or [])],
        )
        for c in pod.init[1:]:
            c.waiting = ("PodInitializing", "")
        if pod.init:
            for c in pod.containers:
                c.waiting = ("PodInitializing", "")
        (pod.dir / "logs").mkdir(parents=True, exist_ok=True)
        hostname = str(spec.get("hostname") or pod.name)
        subdomain = spec.get("subdomain")
        fqdn = (
            f"{hostname}.{subdomain}.{pod.namespace}.svc.{self.config.domain}"
            if subdomain
            else None
        )
        runtime.write_file(pod.dir / "etc-hosts", runtime.hosts_file(pod.ip, hostname, fqdn))
        runtime.write_file(
            pod.dir / "resolv.conf",
            runtime.resolv_conf(pod.namespace, self.config.dns, self.config.domain),
        )
        self.pods[uid] = pod
        log.info("admitted %s/%s (%s) at %s", pod.namespace, pod.name, uid, pod.ip)

    def sync(self, pod: Pod) -> None:
        now = time.monotonic()
        meta = pod.api.get("metadata", {})
        if pod.gone and not pod.killed:
            # Outside the desired set: killed with a grace period of 1 s, as a kubelet kills
            # such pods; one that was stopping gracefully has at most 1 s of its grace left.
            pod.deleting = pod.killed = True
            log.info(
                "killing %s/%s (%s): the API no longer has it", pod.namespace, pod.name, pod.uid
            )
            for c in pod.all():
                if c.proc is None:
                    continue
                c.proc.stop(now, GONE_GRACE)
                assert c.proc.stopping_since is not None
                left = c.proc.stopping_since + c.proc.grace_seconds - now
                if left > GONE_GRACE:
                    c.proc.grace_seconds -= left - GONE_GRACE
        if meta.get("deletionTimestamp") and not pod.deleting:
            pod.deleting = True
            running = [c for c in pod.all() if c.running]
            for c in running:
                assert c.proc is not None
                c.proc.stop(now, pod.grace)
            if running:
                self.event(
                    pod,
                    "Normal",
                    "Killing",
                    f"Stopping containers {', '.join(c.name for c in running)}",
                )
        self.reap(pod, now)
        if pod.gone:
            if pod.processes_gone():
                self.forget(pod)
            return
        if not pod.deleting:
            self.ensure_volumes(pod, now)
            if pod.volumes is not None:
                self.start_containers(pod, now)
            self.probe(pod, now)
        status = pod_status(pod, self.node_ip)
        if status != pod.written or self.drifted(pod, status, now):
            self.write_status(pod, status)
        if pod.deleting and pod.processes_gone() and not pod.confirmed and pod.written == status:
            self.confirm_deletion(pod)

    def drifted(self, pod: Pod, status: JSON, now: float) -> bool:
        """The API's copy of what we own disagrees with ours (a slow write of ours that landed
        after a later one, say): write it again, as the kubelet's status manager re-syncs."""
        if now - pod.checked < RESYNC_SECONDS:
            return False
        pod.checked = now
        current = pod.api.get("status") or {}

        def states(statuses: object) -> dict[str, list[str]]:
            return {
                str(c["name"]): sorted(k for k, v in (c.get("state") or {}).items() if v)
                for c in statuses or []  # type: ignore[attr-defined]
            }

        return current.get("phase") != status["phase"] or states(
            current.get("containerStatuses")
        ) != states(status["containerStatuses"])

    # ---- containers -----------------------------------------------------------------------

    def reap(self, pod: Pod, now: float) -> None:
        for c in pod.all():
            if c.proc is None:
                continue
            exited = c.proc.exit_code is not None
            if c.terminated is None and exited:
                self.record_exit(pod, c)
            walk = c.proc.members is None and now - c.walked >= TREE_WALK_SECONDS
            if not (exited or walk or c.proc.stopping_since is not None):
                continue  # nothing to do while it runs: poll() above is the cheap check
            c.walked = now
            if c.proc.reap(now):
                if c.terminated is None:
                    # Killed at the end of its grace period and gone within this same reap:
                    # its exit is recorded here, or its status would read "never started".
                    self.record_exit(pod, c)
                c.proc.close()
                if c.cgroup is not None and self.cgroups is not None:
                    self.cgroups.remove(c.cgroup)
                c.proc = None

    def record_exit(self, pod: Pod, c: Container) -> None:
        assert c.proc is not None
        code = int(c.proc.exit_code or 0)
        reason = "Completed" if code == 0 else "Error"
        message = ""
        if code == runtime.SETUP_FAILED and runtime.SETUP_MARKER in _tail(c.proc.log_path):
            reason, message = "StartError", _tail(c.proc.log_path).strip()[-500:]
        if c.cgroup is not None and self.cgroups is not None and self.cgroups.oom_kills(c.cgroup):
            reason = "OOMKilled"
        if code != 0 and not message and c.spec.get("terminationMessagePolicy") == FALLBACK:
            message = log_tail(_tail(c.proc.log_path))
        c.terminated = {
            "exitCode": code,
            "reason": reason,
            "startedAt": c.started_at,
            "finishedAt": rfc3339(),
            "containerID": f"process://{c.name}-{c.restart_count}",
            **({"message": message} if message else {}),
        }
        for probe in c.probes:
            probe.ok = False
        if reason == "OOMKilled":
            self.event(
                pod, "Warning", "OOMKilling", f"Container {c.name} was OOM-killed (memory limit)"
            )
        self.after_exit(pod, c)

    def start_containers(self, pod: Pod, now: float) -> None:
        if pod.failed_init:
            return
        for c in pod.init:
            done = c.terminated is not None and c.terminated.get("exitCode") == 0
            if done:
                continue
            self.maybe_start(pod, c, now)
            return  # init containers run one at a time, in order
        for c in pod.containers:
            self.maybe_start(pod, c, now)

    def maybe_start(self, pod: Pod, c: Container, now: float) -> None:
        if c.running or now < c.next_start:
            if c.terminated is not None and now < c.next_start:
                c.waiting = (
                    "CrashLoopBackOff",
                    f"back-off {int(c.backoff)}s restarting failed container={c.name} "
                    f"pod={pod.name}_{pod.namespace}({pod.uid})",
                )
            return
        if c.terminated is not None:
            restart = pod.restart_policy == "Always" or (
                pod.restart_policy == "OnFailure" and c.terminated.get("exitCode") != 0
            )
            if not restart:
                return
            c.last_terminated = c.terminated
            c.terminated = None
            c.restart_count += 1
        self.start(pod, c, now)

    def start(self, pod: Pod, c: Container, now: float) -> None:
        image = self.images.resolve(str(c.spec.get("image", "")))
        if image is None:
            first = c.waiting[0] not in ("ErrImagePull", "ImagePullBackOff")
            reason = "ErrImagePull" if first else "ImagePullBackOff"
            message = (
                f'image "{c.spec.get("image")}" is not one the process kubelet can run '
                f"(it knows: {', '.join(self.images.names())})"
            )
            if first:
                self.event(pod, "Warning", "Failed", f"Failed to pull image: {message}")
            c.waiting = (reason, message)
            c.next_start = now + (1.0 if first else 10.0)
            return
        try:
            self.check_non_root(pod, c, image)
            c.env = container_env(
                c.spec,
                base={**image.env, **self.service_env(pod)},
                fields=self.fields(pod),
                where=c.where,
                source=functools.partial(self.env_source, pod),
            )
        except LocalPodError as exc:
            if c.waiting[0] != "CreateContainerConfigError":
                self.event(pod, "Warning", "Failed", f"Error: {exc}")
            c.waiting = ("CreateContainerConfigError", str(exc))
            c.next_start = now + 2.0
            return
        log_path = c.log_path(pod.dir)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        try:
            argv = container_argv(
                c.spec, c.env, where=c.where, entrypoint=image.entrypoint, cmd=image.cmd
            )
        except LocalPodError as exc:
            c.ever_started = True
            c.terminated = {
                "exitCode": 128,
                "reason": "StartError",
                "message": str(exc),
                "startedAt": rfc3339(0),
                "finishedAt": rfc3339(),
                "containerID": f"process://{c.name}-{c.restart_count}",
            }
            self.event(pod, "Warning", "Failed", f"Error: {exc}")
            self.after_exit(pod, c)
            return
        c.cgroup = None
        if self.cgroups is not None:
            c.cgroup = self.cgroups.create(
                f"{pod.uid}-{c.name}-{c.restart_count}", runtime.memory_limit(c.spec)
            )
        mounts = []
        for number, (target, source) in enumerate(sorted(image.files.items())):
            layer = pod.dir / "rootfs" / c.name / str(c.restart_count) / str(number)
            upper, work = layer / "upper", layer / "work"
            upper.mkdir(parents=True, exist_ok=True)
            work.mkdir(parents=True, exist_ok=True)
            mounts.append(runtime.Mount(source, target, overlay=(str(upper), str(work))))
        assert pod.volumes is not None
        for mount in c.spec.get("volumeMounts") or []:
            volume = pod.volumes.get(mount["name"])
            if volume is None:
                continue
            source = volume.source
            if mount.get("subPath"):
                source = str(Path(source) / mount["subPath"])
                Path(source).mkdir(parents=True, exist_ok=True)
            mounts.append(
                runtime.Mount(
                    source, mount["mountPath"], bool(mount.get("readOnly")) or volume.read_only
                )
            )
        hostname = str(pod.api.get("spec", {}).get("hostname") or pod.name)
        wrapper = runtime.wrapper(
            hostname=hostname,
            hosts=pod.dir / "etc-hosts",
            resolv=pod.dir / "resolv.conf",
            mounts=mounts,
            working_dir=str(c.spec.get("workingDir") or image.working_dir),
            cgroup=c.cgroup,
            netns=pod.netns,
        )
        members = None if c.cgroup is None else c.cgroup / "cgroup.procs"
        c.proc = spawn(
            argv, env=c.env, cwd="/", log_path=log_path, wrapper=wrapper, members=members
        )
        c.started_at = rfc3339()
        c.ever_started = True
        c.probes = [
            Probe(c.spec[key], kind, now + float(c.spec[key].get("initialDelaySeconds", 0)))
            for key, kind in (("readinessProbe", "readiness"), ("livenessProbe", "liveness"))
            if c.spec.get(key)
        ]
        self.event(pod, "Normal", "Started", f"Started container {c.name}")

    def after_exit(self, pod: Pod, c: Container) -> None:
        """A failed init container fails a pod that will not restart it; a container that will
        be restarted waits the kubelet's back-off (10 s, doubling, at most 5 min) first."""
        code = int((c.terminated or {}).get("exitCode", 1))
        restart = pod.restart_policy == "Always" or (
            pod.restart_policy == "OnFailure" and code != 0
        )
        if c.init and code != 0 and not restart:
            pod.failed_init = True
        if restart and not pod.deleting:
            c.backoff = BACKOFF_START if c.backoff == 0 else min(c.backoff * 2, BACKOFF_MAX)
            c.next_start = time.monotonic() + c.backoff

    def check_non_root(self, pod: Pod, c: Container, image: runtime.Image) -> None:
        pod_security = pod.api.get("spec", {}).get("securityContext") or {}
        security = c.spec.get("securityContext") or {}
        non_root = security.get("runAsNonRoot", pod_security.get("runAsNonRoot"))
        user = security.get("runAsUser", pod_security.get("runAsUser", image.user))
        if non_root and int(user) == 0:
            raise LocalPodError(
                f'container has runAsNonRoot and image will run as root (pod: "{pod.name}_'
                f'{pod.namespace}({pod.uid})", container: {c.name})'
            )

    def service_env(self, pod: Pod) -> dict[str, str]:
        """The ``kubernetes`` Service: its ClusterIP from a pod's own namespace (forwarded to
        the API server by the hub), the API server itself from the node's."""
        if pod.netns is None:
            host, port = self.config.api_host, str(self.config.api_port)
        else:
            host, port = network.API_SERVICE_IP, str(network.API_SERVICE_PORT)
        return {
            "KUBERNETES_SERVICE_HOST": host,
            "KUBERNETES_SERVICE_PORT": port,
            "KUBERNETES_SERVICE_PORT_HTTPS": port,
            "KUBERNETES_PORT": f"tcp://{host}:{port}",
            f"KUBERNETES_PORT_{port}_TCP": f"tcp://{host}:{port}",
            f"KUBERNETES_PORT_{port}_TCP_PROTO": "tcp",
            f"KUBERNETES_PORT_{port}_TCP_PORT": port,
            f"KUBERNETES_PORT_{port}_TCP_ADDR": host,
        }

    def fields(self, pod: Pod) -> dict[str, str]:
        meta = pod.api.get("metadata", {})
        spec = pod.api.get("spec", {})
        out = {
            "metadata.name": pod.name,
            "metadata.namespace": pod.namespace,
            "metadata.uid": pod.uid,
            "spec.nodeName": self.config.node,
            "spec.serviceAccountName": str(spec.get("serviceAccountName") or "default"),
            "status.hostIP": self.node_ip,
            "status.hostIPs": self.node_ip,
            "status.podIP": pod.ip,
            "status.podIPs": pod.ip,
        }
        for key, value in (meta.get("labels") or {}).items():
            out[f"metadata.labels['{key}']"] = str(value)
        for key, value in (meta.get("annotations") or {}).items():
            out[f"metadata.annotations['{key}']"] = str(value)
        return out

    def env_source(
        self, pod: Pod, kind: str, ref: Mapping[str, Any]
    ) -> str | Mapping[str, str] | None:
        if kind == "resourceFieldRef":
            return self.resource_field(pod, ref)
        if kind not in ("configMapKeyRef", "secretKeyRef", "configMapRef", "secretRef"):
            raise LocalPodError(f"{kind} is not a kind of env source the process kubelet knows")
        plural = "configmaps" if kind.startswith("configMap") else "secrets"
        name = ref.get("name", "")
        try:
            obj = self.api.get(f"/api/v1/namespaces/{pod.namespace}/{plural}/{name}")
        except ApiError as exc:
            if exc.status == 404 and ref.get("optional"):
                return None
            raise LocalPodError(f'{plural[:-1]} "{name}" not found') from exc
        data = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if plural == "secrets":
            data = {k: base64.b64decode(v).decode(errors="replace") for k, v in data.items()}
        if kind.endswith("Ref") and kind in ("configMapRef", "secretRef"):
            return data
        key = str(ref.get("key", ""))
        if key not in data:
            if ref.get("optional"):
                return None
            raise LocalPodError(f"couldn't find key {key} in {plural[:-1]} {pod.namespace}/{name}")
        return data[key]

    def resource_field(self, pod: Pod, ref: Mapping[str, Any]) -> str:
        containers = pod.api.get("spec", {}).get("containers") or []
        name = ref.get("containerName") or (containers[0]["name"] if containers else "")
        container: JSON = next((c for c in containers if c["name"] == name), {})
        section, _, resource = str(ref.get("resource", "")).partition(".")
        value = ((container.get("resources") or {}).get(section) or {}).get(resource)
        if value is None:
            value = self.config.capacity.get(resource, "0")
        divisor = parse_quantity(ref.get("divisor") or "1")
        return str(math.ceil(parse_quantity(value) / divisor))

    # ---- volumes --------------------------------------------------------------------------

    def ensure_volumes(self, pod: Pod, now: float) -> None:
        if pod.volumes is not None or now < pod.next_volume_try:
            return
        try:
            pod.volumes = self.make_volumes(pod)
            pod.volume_error = ""
        except LocalPodError as exc:
            if str(exc) != pod.volume_error:
                self.event(pod, "Warning", "FailedMount", str(exc))
            pod.volume_error = str(exc)
            pod.next_volume_try = now + VOLUME_RETRY

    def make_volumes(self, pod: Pod) -> dict[str, runtime.Mount]:
        out: dict[str, runtime.Mount] = {}
        for volume in pod.api.get("spec", {}).get("volumes") or []:
            name = str(volume["name"])
            target = pod.dir / "volumes" / name
            if "emptyDir" in volume:
                empty = volume["emptyDir"] or {}
                target.mkdir(parents=True, exist_ok=True)
                if empty.get("medium") == "Memory":
                    size = int(
                        parse_quantity(empty.get("sizeLimit") or self.config.capacity["memory"])
                    )
                    if not runtime.mount_tmpfs(target, size):
                        raise LocalPodError(f"volume {name}: could not mount a tmpfs")
                out[name] = runtime.Mount(str(target), "")
            elif "hostPath" in volume:
                out[name] = runtime.Mount(self.host_path(name, volume["hostPath"]), "")
            elif any(k in volume for k in ("configMap", "secret", "projected", "downwardAPI")):
                self.write_projection(pod, name, volume, target)
                out[name] = runtime.Mount(str(target), "", read_only=True)
            else:
                kind = next((k for k in volume if k != "name"), "?")
                raise LocalPodError(
                    f"volume {name}: {kind} volumes are not supported by the process kubelet"
                )
        return out

    def host_path(self, name: str, spec: Mapping[str, Any]) -> str:
        path = Path(str(spec["path"]))
        kind = spec.get("type") or ""
        if kind == "DirectoryOrCreate":
            path.mkdir(parents=True, exist_ok=True)
        elif kind == "FileOrCreate":
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(exist_ok=True)
        elif kind == "Directory" and not path.is_dir():
            raise LocalPodError(
                f"volume {name}: hostPath type check failed: {path} is not a directory"
            )
        elif kind == "File" and not path.is_file():
            raise LocalPodError(f"volume {name}: hostPath type check failed: {path} is not a file")
        return str(path)

    def write_projection(
        self, pod: Pod, name: str, volume: Mapping[str, Any], target: Path
    ) -> None:
        target.mkdir(parents=True, exist_ok=True)
        if "projected" in volume:
            projected = volume["projected"] or {}
            mode = int(projected.get("defaultMode", 0o644))
            sources = projected.get("sources") or []
        else:
            kind = next(k for k in ("configMap", "secret", "downwardAPI") if k in volume)
            spec = volume[kind] or {}
            mode = int(spec.get("defaultMode", 0o644))
            sources = [{kind: spec}]
        for source in sources:
            for path, data in self.projection(pod, name, source):
                runtime.write_file(target / path, data, mode)

    def projection(
        self, pod: Pod, name: str, source: Mapping[str, Any]
    ) -> Iterator[tuple[str, bytes]]:
        if "serviceAccountToken" in source:
            token = source["serviceAccountToken"]
            yield str(token.get("path", "token")), self.token(pod, token).encode()
            return
        if "downwardAPI" in source:
            fields = self.fields(pod)
            for item in (source["downwardAPI"] or {}).get("items") or []:
                field = (item.get("fieldRef") or {}).get("fieldPath", "")
                if field in ("metadata.labels", "metadata.annotations"):
                    values = pod.api.get("metadata", {}).get(field.split(".")[1]) or {}
                    text = "\n".join(f'{k}="{v}"' for k, v in sorted(values.items()))
                else:
                    text = fields.get(field, "")
                yield str(item["path"]), text.encode()
            return
        kind = "configMap" if "configMap" in source else "secret"
        ref = source[kind] or {}
        object_name = ref.get("name") or ref.get("secretName", "")
        plural = "configmaps" if kind == "configMap" else "secrets"
        try:
            obj = self.api.get(f"/api/v1/namespaces/{pod.namespace}/{plural}/{object_name}")
        except ApiError as exc:
            if exc.status == 404 and ref.get("optional"):
                return
            raise LocalPodError(
                f'MountVolume.SetUp failed for volume "{name}": {kind.lower()} "{object_name}" not found'
            ) from exc
        data: dict[str, bytes] = {k: str(v).encode() for k, v in (obj.get("data") or {}).items()}
        if kind == "secret":
            data = {k: base64.b64decode(v) for k, v in data.items()}
        items = ref.get("items")
        if items:
            for item in items:
                if item["key"] in data:
                    yield str(item["path"]), data[item["key"]]
        else:
            yield from data.items()

    def token(self, pod: Pod, spec: Mapping[str, Any]) -> str:
        account = str(pod.api.get("spec", {}).get("serviceAccountName") or "default")
        request: JSON = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": int(spec.get("expirationSeconds", 3607)),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod.name,
                    "uid": pod.uid,
                },
            },
        }
        if spec.get("audience"):
            request["spec"]["audiences"] = [spec["audience"]]
        try:
            answer = self.api.create(
                f"/api/v1/namespaces/{pod.namespace}/serviceaccounts/{account}/token", request
            )
        except ApiError as exc:
            raise LocalPodError(f"serviceAccountToken for {account}: {exc}") from exc
        return str(answer["status"]["token"])

    # ---- probes ---------------------------------------------------------------------------

    def probe(self, pod: Pod, now: float) -> None:
        for c in pod.containers:
            if not c.running:
                continue
            for probe in c.probes:
                if probe.running or now < probe.next_due:
                    continue
                probe.running = True
                probe.next_due = now + float(probe.spec.get("periodSeconds", 10))
                future = self.probe_pool.submit(self.run_probe, pod, c, probe.spec)
                future.add_done_callback(functools.partial(self.probe_done, pod, c, probe))

    def probe_done(
        self, pod: Pod, c: Container, probe: Probe, future: concurrent.futures.Future[bool]
    ) -> None:
        probe.running = False
        ok = bool(future.result()) if future.exception() is None else False
        if ok:
            probe.successes += 1
            probe.failures = 0
            if probe.successes >= int(probe.spec.get("successThreshold", 1)):
                probe.ok = True
        else:
            probe.failures += 1
            probe.successes = 0
            if probe.failures >= int(probe.spec.get("failureThreshold", 3)):
                if probe.ok or probe.failures == int(probe.spec.get("failureThreshold", 3)):
                    self.event(
                        pod, "Warning", "Unhealthy", f"{probe.kind.capitalize()} probe failed"
                    )
                probe.ok = False
                if probe.kind == "liveness" and c.proc is not None and c.running:
                    c.proc.stop(
                        time.monotonic(),
                        float(
                            pod.api.get("spec", {}).get(
                                "terminationGracePeriodSeconds", DEFAULT_GRACE
                            )
                        ),
                    )
        self.wake.set()

    def run_probe(self, pod: Pod, c: Container, spec: Mapping[str, Any]) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))
        if "exec" in spec:
            if c.proc is None:
                return False
            argv = [shutil.which("nsenter") or "nsenter", "-t", str(c.proc.pid), "-m", "-u"]
            argv += ["-n", "--"] if pod.netns is not None else ["--"]
            argv += [str(a) for a in (spec["exec"].get("command") or [])]
            if c.cgroup is not None:
                # In the container's cgroup, as a runtime's exec is: its memory counts against
                # the container's, and stopping the container ends a probe still running (one
                # that outlived a frozen node, say) instead of leaving it on the node.
                join = 'echo $$ > "$0" && exec "$@"'
                argv = ["sh", "-c", join, str(c.cgroup / "cgroup.procs"), *argv]
            try:
                result = subprocess.run(
                    argv, env=c.env, capture_output=True, timeout=timeout, check=False, cwd="/"
                )
            except subprocess.TimeoutExpired:
                return False
            return result.returncode == 0
        port_of = {p.get("name"): p.get("containerPort") for p in c.spec.get("ports") or []}
        if "httpGet" in spec:
            get = spec["httpGet"]
            port = get.get("port")
            port = port_of.get(port, port) if isinstance(port, str) else port
            scheme = str(get.get("scheme", "HTTP")).lower()
            host = str(get.get("host") or pod.ip)
            try:
                status = self.http_get(
                    pod, scheme, (host, int(port)), get.get("path", "/"), timeout
                )
            except (OSError, http.client.HTTPException):
                return False
            return 200 <= status < 400
        if "tcpSocket" in spec:
            port = spec["tcpSocket"].get("port")
            port = port_of.get(port, port) if isinstance(port, str) else port
            try:
                with self.connect(pod, (pod.ip, int(port)), timeout):
                    return True
            except OSError:
                return False
        return True

    def connect(self, pod: Pod, address: tuple[str, int], timeout: float) -> socket.socket:
        """A TCP connection from the pod's network namespace (from the node's: hostNetwork)."""
        if pod.netns is None:
            return socket.create_connection(address, timeout=timeout)
        return network.connect(pod.netns, address, timeout)

    def http_get(
        self, pod: Pod, scheme: str, address: tuple[str, int], path: str, timeout: float
    ) -> int:
        """An httpGet probe's status code (HTTPS unverified, as a kubelet's)."""
        sock = self.connect(pod, address, timeout)
        if scheme == "https":
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
            sock = context.wrap_socket(sock, server_hostname=address[0])
        connection = http.client.HTTPConnection(address[0], address[1], timeout=timeout)
        connection.sock = sock
        try:
            connection.request("GET", path, headers={"User-Agent": "kube-probe/process"})
            return connection.getresponse().status
        finally:
            connection.close()

    # ---- API writes -----------------------------------------------------------------------

    def call(self, pod: Pod, what: str, request: Callable[[], object]) -> int | None:
        """One write about ``pod``: 0 when it went through, the HTTP status of a 404 (the pod
        is gone) or a 409 (the name holds another pod now), None after any other error (logged;
        the next tick tries again)."""
        try:
            request()
        except ApiError as exc:
            if exc.status in (404, 409):
                return exc.status
            log.warning("%s of %s/%s: %s", what, pod.namespace, pod.name, exc)
            return None
        except requests.RequestException as exc:
            log.warning("%s of %s/%s: %s", what, pod.namespace, pod.name, exc)
            return None
        return 0

    def write_status(self, pod: Pod, status: JSON) -> None:
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status"
        body = {"metadata": {"uid": pod.uid}, "status": status}
        code = self.call(pod, "status", lambda: self.api.patch(path, body))
        if code == 0:
            pod.written = status
        elif code == 404:
            pod.gone = True

    def confirm_deletion(self, pod: Pod) -> None:
        """The kubelet's own DELETE once every container is gone: grace 0, this pod's uid."""
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}"
        options = {"gracePeriodSeconds": 0, "preconditions": {"uid": pod.uid}}
        if self.call(pod, "deletion", lambda: self.api.delete(path, options)) is not None:
            pod.confirmed = True

    def forget(self, pod: Pod) -> None:
        runtime.unmount_all(pod.dir)  # the network namespace's bind mount too
        # The containers' logs outlive the pod (a failed test's evidence): <node>/gone/.
        kept = pod.dir.parent.parent / "gone" / f"{pod.namespace}_{pod.name}_{pod.uid}"
        if (pod.dir / "logs").is_dir() and not kept.exists():
            with contextlib.suppress(OSError):
                kept.mkdir(parents=True)
                shutil.move(pod.dir / "logs", kept / "logs")
        shutil.rmtree(pod.dir, ignore_errors=True)
        if pod.netns is not None:
            network.remove_port(self.config.octet, pod.ip)
            self.addresses.give_back(pod.ip)
        self.pods.pop(pod.uid, None)
        log.info("forgot %s/%s (%s)", pod.namespace, pod.name, pod.uid)

    def event(self, pod: Pod, kind: str, reason: str, message: str) -> None:
        now = rfc3339()
        body = {
            "metadata": {"name": f"{pod.name}.{uuid.uuid4().hex[:16]}", "namespace": pod.namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": pod.name,
                "namespace": pod.namespace,
                "uid": pod.uid,
            },
            "reason": reason,
            "message": message[:1024],
            "type": kind,
            "source": {"component": "kubelet", "host": self.config.node},
            "reportingComponent": "kubelet",
            "reportingInstance": self.config.node,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            self.api.create(f"/api/v1/namespaces/{pod.namespace}/events", body)
        except (ApiError, requests.RequestException) as exc:
            log.debug("event %s for %s: %s", reason, pod.name, exc)

    # ---- logs -----------------------------------------------------------------------------

    def find(self, namespace: str, name: str) -> Pod | None:
        found = [p for p in self.pods.values() if (p.namespace, p.name) == (namespace, name)]
        return max(found, key=lambda p: p.start_time) if found else None

    def serve_logs(self) -> None:
        kubelet = self
        cert, key = pki.self_signed(self.config.root / "pki", self.config.node, [self.node_ip])

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                log.debug(format, *args)

            def do_GET(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                parts = url.path.strip("/").split("/")
                if parts == ["healthz"]:
                    self.reply(200, b"ok")
                    return
                if len(parts) != 4 or parts[0] != "containerLogs":
                    self.reply(404, b"not found")
                    return
                pod = kubelet.find(parts[1], parts[2])
                container = (
                    next((c for c in pod.all() if c.name == parts[3]), None) if pod else None
                )
                if pod is None or container is None:
                    self.reply(
                        404, f"container {parts[3]} of {parts[1]}/{parts[2]} not found".encode()
                    )
                    return
                restart = container.restart_count - (1 if query.get("previous") == "true" else 0)
                path = container.log_path(pod.dir, restart)
                if not path.exists():
                    self.reply(
                        400, f'previous terminated container "{container.name}" not found'.encode()
                    )
                    return
                self.stream(path, container, query)

            def reply(self, code: int, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def stream(self, path: Path, container: Container, query: Mapping[str, str]) -> None:
                data = path.read_bytes()
                tail = query.get("tailLines")
                if tail is not None and tail.lstrip("-").isdigit() and int(tail) >= 0:
                    data = (
                        b"".join(data.splitlines(keepends=True)[-int(tail) :]) if int(tail) else b""
                    )
                limit = query.get("limitBytes")
                if limit is not None and limit.isdigit():
                    data = data[: int(limit)]
                if query.get("follow") != "true":
                    self.reply(200, data)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                offset = path.stat().st_size
                self.chunk(data)
                with contextlib.suppress(OSError):
                    while True:
                        with path.open("rb") as f:
                            f.seek(offset)
                            more = f.read()
                        offset += len(more)
                        self.chunk(more)
                        if not container.running and not more:
                            break
                        time.sleep(0.2)
                    self.wfile.write(b"0\r\n\r\n")

            def chunk(self, data: bytes) -> None:
                if data:
                    self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                    self.wfile.flush()

        server = http.server.ThreadingHTTPServer((self.node_ip, self.config.port), Handler)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        server.daemon_threads = True
        server.serve_forever()


FALLBACK = "FallbackToLogsOnError"
TAIL_BYTES, TAIL_LINES = 2048, 80


def log_tail(text: str) -> str:
    """A failed container's termination message under ``FallbackToLogsOnError`` (this kubelet
    writes no termination-message file): the end of its log, at most 2048 bytes or 80 lines,
    whichever is smaller, as a kubelet takes it."""
    lines = text.splitlines(keepends=True)[-TAIL_LINES:]
    data = "".join(lines).encode()[-TAIL_BYTES:]
    return data.decode(errors="replace")


def _tail(path: Path, size: int = 4096) -> str:
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - size))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kube.kubelet")
    parser.add_argument("config", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    kubelet = Kubelet(Config.load(args.config))

    def stop(signum: int, _: object) -> None:
        kubelet.stop.set()
        kubelet.wake.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    kubelet.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
