"""Benchmark: recovery of real training from a deleted pod, on the real control plane.

What a user sees after ``kubectl delete pod`` (or a drain, or a preemption): the pod is
deleted gracefully (SIGTERM, its agent leaves the rendezvous), the operator creates the
replacement under the same name, the scheduler binds it, a process kubelet starts it, and the
job trains again. Deleting pod 0 is the hard case: it hosts the c10d store, and its DNS name
still resolves to the dying pod through its grace period (a ``publishNotReadyAddresses``
Service keeps a terminating pod in its EndpointSlice; issue 14 point 21). Deleting pod 1 is
the baseline, in the same run, on the same cluster and job.

The run: the real control plane of the tests (``tests.harness.kube``: kube-apiserver 1.37.2, the
real scheduler and controllers, 3 process kubelets), the chart installed with helm (the operator is
the chart's Deployment on a process kubelet), and ``examples/kind-cpu.yaml`` with more steps (2 pods
x 1 worker of ``examples/train.py``, gloo, a step every 0.1 s, a checkpoint every 50 steps). Each
run waits for both pods to train at world 2 for 5 s, deletes pod 0 or pod 1 (in turn, alternating
which goes first), and measures from the delete request:

* ``first step``: the first step of a new round logged by any pod;
* ``full world``: both pods (the replacement included) have logged a step of a new round at
  world 2.

Polls each pod's log tail every 0.1 s through the API server. Prints a markdown table with the
ratio of medians (pod 0 / pod 1).

**Pod 0's node frozen (silent)**: a machine lost without a reset. Each run is a job of its own,
3 pods of the same trainer, one per node (minReplicas 2), that has trained at world 3 for 5 s;
``ControlPlane.freeze_node`` then stops every process of pod 0's node and drops every packet to
and from its addresses, so pod 0, the store host, neither answers nor resets. Measured from the
freeze: the first step at world 2 of a survivor, and both survivors stepping at world 2 (they
carry on around a store of their own without waiting for Kubernetes, which would replace pod 0
only some 15 s later). A step at world 2 needs both survivors, so the two agree to a poll. The
node is healed after each run, and the job deleted.

Usage: ``python bench/bench_real_recovery.py [--runs 3] [--scenario deleted|frozen|all]``
(root; builds the control plane when missing; the frozen scenario needs ``nft``, Debian's
``nftables``).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: tests.*
from tests.harness import tools
from tests.harness.agents import RESUME_RE, STEP_RE
from tests.harness.install import REAL_WORKER_IMAGE, install_on_real
from tests.harness.kube import fixtures
from tests.harness.kube.client import ApiError, Client
from tests.harness.kube.controlplane import ControlPlane
from tests.harness.kubectl import Kube

ROOT = Path(__file__).resolve().parents[1]
JOB = "kind-cpu"
POLL = 0.1
TIMEOUT = 300.0


def job_document() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "kind-cpu.yaml").read_text())
    spec = document["spec"]["template"]["spec"]
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        container["image"] = REAL_WORKER_IMAGE
    args = spec["containers"][0]["args"]
    args[1:4] = ["--steps=1000000", "--step-sleep=0.1", "--ckpt-every=50"]
    return document


def job_manifest() -> str:
    return str(yaml.safe_dump(job_document(), sort_keys=False))


def free_port_pair() -> int:
    """A port whose next one is free too: the job's store and its agents' directory port (pods
    share this machine's port space)."""
    for _ in range(100):
        with socket.socket() as first, socket.socket() as second:
            first.bind(("0.0.0.0", 0))
            port = int(first.getsockname()[1])
            try:
                second.bind(("0.0.0.0", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two consecutive free ports")


def frozen_manifest(name: str) -> str:
    """The trainer as 3 pods, one per node, minReplicas 2 (a majority of 3 carries on)."""
    document = job_document()
    document["metadata"]["name"] = name
    spec = document["spec"]
    spec.update(replicas=3, minReplicas=2, maxReplicas=3, rendezvous={"port": free_port_pair()})
    spec["template"]["spec"]["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"ddpjob.io/job-name": name}},
                    "topologyKey": "kubernetes.io/hostname",
                }
            ]
        }
    }
    return str(yaml.safe_dump(document, sort_keys=False))


