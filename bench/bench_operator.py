"""Operator benchmark: N DDPJobs of M pods each against the API emulator, operator as a process.

    python bench/bench_operator.py --jobs 200 --pods 8

The emulator runs in its own process with its automatic kubelet (new pods are scheduled and
Running at once; graceful deletions are confirmed). The operator is the real ``ddpjob operator``
in a subprocess. The benchmark:

1. creates one 64-pod job and times job creation -> all 64 pods exist (target: within 2 s);
2. creates N jobs of M pods, and times each from creation to all its pods existing;
3. once every job is Running, measures the operator's CPU over a quiet window (target: ~0);
4. finishes every pod successfully and waits for every job to be Succeeded;
5. reports API requests per job lifecycle (create -> success) from the emulator's request log,
   the operator's CPU seconds and peak RSS.

Baseline, in the same run: the fewest requests a controller that does the same work could make
per job lifecycle (create the Service and M pods, write the status when the job is created,
when it runs and when it succeeds, and remove the tracking finalizer of M pods), plus what kopf
needs per job (add and remove its finalizer) and the benchmark's own writes are excluded. The
ratio measured/floor shows the overhead: extra status writes, retries, index-lag repeats.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.emulator
from tests.emulator import EmulatorProcess  # noqa: E402

NS = "bench"
DDPJOB = str(Path(sys.executable).parent / "ddpjob")


def manifest(name: str, pods: int) -> dict[str, Any]:
    return {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": pods,
            "minReplicas": 1,
            "maxReplicas": pods,
            "nprocPerNode": 1,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "ddpjob/worker-cpu",
                            "command": ["ddpjob-agent"],
                        }
                    ]
                }
            },
        },
    }


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


class Bench:
    def __init__(self, em: Any, operator: subprocess.Popen[bytes]) -> None:
        self.em = em
        self.url = em.url
        self.operator = psutil.Process(operator.pid)
        self.session = requests.Session()

    def create(self, name: str, pods: int) -> float:
        started = time.time()
        response = self.session.post(
            f"{self.url}/apis/ddpjob.io/v1alpha1/namespaces/{NS}/ddpjobs", json=manifest(name, pods)
        )
        response.raise_for_status()
        return started

    def jobs(self) -> list[dict[str, Any]]:
        return list(self.em.control.list_objects("ddpjob.io/v1alpha1/ddpjobs", NS))

    def pods(self) -> list[dict[str, Any]]:
        return list(self.em.control.list_objects("v1/pods", NS))

    def wait(self, what: str, check: Any, timeout: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if check():
                return time.monotonic() - started
            time.sleep(0.2)
        raise SystemExit(f"timed out after {timeout}s waiting for {what}")


def creation_delays(entries: Iterable[dict[str, Any]], created: dict[str, float]) -> list[float]:
    """Per job: job creation -> its last pod created (201), from the emulator's request log."""
    last: dict[str, float] = {}
    for entry in entries:
        if (entry.get("verb"), entry.get("resource"), entry.get("status")) == (
            "create",
            "pods",
            201,
        ):
            job = str(entry["name"]).rsplit("-worker-", 1)[0]
            last[job] = max(last.get(job, 0.0), float(entry["ts"]))
    return [last[job] - created[job] for job in created if job in last]


