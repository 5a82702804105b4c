"""Operator benchmark: N DDPJobs of M pods, the real operator process, on two API servers.

    python bench/bench_operator.py --jobs 200 --pods 8                # both, side by side
    python bench/bench_operator.py --backend real --jobs 20 --pods 8  # one
    python bench/bench_operator.py --backend real --hollow --pods 1024  # one job of 1,024 pods

``--hollow`` runs another scenario, one large job on 16 hollow nodes with the Job controller
beside it: :mod:`bench.scale_job` says what it measures.

Backends, in the same run:

* ``emulator``: :mod:`tests.harness.emulator` in its own process, with its automatic kubelet (new
  pods are Running at once; graceful deletions are confirmed). The floor of what the operator itself
  costs.
* ``real``: the real control plane of :mod:`tests.harness.kube` (kube-apiserver, controllers,
  scheduler) with three process kubelets that run every pod as a real process: a no-op
  ``sleep`` that exits 0 at a set time. Pods are scheduled, started and reported by real
  components, as a user's pods are. The operator runs with the Helm chart's RBAC.

For each, the benchmark:

1. creates one 64-pod job: job creation -> all 64 pods created (target: within 2 s), and ->
   all 64 Running;
2. creates N jobs of M pods back to back: per job, creation -> all its pods created;
3. once every job is Running, the operator's CPU and API requests over a quiet window (~0);
4. lets every pod succeed and waits for every job to be Succeeded;
5. API requests per job lifecycle (create -> Succeeded) from the API server's request log (the
   emulator's, or the real server's audit log), against the floor: the fewest requests a
   controller doing the same work could make (the Service, M pods, three status writes, M
   finalizer releases, kopf's finalizer added and removed, three Events); the operator's CPU
   seconds and peak RSS.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.harness.emulator, tests.harness.kube
from bench import cluster_bench  # noqa: E402
from tests.harness.emulator import EmulatorProcess  # noqa: E402
from tests.harness.kube import fixtures  # noqa: E402
from tests.harness.kube.controlplane import ControlPlane  # noqa: E402

NS = "bench"
DDPJOB = str(Path(sys.executable).parent / "ddpjob")
JSON = dict[str, Any]
OPERATOR_USER = f"system:serviceaccount:{fixtures.OPERATOR_NAMESPACE}:{fixtures.OPERATOR_ACCOUNT}"


def manifest(name: str, pods: int, container: JSON) -> JSON:
    return cluster_bench.ddpjob(name, NS, pods, container)


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


def wait(what: str, check: Callable[[], bool], timeout: float) -> float:
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if check():
            return time.monotonic() - started
        time.sleep(0.2)
    raise SystemExit(f"timed out after {timeout}s waiting for {what}")


def job_of(pod_name: str) -> str:
    return pod_name.rsplit("-worker-", 1)[0]


def creation_delays(creates: Iterable[tuple[str, float]], created: dict[str, float]) -> list[float]:
    """Per job: job creation -> its last pod created; ``creates`` is (pod name, wall time)."""
    last: dict[str, float] = {}
    for name, when in creates:
        job = job_of(name)
        last[job] = max(last.get(job, 0.0), when)
    return [last[job] - created[job] for job in created if job in last]


class Backend:
    """What the benchmark needs of an API server: requests, a request log, the kubelet's part."""

    name = ""
    url = ""
    session: requests.Session

    def __init__(self) -> None:
        self.operator: psutil.Process | None = None

    def container(self) -> JSON:
        raise NotImplementedError

    def create(self, name: str, pods: int) -> float:
        started = time.time()
        response = self.session.post(
            f"{self.url}/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs",
            json=manifest(name, pods, self.container()),
        )
        response.raise_for_status()
        return started

    def items(self, path: str) -> list[JSON]:
        response = self.session.get(f"{self.url}{path}")
        response.raise_for_status()
        return list(response.json().get("items") or [])

    def jobs(self) -> list[JSON]:
        return self.items(f"/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs")

    def pods(self) -> list[JSON]:
        return self.items(f"/api/v1/namespaces/{NS}/pods")

    def mark(self) -> int:
        """A position in the request log."""
        raise NotImplementedError

    def pod_creates(self, since: int) -> list[tuple[str, float]]:
        """(pod name, wall time) of every successful pod creation after ``since``."""
        raise NotImplementedError

    def operator_requests(self, since: int) -> dict[str, int]:
        """The operator's requests after ``since`` by "verb resource[/sub]", watches excluded."""
        raise NotImplementedError

    def finish_pods(self) -> None:
        """Every pod but the 64-pod job's succeeds."""
        raise NotImplementedError