@dataclass(frozen=True)
class Seen:
    """What a pod's log tail says: its uid, its last round (the agent's restart count, or -1),
    the world sizes of the steps that round has logged."""

    uid: str
    round: int
    worlds: frozenset[int]

    def after(self, before: Seen) -> frozenset[int]:
        """The worlds of this pod's steps in a round newer than ``before``'s."""
        newer = self.uid != before.uid or self.round > before.round
        return self.worlds if newer else frozenset()


class Watcher:
    """Reads pods and their logs straight from the API server (a ``kubectl`` per poll would
    cost more than the poll interval)."""

    def __init__(self, client: Client, namespace: str, job: str = JOB) -> None:
        self.client = client
        self.base = f"/api/v1/namespaces/{namespace}/pods"
        self.job = job

    def node(self, index: int) -> str:
        return str(self.client.get(f"{self.base}/{self.job}-worker-{index}")["spec"]["nodeName"])

    def pod(self, index: int) -> Seen | None:
        name = f"{self.job}-worker-{index}"
        try:
            pod = self.client.get(f"{self.base}/{name}")
        except ApiError:
            return None
        if pod["metadata"].get("deletionTimestamp"):
            return None
        response = self.client.session.get(
            f"{self.client.endpoint.server}{self.base}/{name}/log",
            params={"container": "trainer", "tailLines": "200"},
            timeout=10,
        )
        lines = response.text.splitlines() if response.ok else []
        resumes = [(i, m) for i, line in enumerate(lines) if (m := RESUME_RE.match(line))]
        if not resumes:
            return Seen(pod["metadata"]["uid"], -1, frozenset())
        last, match = resumes[-1]
        worlds = {int(m.group(3)) for line in lines[last + 1 :] if (m := STEP_RE.match(line))}
        return Seen(pod["metadata"]["uid"], int(match.group(4)), frozenset(worlds))

    def steady(self) -> tuple[Seen, Seen]:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            zero, one = self.pod(0), self.pod(1)
            if zero and one and 2 in zero.worlds and 2 in one.worlds:
                return zero, one
            time.sleep(0.5)
        raise TimeoutError("the job did not train at world 2 on both pods")


def recover(watcher: Watcher, index: int) -> tuple[float, float]:
    """Delete pod ``index``; seconds to the first step of a new round on any pod, and to both
    pods stepping at world 2 in new rounds."""
    watcher.steady()
    time.sleep(5.0)  # a fault comes later than a round's first seconds
    before = watcher.steady()
    start = time.monotonic()
    watcher.client.delete(f"{watcher.base}/{watcher.job}-worker-{index}")
    first: float | None = None
    while (elapsed := time.monotonic() - start) < TIMEOUT:
        now = [watcher.pod(i) for i in (0, 1)]
        worlds = [s.after(b) if s else frozenset() for s, b in zip(now, before, strict=True)]
        if first is None and any(worlds):
            first = elapsed
        if all(2 in w for w in worlds):
            return first if first is not None else elapsed, elapsed
        time.sleep(POLL)
    raise TimeoutError(f"no recovery from deleting pod {index} within {TIMEOUT:.0f} s")


def at_world(watcher: Watcher, indices: tuple[int, ...], world: int) -> bool:
    """Each pod's last round has logged a step at ``world``."""
    seen = [watcher.pod(i) for i in indices]
    return all(s is not None and world in s.worlds for s in seen)


