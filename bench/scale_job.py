"""One job of N pods (1,024) on hollow nodes: the operator, and the Job controller beside it.

``python bench/bench_operator.py --backend real --hollow --pods 1024`` runs this. On the real
control plane of :mod:`tests.harness.kube` with 16 hollow nodes
(:mod:`tests.harness.kube.hollow_nodes`: pods are recorded as running, with an address and an agent
that answers, but nothing runs), the real operator process (the chart's RBAC and flags:
``--ask-agents``, run in the cluster's network as its pod would be) and, in the same run, the
built-in Job controller of kube-controller-manager (its default client: 20 requests a second, burst
30):

1. a 64-pod DDPJob: created -> all pods created, -> all Running; then deleted;
2. a DDPJob of N pods (``kubectl apply``): -> all created, -> all Running;
3. steady state (``--quiet-seconds``), once the job reports every pod ready (how long after
   all Running: ``reported_whole_s``): the operator's requests, status writes, CPU, and how
   often it asks the agents (connections a second, counted by the hollow agents);
4. passes over N pods: the job is touched 10 times (an annotation), each a pass with nothing
   to do; the operator's CPU and its ``ddpjob_reconcile_seconds`` per pass;
5. a node lost at once (the hollow node with most of the job's pods stops reporting): when
   Kubernetes marks it NotReady, when its pods are deleted, force-deleted, replaced, and all
   Running again; each lost pod counted once, nothing charged, status writes meanwhile; the
   node comes back;
6. ``kubectl scale`` N -> N/2 (all surplus pods gone), and back (all Running);
7. every pod exits 0: -> Succeeded; then ``kubectl delete``: -> every pod gone;
8. the same for a batch/v1 Job (parallelism = completions = N, the same pod template):
   created, Running, every pod exits 0 -> Complete, deleted -> every pod gone;

and for each phase: API requests by the controller (from the API server's audit log) against
the floor (the fewest requests that do the same work), the API server's p99 latency of
mutating requests (every client; leases and node status are not in the audit log) and 429s.
It prints a table, and the same as JSON (``--json PATH`` to write it to a file).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import cluster_bench  # noqa: E402
from tests.harness.kube import fixtures, network  # noqa: E402
from tests.harness.kube.client import ApiError, Client  # noqa: E402
from tests.harness.kube.controlplane import ControlPlane  # noqa: E402

JSON = dict[str, Any]
NS = "bench"
DDPJOB = str(Path(sys.executable).parent / "ddpjob")
OPERATOR = f"system:serviceaccount:{fixtures.OPERATOR_NAMESPACE}:{fixtures.OPERATOR_ACCOUNT}"
JOB_CONTROLLER = "system:serviceaccount:kube-system:job-controller"
NODES = 16
"""Hollow nodes by default (``--nodes``): 1,024 pods make 64 a node."""
TRAINER = {
    "name": "trainer",
    "image": "ghcr.io/ddpjob/ddpjob-worker-cpu:0.1.0",
    "command": ["ddpjob-agent"],
    "args": ["train.py"],
}
MUTATING = {"create", "update", "patch", "delete", "deletecollection"}


def now() -> float:
    return time.time()


# ---- what the bench watches ------------------------------------------------------------------


@dataclasses.dataclass
class PodRow:
    name: str
    uid: str
    job: str
    seen: float
    node: str = ""
    running: float | None = None
    deleting: float | None = None
    gone: float | None = None


class Recorder:
    """Every pod of the namespace and every status of the DDPJobs in it, as watched."""

    def __init__(self, cluster: ControlPlane) -> None:
        self.cluster = cluster
        self.lock = threading.Lock()
        self.pods: dict[str, PodRow] = {}
        self.statuses: list[tuple[float, str, str]] = []
        """(when, job, its status as JSON) for every change of a status."""
        self._last_status: dict[str, str] = {}
        self.stop = threading.Event()

    def start(self) -> None:
        for target in (self._pods, self._jobs):
            threading.Thread(target=target, daemon=True).start()

    def _pods(self) -> None:
        api = self.cluster.admin("bench-recorder")

        def listed(items: list[JSON]) -> None:
            for pod in items:
                self._pod("ADDED", pod)

        api.watch(f"/api/v1/namespaces/{NS}/pods", listed, self._pod, self.stop)

    def _pod(self, kind: str, pod: JSON) -> None:
        meta, at = pod["metadata"], now()
        labels = meta.get("labels") or {}
        job = labels.get("ddpjob.io/job-name") or labels.get("batch.kubernetes.io/job-name") or ""
        with self.lock:
            row = self.pods.get(meta["uid"])
            if row is None:
                row = self.pods[meta["uid"]] = PodRow(meta["name"], meta["uid"], job, at)
            row.node = (pod.get("spec") or {}).get("nodeName") or row.node
            if row.running is None and (pod.get("status") or {}).get("phase") == "Running":
                row.running = at
            if row.deleting is None and meta.get("deletionTimestamp"):
                row.deleting = at
            if kind == "DELETED" and row.gone is None:
                row.gone = at

    def _jobs(self) -> None:
        api = self.cluster.admin("bench-recorder")

        def listed(items: list[JSON]) -> None:
            for job in items:
                self._job("ADDED", job)

        path = f"/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs"
        api.watch(path, listed, self._job, self.stop)

    def _job(self, kind: str, job: JSON) -> None:
        name = job["metadata"]["name"]
        text = json.dumps(job.get("status") or {}, separators=(",", ":"))
        with self.lock:
            if self._last_status.get(name) != text:
                self._last_status[name] = text
                self.statuses.append((now(), name, text))

    def rows(self, job: str) -> list[PodRow]:
        with self.lock:
            return [dataclasses.replace(r) for r in self.pods.values() if r.job == job]

    def live(self, job: str) -> list[PodRow]:
        return [r for r in self.rows(job) if r.gone is None]

    def max_status(self, job: str) -> int:
        with self.lock:
            return max(
                (len(text.encode()) for _, name, text in self.statuses if name == job), default=0
            )

    def changes(self, job: str, since: float, until: float) -> list[JSON]:
        """Each change of ``job``'s status between two times: when (seconds after ``since``)
        and what moved (a count's new value, or the names of the other fields that changed),
        to tell why the operator wrote it."""
        with self.lock:
            texts = [(at, text) for at, name, text in self.statuses if name == job]
        before: JSON = next((json.loads(t) for at, t in reversed(texts) if at < since), {})
        out: list[JSON] = []
        for at, text in texts:
            if not since <= at <= until:
                continue
            status = json.loads(text)
            moved: JSON = {}
            for key in sorted(set(before) | set(status)):
                old, new = before.get(key), status.get(key)
                if old == new:
                    continue
                if key == "accountedPods":
                    moved[key] = f"{len(old or [])} -> {len(new or [])}"
                elif isinstance(new, (int, str)) or new is None:
                    moved[key] = new
                elif key == "conditions":
                    moved[key] = _conditions_moved(old or [], new or [])
                else:
                    moved[key] = f"{len(old or [])} -> {len(new or [])} entries"
            out.append({"at_s": round(at - since, 1), "moved": moved})
            before = status
        return out


def _conditions_moved(old: list[JSON], new: list[JSON]) -> str:
    """Which conditions changed, and whether only in their message."""
    was = {c.get("type"): c for c in old}
    said = []
    for c in new:
        prev = was.get(c.get("type")) or {}
        if prev == c:
            continue
        same = all(prev.get(k) == c.get(k) for k in ("status", "reason"))
        said.append(f"{c.get('type')}{' (message)' if same else '=' + str(c.get('status'))}")
    return ", ".join(said)


def wait(what: str, check: Callable[[], object], timeout: float, every: float = 0.2) -> float:
    """Seconds until ``check()`` is truthy; SystemExit naming ``what`` after ``timeout``."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(every)
    raise SystemExit(f"timed out after {timeout:.0f}s waiting for {what}")


# ---- the audit log ---------------------------------------------------------------------------


@dataclasses.dataclass
class Window:
    """A stretch of the run: from one position of the audit log to another."""

    cluster: ControlPlane
    start: int
    end: int = -1
    entries: list[JSON] = dataclasses.field(default_factory=list)

    def close(self) -> Window:
        time.sleep(1.5)  # the API server writes its audit lines a moment after the answer
        self.end = self.cluster.audit_size()
        every = self.cluster.audit(self.start)
        self.entries = every  # lines after ``end`` are few, and belong to the next window too
        return self

    def requests(self, user: str) -> dict[str, int]:
        return cluster_bench.requests_by(self.entries, user)

    def creates(self, user: str, resource: str = "pods") -> list[float]:
        return sorted(at for _, at in cluster_bench.creates_by(self.entries, user, resource))

    def created_at(self, resource: str, name: str) -> float:
        for e in self.entries:
            ref = e.get("objectRef") or {}
            if (
                e.get("verb") == "create"
                and ref.get("resource") == resource
                and (ref.get("name") == name or not ref.get("name"))
                and (e.get("responseStatus") or {}).get("code") == 201
                and ref.get("namespace") == NS
            ):
                return cluster_bench.stamp(e["stageTimestamp"])
        raise SystemExit(f"no create of {resource}/{name} in the audit log")

    def write_latency(self) -> tuple[float, int, int]:
        """The p99 latency of mutating requests (s), how many there were, and how many 429s
        (watches left out: a new CRD's watch cache answers kube-controller-manager's first
        watch-list requests with 429 until it is ready, at every cluster's start)."""
        spent = []
        throttled = 0
        for e in self.entries:
            if (e.get("responseStatus") or {}).get("code") == 429 and e.get("verb") != "watch":
                throttled += 1
            if e.get("verb") not in MUTATING or e.get("stage") != "ResponseComplete":
                continue
            spent.append(
                cluster_bench.stamp(e["stageTimestamp"])
                - cluster_bench.stamp(e["requestReceivedTimestamp"])
            )
        if not spent:
            return 0.0, 0, throttled
        spent.sort()
        return spent[min(len(spent) - 1, int(0.99 * len(spent)))], len(spent), throttled


# ---- the operator ----------------------------------------------------------------------------


class Operator:
    """The operator process, as the chart runs it: in the cluster's network (its hub), through
    the ``kubernetes`` Service, with ``--ask-agents`` unless told otherwise."""

    def __init__(
        self, cluster: ControlPlane, workdir: Path, ask_agents: bool, profile: str | None = None
    ) -> None:
        self.cluster = cluster
        self.workdir = workdir
        self.ask_agents = ask_agents
        self.profile = profile
        self.metrics_port = 18080
        self.process: psutil.Process | None = None

    @contextlib.contextmanager
    def running(self) -> Iterator[psutil.Process]:
        kubeconfig = fixtures.operator_kubeconfig(self.cluster, self.workdir / "op.kubeconfig")
        text = kubeconfig.read_text()
        server = re.search(r"server: (\S+)", text)
        assert server is not None
        inside = kubeconfig.with_name("op.hub.kubeconfig")
        service = f"https://{network.API_SERVICE_IP}:{network.API_SERVICE_PORT}"
        inside.write_text(text.replace(server[1], service))
        program = [DDPJOB]
        if self.profile:
            program = [sys.executable, "-m", "cProfile", "-o", self.profile]
            program += ["-m", "ddpjob_operator.entry"]
        argv = [
            "nsenter", f"--net={self.cluster.hub}", "--",
            *program, "operator", "--namespace", NS,
            f"--metrics-port={self.metrics_port}", "--health-port=0",
            *(["--ask-agents"] if self.ask_agents else []),
        ]  # fmt: skip
        env = {**os.environ, "KUBECONFIG": str(inside)}
        with (self.workdir / "operator.log").open("wb") as log:
            child = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            self.process = psutil.Process(child.pid)
            yield self.process
        finally:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=60)
            except subprocess.TimeoutExpired:
                child.kill()

    def cpu(self) -> float:
        assert self.process is not None
        times = self.process.cpu_times()
        return float(times.user + times.system)

    def peak_rss_mib(self) -> float:
        assert self.process is not None
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def rss_mib(self) -> float:
        assert self.process is not None
        return float(self.process.memory_info().rss) / 2**20

    def reconcile_histogram(self) -> tuple[float, float]:
        """(sum of seconds, count) of ``ddpjob_reconcile_seconds``."""
        with network.inside(self.cluster.hub):
            text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        total = count = 0.0
        for line in text.splitlines():
            if line.startswith("ddpjob_reconcile_seconds_sum"):
                total = float(line.split()[-1])
            elif line.startswith("ddpjob_reconcile_seconds_count"):
                count = float(line.split()[-1])
        return total, count