def count_requests(entries: Iterable[dict[str, Any]], since: int) -> dict[str, int]:
    """The operator's API requests (the benchmark's own are POST ddpjobs), by verb."""
    out: dict[str, int] = {}
    for entry in entries:
        if entry["seq"] <= since:
            continue
        if (entry.get("resource"), entry.get("verb")) == ("ddpjobs", "create"):
            continue  # the benchmark creating jobs
        if entry.get("verb") in ("watch", None):
            continue  # long-lived streams: counted separately
        key = f"{entry['verb']} {entry['resource']}" + (
            f"/{entry['subresource']}" if entry.get("subresource") else ""
        )
        out[key] = out.get(key, 0) + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--pods", type=int, default=8)
    parser.add_argument("--quiet-seconds", type=float, default=20.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ddpjob-bench-"))
    with EmulatorProcess(auto_kubelet=True, namespaces=["default", NS]) as em:
        kubeconfig = em.write_kubeconfig(workdir / "kubeconfig", namespace=NS)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        log = (workdir / "operator.log").open("wb")
        operator = subprocess.Popen(
            [DDPJOB, "operator", "--namespace", NS, "--metrics-port", "0", "--health-port", "0"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            run(Bench(em, operator), args)
        finally:
            operator.send_signal(signal.SIGTERM)
            operator.wait(timeout=60)
            log.close()


def run(bench: Bench, args: argparse.Namespace) -> None:
    em = bench.em
    time.sleep(3.0)  # the operator starts (kopf, indexes)
    cpu_start = cpu_seconds(bench.operator)

    # 1. one 64-pod job
    big = bench.create("big", 64)
    bench.wait("64 pods", lambda: len(bench.pods()) >= 64, 120)
    big_delay = creation_delays(em.control.requests(), {"big": big})[0]
    print(f"64-pod job: creation -> all 64 pods created: {big_delay:.2f}s (target < 2 s)")

    # 2. N jobs of M pods
    since = int(em.control.requests()[-1]["seq"]) if em.control.requests() else 0
    created: dict[str, float] = {}
    started = time.monotonic()
    for i in range(args.jobs):
        name = f"job-{i:03d}"
        created[name] = bench.create(name, args.pods)
    total = args.jobs * args.pods + 64
    spent = bench.wait(f"{total} pods", lambda: len(bench.pods()) >= total, 600)
    delays = creation_delays(em.control.requests(), created)
    print(
        f"{args.jobs} jobs x {args.pods} pods: created in {time.monotonic() - started:.1f}s; "
        f"every pod exists {spent:.1f}s after the first job; per job, creation -> all pods: "
        f"median {statistics.median(delays):.2f}s, max {max(delays):.2f}s"
    )
    bench.wait(
        "every job Running",
        lambda: all((j.get("status") or {}).get("phase") == "Running" for j in bench.jobs()),
        600,
    )

    # 3. steady state
    time.sleep(2.0)
    quiet_start, wall = cpu_seconds(bench.operator), time.monotonic()
    requests_before = len(em.control.requests())
    time.sleep(args.quiet_seconds)
    quiet_cpu = cpu_seconds(bench.operator) - quiet_start
    quiet_wall = time.monotonic() - wall
    quiet_requests = len(em.control.requests()) - requests_before
    print(
        f"steady state, {args.jobs + 1} running jobs: {quiet_cpu:.2f} CPU s over {quiet_wall:.0f}s "
        f"({100 * quiet_cpu / quiet_wall:.1f}% of a core), {quiet_requests} API requests"
    )

    # 4. every pod succeeds
    for pod in bench.pods():
        meta = pod["metadata"]
        if meta["labels"]["ddpjob.io/job-name"] == "big":
            continue
        em.control.set_pod_phase(NS, meta["name"], "Succeeded", exit_code=0)
    bench.wait(
        "every job Succeeded",
        lambda: all(
            (j.get("status") or {}).get("phase") == "Succeeded"
            for j in bench.jobs()
            if j["metadata"]["name"] != "big"
        ),
        600,
    )
    time.sleep(3.0)  # finalizer removals land

    # 5. requests per lifecycle
    by_verb = count_requests(em.control.requests(), since)
    per_job = sum(by_verb.values()) / args.jobs
    # Service, M pods, 3 status writes (created, running, succeeded), M finalizer releases,
    # kopf's finalizer on the job (add, remove), 3 events (created, running, succeeded).
    floor = 1 + args.pods + 3 + args.pods + 2 + 3
    print(f"API requests per job lifecycle (create -> Succeeded): {per_job:.1f}")
    for key, value in sorted(by_verb.items()):
        print(f"  {key}: {value / args.jobs:.2f} per job")
    print(f"floor for the same work: {floor} per job; ratio measured/floor: {per_job / floor:.2f}")
    print(
        f"operator: {cpu_seconds(bench.operator) - cpu_start:.1f} CPU s in all, "
        f"peak RSS {peak_rss_mib(bench.operator.pid):.0f} MiB"
    )


if __name__ == "__main__":
    main()