def frozen_store_host(
    cluster: ControlPlane, kube: Kube, watcher: Watcher, run: int
) -> tuple[float, float]:
    """A fresh 3-pod job; once it has trained at world 3 for 5 s, freeze pod 0's node. Seconds
    from the freeze to the first step at world 2 of a survivor, and to both of them."""
    name = f"frozen-{run}"
    kube.kubectl("apply", "-f", "-", stdin=frozen_manifest(name))
    watcher = Watcher(watcher.client, kube.namespace, job=name)
    deadline = time.monotonic() + TIMEOUT
    while not at_world(watcher, (0, 1, 2), 3):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} did not train at world 3 on its 3 pods")
        time.sleep(0.5)
    time.sleep(5.0)  # a fault comes later than a round's first seconds
    node = watcher.node(0)
    start = time.monotonic()
    cluster.freeze_node(node)
    try:
        first: float | None = None
        survivors: dict[int, float] = {}
        while (elapsed := time.monotonic() - start) < TIMEOUT:
            for index in (1, 2):
                if index not in survivors and at_world(watcher, (index,), 2):
                    survivors[index] = elapsed
                    first = elapsed if first is None else first
            if len(survivors) == 2 and first is not None:
                return first, max(survivors.values())
            time.sleep(POLL)
        raise TimeoutError(f"the survivors of {node}'s freeze did not train at world 2")
    finally:
        cluster.heal_node(node)
        kube.kubectl("delete", "ddpjob", name, "--timeout=300s", timeout=330)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--scenario", choices=("deleted", "frozen", "all"), default="all")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="ddpjob-bench-real-"))
    cluster = ControlPlane(workdir / "cluster", nodes=3, before_controllers=fixtures.install_crd)
    results: dict[int, list[tuple[float, float]]] = {0: [], 1: []}
    frozen: list[tuple[float, float]] = []
    with cluster:
        kube = Kube(cluster.kubeconfig, str(tools.tool("kubectl")), str(tools.tool("helm")))
        installed = install_on_real(kube)
        watcher = Watcher(cluster.admin(), installed.kube.namespace)
        if args.scenario in ("deleted", "all"):
            installed.kube.kubectl("apply", "-f", "-", stdin=job_manifest())
            for run in range(args.runs):
                for index in (0, 1) if run % 2 == 0 else (1, 0):
                    first, full = recover(watcher, index)
                    results[index].append((first, full))
                    print(f"run {run + 1}: pod {index} deleted: first step {first:.2f} s, "
                          f"full world {full:.2f} s", flush=True)  # fmt: skip
            installed.kube.kubectl("delete", "ddpjob", JOB, "--timeout=300s", timeout=330)
        if args.scenario in ("frozen", "all"):
            for run in range(args.runs):
                first, full = frozen_store_host(cluster, installed.kube, watcher, run)
                frozen.append((first, full))
                print(f"run {run + 1}: pod 0's node frozen: first step at world 2 {first:.2f} s, "
                      f"both survivors {full:.2f} s", flush=True)  # fmt: skip
    print()
    if results[0]:
        deleted_table(args.runs, results)
    if frozen:
        frozen_table(args.runs, frozen)
    return 0


def cell(values: list[float]) -> str:
    ordered = sorted(values)
    return f"{ordered[0]:.2f} / {statistics.median(ordered):.2f} / {ordered[-1]:.2f}"


def frozen_table(runs: int, frozen: list[tuple[float, float]]) -> None:
    print(f"| Frozen (n={runs}, min / median / max, s) | first step at world 2 | both survivors |")
    print("|---|---|---|")
    firsts, fulls = [r[0] for r in frozen], [r[1] for r in frozen]
    print(f"| pod 0's node (the store host), silent | {cell(firsts)} | {cell(fulls)} |")


def deleted_table(runs: int, results: dict[int, list[tuple[float, float]]]) -> None:
    print(f"| Deleted (n={runs}, min / median / max, s) | first step | full world (2 pods) |")
    print("|---|---|---|")
    medians = {}
    for index, label in ((1, "pod 1 (a worker; baseline)"), (0, "pod 0 (the store host)")):
        cells = []
        for k in (0, 1):
            values = [r[k] for r in results[index]]
            cells.append(cell(values))
            medians[index, k] = statistics.median(values)
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    print(
        f"| pod 0 / pod 1 (medians) | {medians[0, 0] / medians[1, 0]:.2f} | "
        f"{medians[0, 1] / medians[1, 1]:.2f} |"
    )
    print()


if __name__ == "__main__":
    sys.exit(main())