def pass_in_process(pods: int, count: int = 50) -> JSON:
    """One pass over a running job of ``pods`` pods, in this process: the operator's own work
    (the pods' records, the agents' kept answers applied, the decision, the status compared),
    without the API server, kopf's event handling or new questions to the agents, which the
    operator process's CPU per pass (:meth:`Bench.passes`) includes. Nothing to do: the status
    is the one the previous pass wrote."""
    import asyncio  # noqa: PLC0415 - only here
    import logging  # noqa: PLC0415

    from ddpjob_operator import agents  # noqa: PLC0415 - the operator's own code
    from ddpjob_operator.controller import Controller, OperatorConfig, _Job  # noqa: PLC0415
    from ddpjob_operator.executor import PodRecord  # noqa: PLC0415
    from ddpjob_operator.metrics import Metrics  # noqa: PLC0415
    from ddpjob_operator.observe import ObservedPod, PodPhase  # noqa: PLC0415

    body = ddpjob("big", pods)
    body["metadata"].update(uid="uid-big", resourceVersion="1", generation=1)

    class Kube:
        async def write_status(self, ns: str, name: str, version: str, status: JSON) -> JSON:
            return {**body, "status": status}

        async def workloads_served(self) -> bool:
            return False

        async def create_secret(self, ns: str, secret: JSON) -> None:  # the first pass's
            return None

    records = [
        PodRecord(
            ObservedPod(
                name=f"big-worker-{i}", index=i, uid=f"{i:08d}-0000-4000-8000-000000000000",
                phase=PodPhase.RUNNING, owner_uid="uid-big", ip=f"10.1.{i // 250}.{i % 250 + 1}",
                started=True, ready=True,
            ),
            ("ddpjob.io/pod-tracking",),
        )
        for i in range(pods)
    ]  # fmt: skip
    config = OperatorConfig(ask_agents=True)
    ctl = Controller(Kube(), Metrics(), config)  # type: ignore[arg-type]
    survey = ctl._jobs.setdefault((NS, "big"), _Job()).survey
    answers: dict[str, agents.AgentAnswer | None] = {
        r.observed.name: agents.AgentAnswer(i, "running", pods, host=i == 0, gen=1, round=1)
        for i, r in enumerate(records)
    }
    survey.record(answers, [r.observed for r in records], time.monotonic())
    ctl._asks = agents.Budget(rate=0.0, burst=0)  # no new questions: kept answers only

    async def run(n: int) -> None:
        for _ in range(n):
            await ctl.run_pass(
                (NS, "big"), body, logging.getLogger("bench"),
                pods=lambda: records, service=lambda: True, emit=lambda *event: None,
            )  # fmt: skip

    asyncio.run(run(2))  # the first pass writes the status, the second finds nothing to do
    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(run(count))
    return {
        "passes": count,
        "cpu_ms_per_pass": round(1000 * (time.process_time() - cpu) / count, 2),
        "wall_ms_per_pass": round(1000 * (time.perf_counter() - wall) / count, 2),
    }