class Emulated(Backend):
    name = "emulator"

    def __init__(self, em: Any) -> None:
        super().__init__()
        self.em = em
        self.url = em.url
        self.session = requests.Session()

    def container(self) -> JSON:
        return {"name": "trainer", "image": "ddpjob/worker-cpu", "command": ["ddpjob-agent"]}

    def mark(self) -> int:
        entries = self.em.control.requests()
        return int(entries[-1]["seq"]) if entries else 0

    def pod_creates(self, since: int) -> list[tuple[str, float]]:
        return [
            (str(e["name"]), float(e["ts"]))
            for e in self.em.control.requests()
            if e["seq"] > since
            and (e.get("verb"), e.get("resource"), e.get("status")) == ("create", "pods", 201)
        ]

    def operator_requests(self, since: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for entry in self.em.control.requests():
            if entry["seq"] <= since:
                continue
            if (entry.get("resource"), entry.get("verb")) == ("ddpjobs", "create"):
                continue  # the benchmark creating jobs
            if entry.get("verb") in ("watch", None):
                continue
            key = f"{entry['verb']} {entry['resource']}" + (
                f"/{entry['subresource']}" if entry.get("subresource") else ""
            )
            out[key] = out.get(key, 0) + 1
        return out

    def finish_pods(self) -> None:
        for pod in self.pods():
            meta = pod["metadata"]
            if job_of(meta["name"]) != "big":
                self.em.control.set_pod_phase(NS, meta["name"], "Succeeded", exit_code=0)


class Real(Backend):
    name = "real"

    def __init__(self, cluster: ControlPlane, end_after: float) -> None:
        super().__init__()
        self.cluster = cluster
        self.url = cluster.server
        self.session = cluster.admin("ddpjob-bench").session
        self.end = int(time.time() + end_after)

    def container(self) -> JSON:
        # A no-op pod: one `sleep` process that exits 0 at a set time (no polling process).
        script = "now=$(date +%s); exec sleep $((END - now))"
        return {
            "name": "trainer",
            "image": "busybox",
            "command": ["sh", "-c", script],
            "env": [{"name": "END", "value": str(self.end)}],
        }

    def mark(self) -> int:
        return self.cluster.audit_size()

    def pod_creates(self, since: int) -> list[tuple[str, float]]:
        return cluster_bench.creates_by(self.cluster.audit(since), OPERATOR_USER)

    def operator_requests(self, since: int) -> dict[str, int]:
        return cluster_bench.requests_by(self.cluster.audit(since), OPERATOR_USER)

    def finish_pods(self) -> None:
        """The pods exit 0 at ``END`` by themselves."""
        left = self.end - time.time()
        if left > 0:
            time.sleep(left)


@contextlib.contextmanager
def operator_process(kubeconfig: Path, workdir: Path) -> Iterator[psutil.Process]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    with (workdir / "operator.log").open("wb") as log:
        operator = subprocess.Popen(
            [DDPJOB, "operator", "--namespace", NS, "--metrics-port", "0", "--health-port", "0"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield psutil.Process(operator.pid)
        finally:
            operator.send_signal(signal.SIGTERM)
            operator.wait(timeout=60)


def run(bench: Backend, operator: psutil.Process, args: argparse.Namespace) -> dict[str, str]:
    out: dict[str, str] = {}
    time.sleep(3.0)  # the operator starts (kopf, indexes)
    cpu_start = cpu_seconds(operator)

    # 1. one 64-pod job
    since = bench.mark()
    big = bench.create("big", 64)
    wait("64 pods", lambda: len(bench.pods()) >= 64, 120)
    big_delay = creation_delays(bench.pod_creates(since), {"big": big})[0]
    out["64-pod job: creation -> all pods created"] = f"{big_delay:.2f} s"

    def big_running() -> bool:
        phases = [p.get("status", {}).get("phase") for p in bench.pods()]
        return phases.count("Running") >= 64

    running = wait("64 pods Running", big_running, 300)
    out["64-pod job: creation -> all pods Running"] = f"{time.time() - big:.2f} s"
    del running

    # 2. N jobs of M pods
    since = bench.mark()
    created: dict[str, float] = {}
    started = time.monotonic()
    for i in range(args.jobs):
        name = f"job-{i:03d}"
        created[name] = bench.create(name, args.pods)
    total = args.jobs * args.pods + 64
    spent = wait(f"{total} pods", lambda: len(bench.pods()) >= total, 900)
    delays = creation_delays(bench.pod_creates(since), created)
    out[f"{args.jobs} jobs x {args.pods} pods: per job, creation -> all pods created"] = (
        f"median {statistics.median(delays):.2f} s, max {max(delays):.2f} s"
    )
    out[f"{args.jobs} jobs x {args.pods} pods: every pod created after the first job"] = (
        f"{spent + (time.monotonic() - started - spent):.1f} s"
    )
    wait(
        "every job Running",
        lambda: all((j.get("status") or {}).get("phase") == "Running" for j in bench.jobs()),
        900,
    )
    out["every job Running after the first was created"] = f"{time.monotonic() - started:.1f} s"

    # 3. steady state
    time.sleep(2.0)
    quiet_start, wall = cpu_seconds(operator), time.monotonic()
    quiet_since = bench.mark()
    time.sleep(args.quiet_seconds)
    quiet_cpu = cpu_seconds(operator) - quiet_start
    quiet_wall = time.monotonic() - wall
    quiet_requests = sum(bench.operator_requests(quiet_since).values())
    out[f"steady state, {args.jobs + 1} running jobs, {quiet_wall:.0f} s"] = (
        f"{quiet_requests} API requests, {quiet_cpu:.2f} CPU s "
        f"({100 * quiet_cpu / quiet_wall:.1f}% of a core)"
    )

    # 4. every pod succeeds
    bench.finish_pods()
    wait(
        "every job Succeeded",
        lambda: all(
            (j.get("status") or {}).get("phase") == "Succeeded"
            for j in bench.jobs()
            if j["metadata"]["name"] != "big"
        ),
        900,
    )
    time.sleep(3.0)  # finalizer removals land

    # 5. requests per lifecycle
    by_verb = bench.operator_requests(since)
    per_job = sum(by_verb.values()) / args.jobs
    floor = 1 + args.pods + 3 + args.pods + 2 + 3
    out["API requests per job lifecycle (create -> Succeeded)"] = (
        f"{per_job:.1f} (floor {floor}, ratio {per_job / floor:.2f})"
    )
    for key, value in sorted(by_verb.items()):
        out[f"  {key}"] = f"{value / args.jobs:.2f} per job"
    out["operator: CPU s in all, peak RSS"] = (
        f"{cpu_seconds(operator) - cpu_start:.1f} s, {peak_rss_mib(operator.pid):.0f} MiB"
    )
    return out


def on_emulator(args: argparse.Namespace, workdir: Path) -> dict[str, str]:
    with EmulatorProcess(auto_kubelet=True, namespaces=["default", NS]) as em:
        kubeconfig = em.write_kubeconfig(workdir / "kubeconfig", namespace=NS)
        with operator_process(kubeconfig, workdir) as operator:
            return run(Emulated(em), operator, args)


def on_real(args: argparse.Namespace, workdir: Path) -> dict[str, str]:
    capacity = {"cpu": "64", "memory": "256Gi", "pods": "2000", "ephemeral-storage": "1Ti"}
    cluster = ControlPlane(
        workdir / "cluster",
        nodes=3,
        node_capacity=capacity,
        before_controllers=fixtures.install_crd,
    )
    with cluster:
        cluster_bench.prepare(cluster, NS)
        kubeconfig = fixtures.operator_kubeconfig(cluster, workdir / "operator.kubeconfig")
        backend = Real(cluster, end_after=args.pod_seconds)
        with operator_process(kubeconfig, workdir) as operator:
            return run(backend, operator, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--pods", type=int, default=None, help="default 8 (1,024 with --hollow)")
    parser.add_argument(
        "--hollow",
        action="store_true",
        help="one job of --pods pods on 16 hollow nodes, with the Job controller beside it "
        "(real backend only): bench/scale_job.py",
    )
    parser.add_argument(
        "--no-ask-agents", action="store_true", help="with --hollow: run without --ask-agents"
    )
    parser.add_argument("--json", help="with --hollow: also write the figures to this file")
    parser.add_argument(
        "--short",
        action="store_true",
        help="with --hollow: only the start, the steady state and the passes",
    )
    parser.add_argument(
        "--to-loss",
        action="store_true",
        help="with --hollow: the start, the steady state, the passes and the node loss only",
    )
    parser.add_argument(
        "--no-loss",
        action="store_true",
        help="with --hollow: no node loss (the start, the passes, the scale, the end)",
    )
    parser.add_argument(
        "--nodes",
        type=int,
        default=16,
        help="with --hollow: hollow nodes (16: 64 pods a node at --pods 1024; 4 at 256)",
    )
    parser.add_argument(
        "--profile", help="with --hollow: run the operator under cProfile, its stats to this file"
    )
    parser.add_argument(
        "--node-monitor-grace",
        default="50s",
        help="with --hollow: kube-controller-manager's --node-monitor-grace-period (its default)",
    )
    parser.add_argument(
        "--node-monitor-period",
        default="5s",
        help="with --hollow: kube-controller-manager's --node-monitor-period (its default)",
    )
    parser.add_argument("--quiet-seconds", type=float, default=20.0)
    parser.add_argument("--backend", choices=["emulator", "real", "both"], default="both")
    parser.add_argument(
        "--pod-seconds",
        type=float,
        default=300.0,
        help="on the real server, the no-op pods exit 0 this long after the start",
    )
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ddpjob-bench-"))
    if args.hollow:
        if args.backend != "real":
            parser.error("--hollow runs on the real control plane only: --backend real")
        from bench import scale_job  # noqa: PLC0415 - its own scenario

        args.pods = args.pods or 1024
        scale_job.main(args, workdir)
        return
    args.pods = args.pods or 8
    results: dict[str, dict[str, str]] = {}
    if args.backend in ("emulator", "both"):
        (workdir / "emulator").mkdir()
        results["emulator"] = on_emulator(args, workdir / "emulator")
    if args.backend in ("real", "both"):
        (workdir / "real").mkdir()
        results["real"] = on_real(args, workdir / "real")
    keys = list(dict.fromkeys(k for r in results.values() for k in r))
    width = max(len(k) for k in keys)
    print(f"{'measure':<{width}}  " + "  ".join(f"{b:<34}" for b in results))
    for key in keys:
        print(f"{key:<{width}}  " + "  ".join(f"{r.get(key, '-'):<34}" for r in results.values()))
    print(f"logs: {workdir}")


if __name__ == "__main__":
    main()