# ---- the run ---------------------------------------------------------------------------------


def ddpjob(name: str, pods: int) -> JSON:
    return cluster_bench.ddpjob(name, NS, pods, TRAINER)


def batch_job(name: str, pods: int) -> JSON:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "parallelism": pods,
            "completions": pods,
            "backoffLimit": 6,
            "template": {"spec": {"containers": [TRAINER], "restartPolicy": "Never"}},
        },
    }


class Bench:
    def __init__(self, cluster: ControlPlane, operator: Operator, args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.operator = operator
        self.args = args
        self.api: Client = cluster.admin("ddpjob-bench")
        self.recorder = Recorder(cluster)
        self.out: dict[str, Any] = {}
        self.table: list[tuple[str, str, str, str]] = []
        """(measure, DDPJob operator, Job controller, goal)."""

    def row(self, measure: str, ours: object, theirs: object = "", goal: str = "") -> None:
        self.table.append((measure, str(ours), str(theirs), goal))

    def apply(self, manifest: JSON) -> None:
        fixtures.kubectl_run(
            self.cluster, "apply", "-f", "-", stdin=json.dumps(manifest), check=True
        )

    def window(self) -> Window:
        return Window(self.cluster, self.cluster.audit_size())

    def load(self) -> str:
        one, five, _ = os.getloadavg()
        return f"{one:.2f}/{five:.2f}"

    # ---- the phases -----------------------------------------------------------------------

    def created_and_running(self, kind: str, name: str, pods: int, user: str) -> JSON:
        """Apply, then wait for every pod created and Running; the times from the apply."""
        window = self.window()
        manifest = ddpjob(name, pods) if kind == "ddpjobs" else batch_job(name, pods)
        self.apply(manifest)
        wait(f"{pods} pods of {name}", lambda: len(self.recorder.live(name)) >= pods, 600)
        wait(
            f"{pods} pods of {name} Running",
            lambda: sum(r.running is not None for r in self.recorder.live(name)) >= pods,
            900,
        )
        window.close()
        applied = window.created_at(kind, name)
        creates = window.creates(user)
        running = sorted(r.running for r in self.recorder.live(name) if r.running is not None)
        p99, writes, throttled = window.write_latency()
        return {
            "created_s": round(creates[-1] - applied, 2) if creates else None,
            "first_created_s": round(creates[0] - applied, 2) if creates else None,
            "running_s": round(running[pods - 1] - applied, 2),
            "requests": window.requests(user),
            "write_p99_s": round(p99, 3),
            "writes": writes,
            "429": throttled,
            "load": self.load(),
        }

    def steady(self, name: str, pods: int, seconds: float) -> JSON:
        """Once every pod runs and the job says so (``readyReplicas`` and ``worldSize`` all of
        them, at most 60 s later: how long it took is in the figures), ``seconds`` of nothing
        to do."""
        t_running = now()

        def reported() -> bool:
            status = self.status(name)
            return status.get("readyReplicas") == pods and status.get("worldSize", 0) >= pods

        whole = None
        with contextlib.suppress(SystemExit):
            wait(f"{name} to report all {pods} pods ready", reported, 60.0, every=0.5)
            whole = round(now() - t_running, 1)
        time.sleep(3.0)
        window = self.window()
        cpu = self.operator.cpu()
        asked = self.cluster.hollow_stats()["agent_connections"]
        started, t0 = time.monotonic(), now()
        time.sleep(seconds)
        spent = time.monotonic() - started
        cpu = self.operator.cpu() - cpu
        asked = self.cluster.hollow_stats()["agent_connections"] - asked
        window.close()
        requests_ = window.requests(OPERATOR)
        return {
            "reported_whole_s": whole,
            "seconds": round(spent, 1),
            "requests": requests_,
            "status_writes": requests_.get("patch ddpjobs/status", 0),
            "status_changes": self.recorder.changes(name, t0, now()),
            "cpu_s": round(cpu, 2),
            "core_pct": round(100 * cpu / spent, 1),
            "agent_connects_per_s": round(asked / spent, 1),
            "load": self.load(),
        }

    def passes(self, name: str, count: int = 10) -> JSON:
        path = f"/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs/{name}"
        total, passes = self.operator.reconcile_histogram()
        cpu = self.operator.cpu()
        for i in range(count):
            body = {"metadata": {"annotations": {"bench.ddpjob.io/poke": str(i)}}}
            self.api.patch(path, body, kind="merge-patch")
            time.sleep(1.5)
        cpu = self.operator.cpu() - cpu
        total2, passes2 = self.operator.reconcile_histogram()
        made = max(1.0, passes2 - passes)
        return {
            "passes": int(passes2 - passes),
            "wall_ms_per_pass": round(1000 * (total2 - total) / made, 1),
            "cpu_ms_per_pass": round(1000 * cpu / made, 1),
            "load": self.load(),
        }

    def status(self, name: str) -> JSON:
        job = self.api.get(f"/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs/{name}")
        return dict(job.get("status") or {})

    def lose_node(self, name: str, pods: int) -> JSON:
        rows = self.recorder.live(name)
        by_node: dict[str, list[PodRow]] = {}
        for r in rows:
            by_node.setdefault(r.node, []).append(r)
        node, lost = max(by_node.items(), key=lambda item: len(item[1]))
        lost_names = {r.name for r in lost}
        lost_uids = {r.uid for r in lost}
        before = self.status(name)
        window = self.window()
        cpu = self.operator.cpu()
        t0 = now()
        self.cluster.lose_node(node)
        marks: dict[str, float] = {}

        def node_state() -> None:
            found = self.api.get(f"/api/v1/nodes/{node}")
            conditions: list[JSON] = found["status"]["conditions"]
            ready: JSON = next((c for c in conditions if c["type"] == "Ready"), {})
            if ready.get("status") != "True":
                marks.setdefault("not_ready", now())
            taints = (found.get("spec") or {}).get("taints") or []
            if any(t["key"] == "node.kubernetes.io/unreachable" for t in taints):
                marks.setdefault("tainted", now())

        def replaced() -> bool:
            node_state()
            old = [r for r in self.recorder.rows(name) if r.uid in lost_uids]
            if any(r.deleting for r in old):
                marks.setdefault("first_deleted", min(r.deleting for r in old if r.deleting))
            if old and all(r.gone for r in old):
                marks.setdefault("all_gone", max(r.gone for r in old if r.gone))
            new = [
                r
                for r in self.recorder.live(name)
                if r.name in lost_names and r.uid not in lost_uids
            ]
            if len(new) == len(lost_names):
                marks.setdefault("all_created", max(r.seen for r in new))
                if all(r.running for r in new):
                    marks.setdefault("all_running", max(r.running for r in new if r.running))
                    return True
            return False

        wait(f"replacements of {node}'s {len(lost)} pods Running", replaced, 900, every=0.5)
        cpu = self.operator.cpu() - cpu
        window.close()
        after = self.status(name)
        fresh = [f for f in after.get("failures") or [] if f.get("uid") in lost_uids]
        p99, _, throttled = window.write_latency()
        requests_ = window.requests(OPERATOR)
        result = {
            "node": node,
            "lost_pods": len(lost),
            "since_loss_s": {
                k: round(v - t0, 1) for k, v in sorted(marks.items(), key=lambda i: i[1])
            },
            "restarts_added": after.get("restarts", 0) - before.get("restarts", 0),
            "charged_added": after.get("backoffCount", 0) - before.get("backoffCount", 0),
            "reasons": sorted({f.get("reason") for f in fresh}),
            "status_writes": requests_.get("patch ddpjobs/status", 0),
            "status_changes": self.recorder.changes(name, t0, now()),
            "requests": requests_,
            "cpu_s": round(cpu, 2),
            "write_p99_s": round(p99, 3),
            "429": throttled,
            "load": self.load(),
        }
        self.cluster.revive_node(node)
        time.sleep(3.0)
        result["pods_after_revival"] = len(self.recorder.live(name))
        return result

    def scale(self, name: str, to: int) -> JSON:
        window = self.window()
        t0 = now()
        fixtures.kubectl_run(self.cluster, "-n", NS, "scale", f"ddpj/{name}", f"--replicas={to}")
        wait(
            f"{name} at {to} pods, all Running",
            lambda: (
                len(live := self.recorder.live(name)) == to
                and all(r.running and not r.deleting for r in live)
            ),
            600,
        )
        spent = now() - t0
        window.close()
        requests_ = window.requests(OPERATOR)
        p99, _, throttled = window.write_latency()
        return {
            "to": to,
            "seconds": round(spent, 2),
            "status_writes": requests_.get("patch ddpjobs/status", 0),
            "status_changes": self.recorder.changes(name, t0, now()),
            "requests": requests_,
            "write_p99_s": round(p99, 3),
            "429": throttled,
            "load": self.load(),
        }

    def finish(self, kind: str, name: str, label: str) -> JSON:
        """Every pod exits 0: the job succeeds (Succeeded / Complete)."""
        window = self.window()
        t0 = now()
        told = self.cluster.hollow_exit(NS, selector={label: name}, code=0)
        path = (
            f"/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs/{name}"
            if kind == "ddpjobs"
            else f"/apis/batch/v1/namespaces/{NS}/jobs/{name}"
        )

        def done() -> bool:
            status = self.api.get(path).get("status") or {}
            if kind == "ddpjobs":
                return status.get("phase") == "Succeeded" and not status.get("accountedPods")
            return any(
                c.get("type") == "Complete" and c.get("status") == "True"
                for c in status.get("conditions") or []
            ) and not status.get("uncountedTerminatedPods", {}).get("succeeded")

        spent = wait(f"{name} finished", done, 600, every=0.5)
        time.sleep(2.0)  # the last finalizer removals land
        window.close()
        p99, _, throttled = window.write_latency()
        return {
            "told": told,
            "seconds": round(spent, 2),
            "t0": t0,
            "write_p99_s": round(p99, 3),
            "429": throttled,
            "load": self.load(),
            "_window": window,
        }

    def delete(self, kind: str, name: str) -> JSON:
        window = self.window()
        resource = "ddpj" if kind == "ddpjobs" else "job"
        fixtures.kubectl_run(self.cluster, "-n", NS, "delete", f"{resource}/{name}", "--wait=false")
        spent = wait(f"every pod of {name} gone", lambda: not self.recorder.live(name), 600)
        if kind == "ddpjobs":
            wait(
                f"{name} gone",
                lambda: _missing(
                    self.api, f"/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs/{name}"
                ),
                120,
            )
        window.close()
        return {"seconds": round(spent, 2), "load": self.load(), "_window": window}


def _missing(api: Client, path: str) -> bool:
    try:
        api.get(path)
    except ApiError as exc:
        return exc.status == 404
    return False


def _merge(*counts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for c in counts:
        for key, value in c.items():
            out[key] = out.get(key, 0) + value
    return out


def _total(counts: dict[str, int]) -> int:
    return sum(counts.values())


def run(args: argparse.Namespace, workdir: Path) -> JSON:
    pods = args.pods
    cluster = ControlPlane(
        workdir / "cluster",
        nodes=0,
        hollow=args.nodes,
        before_controllers=fixtures.install_crd,
        # Kubernetes' defaults, not the tests' 6 s: a node is NotReady 50 s after its last
        # heartbeat (and a loaded machine does not make hollow nodes flap).
        node_monitor_period=args.node_monitor_period,
        node_monitor_grace=args.node_monitor_grace,
    )
    with cluster:
        cluster_bench.prepare(cluster, NS)
        operator = Operator(
            cluster, workdir, ask_agents=not args.no_ask_agents, profile=args.profile
        )
        with operator.running():
            bench = Bench(cluster, operator, args)
            bench.recorder.start()
            time.sleep(4.0)  # kopf starts, its watches list
            return measure(bench, pods)


def measure(bench: Bench, pods: int) -> JSON:
    out: JSON = {"pods": pods, "nodes": bench.args.nodes}
    op = bench.operator

    # 1. the 64-pod job
    small = bench.created_and_running("ddpjobs", "small", 64, OPERATOR)
    out["64_pods"] = small
    bench.delete("ddpjobs", "small")
    bench.row(
        "64-pod DDPJob: apply -> all pods created", f"{small['created_s']} s", "", "as before"
    )
    bench.row("64-pod DDPJob: apply -> all Running", f"{small['running_s']} s", "", "")

    # 2. the big job
    cpu0 = op.cpu()
    start = bench.created_and_running("ddpjobs", "big", pods, OPERATOR)
    out["start"] = start
    out["rss_after_start_mib"] = round(op.rss_mib(), 1)
    # 3. steady
    steady = bench.steady("big", pods, bench.args.quiet_seconds)
    out["steady"] = steady
    # 4. passes
    out["passes"] = bench.passes("big")
    out["pass_in_process"] = pass_in_process(pods)
    if bench.args.short:
        out["operator_cpu_s"] = round(op.cpu() - cpu0, 1)
        out["operator_peak_rss_mib"] = round(op.peak_rss_mib(), 1)
        out["status_max_bytes"] = bench.recorder.max_status("big")
        out["table"] = [("(--short: see the JSON)", "", "", "")]
        return out
    # 5. a node lost
    if not bench.args.no_loss:
        out["node_loss"] = bench.lose_node("big", pods)
    if bench.args.to_loss:
        out["operator_cpu_s"] = round(op.cpu() - cpu0, 1)
        out["table"] = [("(--to-loss: see the JSON)", "", "", "")]
        return out
    # 6. scale down and up
    down = bench.scale("big", pods // 2)
    up = bench.scale("big", pods)
    out["scale_down"], out["scale_up"] = down, up
    # 7. finish and delete
    fin = bench.finish("ddpjobs", "big", "ddpjob.io/job-name")
    gone = bench.delete("ddpjobs", "big")
    out["finish"] = {k: v for k, v in fin.items() if not k.startswith("_")}
    out["delete"] = {k: v for k, v in gone.items() if not k.startswith("_")}
    out["operator_cpu_s"] = round(op.cpu() - cpu0, 1)
    out["operator_peak_rss_mib"] = round(op.peak_rss_mib(), 1)
    out["status_max_bytes"] = bench.recorder.max_status("big")
    lifecycle = _merge(start["requests"], fin["_window"].requests(OPERATOR))
    lifecycle = _merge(lifecycle, gone["_window"].requests(OPERATOR))
    out["lifecycle_requests"] = lifecycle
    # The floor: the Service, the store-key Secret, N creates, N finalizer releases, three
    # status writes (pods made, Running, Succeeded), kopf's finalizer added and removed,
    # three Events (CreatedPods, Running, Succeeded).
    floor = 1 + 1 + pods + pods + 3 + 2 + 3
    out["lifecycle_floor"] = floor

    # 8. the Job controller
    theirs = bench.created_and_running("jobs", "anchor", pods, JOB_CONTROLLER)
    out["job_controller_start"] = theirs
    quiet = bench.window()
    time.sleep(min(20.0, bench.args.quiet_seconds))
    quiet.close()
    out["job_controller_steady_status_writes"] = quiet.requests(JOB_CONTROLLER).get(
        "update jobs/status", 0
    ) + quiet.requests(JOB_CONTROLLER).get("patch jobs/status", 0)
    jfin = bench.finish("jobs", "anchor", "batch.kubernetes.io/job-name")
    jgone = bench.delete("jobs", "anchor")
    theirs_lifecycle = _merge(
        theirs["requests"],
        quiet.requests(JOB_CONTROLLER),
        jfin["_window"].requests(JOB_CONTROLLER),
        jgone["_window"].requests(JOB_CONTROLLER),
    )
    out["job_controller_finish"] = {k: v for k, v in jfin.items() if not k.startswith("_")}
    out["job_controller_delete"] = {k: v for k, v in jgone.items() if not k.startswith("_")}
    out["job_controller_lifecycle_requests"] = theirs_lifecycle
    # Its floor: N creates, N finalizer releases, two status writes (active, complete).
    out["job_controller_floor"] = pods + pods + 2

    ours_total, theirs_total = _total(lifecycle), _total(theirs_lifecycle)
    status_writes = lifecycle.get("patch ddpjobs/status", 0)
    their_writes = sum(v for k, v in theirs_lifecycle.items() if k.endswith("jobs/status"))
    n = f"{pods:,}"
    bench.row(
        f"{n} pods: apply -> all created",
        f"{start['created_s']} s",
        f"{theirs['created_s']} s",
        "<= 10 s",
    )
    bench.row(
        f"{n} pods: apply -> all Running",
        f"{start['running_s']} s",
        f"{theirs['running_s']} s",
        "<= 30 s",
    )
    bench.row(
        "API requests per lifecycle (create -> Succeeded -> deleted)",
        f"{ours_total} ({ours_total / floor:.2f}x floor {floor})",
        f"{theirs_total} ({theirs_total / out['job_controller_floor']:.2f}x floor "
        f"{out['job_controller_floor']})",
        "<= 1.3x floor",
    )
    bench.row("status writes per lifecycle", status_writes, their_writes, "<= 60")
    bench.row(
        f"status writes at steady state ({steady['seconds']} s)",
        steady["status_writes"],
        out["job_controller_steady_status_writes"],
        "0",
    )
    bench.row("largest status", f"{out['status_max_bytes']:,} B", "", "< 20 KB")
    bench.row(
        "operator: peak RSS / CPU for the lifecycle",
        f"{out['operator_peak_rss_mib']} MiB / {out['operator_cpu_s']} s",
        "",
        "<= 300 MiB / <= 60 s",
    )
    passes, alone = out["passes"], out["pass_in_process"]
    bench.row(
        f"one pass over {n} pods: the operator process (CPU, wall)",
        f"{passes['cpu_ms_per_pass']} ms, {passes['wall_ms_per_pass']} ms",
        "",
        "",
    )
    bench.row(
        f"one pass over {n} pods: its own work, in process (CPU, wall)",
        f"{alone['cpu_ms_per_pass']} ms, {alone['wall_ms_per_pass']} ms",
        "",
        "<= 20 ms",
    )
    bench.row(
        "steady state: operator CPU, agent connections",
        f"{steady['core_pct']}% of a core, {steady['agent_connects_per_s']}/s",
        "",
        "<= 50 connections/s",
    )
    loss = out.get("node_loss")
    phases = [p for p in (start, loss, down, up, fin) if p is not None]
    worst = max(p["write_p99_s"] for p in phases)
    throttled = sum(p["429"] for p in phases)
    bench.row(
        "API server p99 write latency (worst phase), 429s",
        f"{worst} s, {throttled}",
        f"{theirs['write_p99_s']} s, {theirs['429']}",
        "<= 1 s, 0",
    )
    if loss is not None:
        marks = loss["since_loss_s"]
        bench.row(
            f"node lost ({loss['lost_pods']} pods): replacements created / Running",
            f"{marks.get('all_created')} s / {marks.get('all_running')} s",
            "",
            "<= 10 s after the agents' cut",
        )
        bench.row(
            "node lost: counted, charged, status writes",
            f"{loss['restarts_added']} {loss['reasons']}, {loss['charged_added']}, "
            f"{loss['status_writes']}",
            "",
            f"{loss['lost_pods']}, 0, <= 3",
        )
    bench.row(
        f"scale {n} -> {pods // 2} -> {n}: seconds, status writes",
        f"{down['seconds']} s + {up['seconds']} s, {down['status_writes']} + {up['status_writes']}",
        "",
        "",
    )
    bench.row(
        "every pod exits 0 -> Succeeded / delete -> all pods gone",
        f"{fin['seconds']} s / {gone['seconds']} s",
        f"{jfin['seconds']} s / {jgone['seconds']} s",
        "",
    )
    out["table"] = bench.table
    return out


def print_table(out: JSON) -> None:
    rows = [("measure", "ddpjob operator", "Job controller", "goal"), *out["table"]]
    widths = [max(len(str(r[i])) for r in rows) for i in range(4)]
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))


def main(args: argparse.Namespace, workdir: Path) -> None:
    out = run(args, workdir)
    out["load_at_end"] = os.getloadavg()
    print_table(out)
    text = json.dumps({k: v for k, v in out.items() if k != "table"}, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    print(f"logs: {workdir}")
