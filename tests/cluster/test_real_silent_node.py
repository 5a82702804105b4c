"""Real training on the real control plane when pod 0's node is lost *silently*, then heals.

``ControlPlane.freeze_node`` stops every process of the node (its kubelet and its pods) and
drops every packet to and from its addresses: pod 0, which hosts the job's c10d store, neither
answers nor resets. The real node lifecycle controller marks the node NotReady (6 s), the
taint eviction controller evicts pod 0 (the operator's 2 s toleration), and the operator
force-deletes it once its grace period is over (no kubelet confirms) and creates it again: a
replacement about 15 s after the freeze, which cannot run on the job's other nodes (one pod per
node). The survivors must not wait for it: their agents find pod 0 silent within about 2 s and
carry on around a new store that the lowest-ranked of them hosts, at world 2, a majority of the
last round.

* :func:`test_the_survivors_train_on_long_before_the_store_host_is_replaced`: the survivors
  step at world 2 while the API still has the old pod 0 (no replacement created yet). The node
  stays frozen and the survivors' nodes are cordoned, so the replacement never runs; the job
  succeeds on the survivors, 30 s later (the operator's wait for a pod stranded by a finished
  round).
* :func:`test_the_healed_store_host_trains_no_further_step`: the node comes back after the
  survivors moved on. The old pod 0's processes run again, but the API no longer has it: its
  node's returning kubelet kills them, and they log no step and no checkpoint after the heal.
  The replacement pod 0 then runs on the healed node and joins the survivors' store.

Both check the job's status (one NodeLost, not charged; one restart) and that every step was
done once: rank 0's runs replayed over the logs of every pod of the job (``lineage_problems``
of the e2e suite). The frozen pod's log is read from its file as the node froze (every line in
it was logged before the freeze, whenever its stream delivers it) and after the heal.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import socket
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from tests.harness import tools
from tests.harness.agents import is_idle_spare
from tests.harness.kube.fixtures import KubeTest
from tests.harness.kubectl import Kube
from tests.harness.operator_env import RealEnv, real_env, wait_for
from tests.harness.podlogs import (
    CKPT_RE,
    RESUME_RE,
    STEP_RE,
    PodLog,
    PodLogs,
    lineage_problems,
    rank0_runs,
)

from .test_real_cluster import one_pod_per_node

pytestmark = pytest.mark.slow
JSON = dict[str, Any]
JOB = "silent"
CKPT_EVERY = 10
START_TIMEOUT = 240.0
RECOVERY_TIMEOUT = 120.0
FINISH_TIMEOUT = 300.0


def pod_name(index: int) -> str:
    return f"{JOB}-worker-{index}"


def free_port_pair() -> int:
    """A port ``p`` with ``p + 1`` free too: the job's store and its agents' directory port.
    Pods share this machine's port space, with every other job on it (docs/testing.md)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("0.0.0.0", 0))
            port = int(first.getsockname()[1])
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("0.0.0.0", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def start_job(kube: KubeTest, tmp_path: Path, steps: int) -> RealEnv:
    """The operator, and a 3-pod job (minReplicas 2, one pod per node) training for real with a
    checkpoint every ``CKPT_EVERY`` steps on a directory every pod shares; the shortened
    node-loss timings of ``test_training_goes_on_when_the_store_hosts_node_is_lost``."""
    env = real_env(kube, tmp_path, fake_trainer=False)
    env.in_cluster_network()  # where it reaches the agents (status.storeHost, worldSize)
    env.start_operator("--ask-agents")
    template = {
        "spec": {
            "terminationGracePeriodSeconds": 5,
            "affinity": one_pod_per_node(JOB),
            "containers": [
                {
                    "name": "trainer",
                    "image": "ghcr.io/ddpjob/ddpjob-worker-cpu:0.1.0",
                    "command": ["ddpjob-agent"],
                    "args": [
                        "/opt/ddpjob/examples/train.py",
                        f"--steps={steps}",
                        "--step-sleep=0.2",
                        f"--ckpt-every={CKPT_EVERY}",
                        "--ckpt-dir=/ckpt",
                    ],
                    "volumeMounts": [{"name": "ckpt", "mountPath": "/ckpt"}],
                }
            ],
            "volumes": [
                {
                    "name": "ckpt",
                    "hostPath": {"path": str(tmp_path / "ckpt"), "type": "DirectoryOrCreate"},
                }
            ],
        }
    }
    env.create_job(
        JOB, replicas=3, minReplicas=2, maxReplicas=3, nodeLostTolerationSeconds=2,
        forceDeleteAfterSeconds=3, rendezvous={"port": free_port_pair()}, template=template,
    )  # fmt: skip
    return env


@pytest.fixture
def pod_logs(kube: KubeTest) -> Iterator[list[PodLogs]]:
    """Where a test keeps its :class:`PodLogs`; every stream is closed after the test."""
    started: list[PodLogs] = []
    yield started
    for collector in started:
        collector.close()


def stream_logs(kube: KubeTest, env: RealEnv, started: list[PodLogs]) -> PodLogs:
    job = env.job(JOB)
    assert job is not None
    e2e_kube = Kube(
        kube.cluster.kubeconfig,
        str(tools.tool("kubectl")),
        str(tools.tool("helm")),
        namespace=kube.namespace,
    )
    started.append(PodLogs(e2e_kube, JOB, job["metadata"]["uid"]).start())
    return started[-1]


def lines(logs: PodLogs, uid: str) -> list[str]:
    log = logs.logs.get(uid)
    return [line for _, line in list(log.lines)] if log is not None else []


def worlds(logs: PodLogs, uid: str) -> list[int]:
    """The world sizes of the pod's step lines, in order."""
    return [int(m.group(3)) for line in lines(logs, uid) if (m := STEP_RE.search(line))]


def uids(env: RealEnv) -> dict[int, str]:
    return {
        int(p["metadata"]["name"].rsplit("-", 1)[1]): p["metadata"]["uid"] for p in env.pods(JOB)
    }


def describe(env: RealEnv, logs: PodLogs) -> str:
    status = {k: v for k, v in env.status(JOB).items() if k != "accountedPods"}
    pods = [
        f"{p['metadata']['name']} uid={p['metadata']['uid'][:8]} node={p['spec'].get('nodeName')} "
        f"phase={p.get('status', {}).get('phase')} "
        f"deleting={bool(p['metadata'].get('deletionTimestamp'))}"
        for p in env.pods(JOB)
    ]
    tails = []
    for log in list(logs.logs.values()):
        shown = [line for _, line in list(log.lines) if "DDPJOB" in line][-3:]
        tails.append(f"{log.name} ({log.uid[:8]}): {shown}")
    return f"status: {status}\npods: {pods}\nlogs:\n  " + "\n  ".join(tails)


def training_at_world_3(env: RealEnv, logs: PodLogs) -> dict[int, str]:
    """Every pod logs steps at world 3, and a checkpoint was written since their last resume
    (so the survivors resume from a checkpoint, not from step 0)."""

    def ready() -> dict[int, str] | None:
        now = uids(env)
        if len(now) != 3 or any(3 not in worlds(logs, uid)[-1:] for uid in now.values()):
            return None
        return now

    started = wait_for(ready, "the 3 pods stepping at world 3", timeout=START_TIMEOUT, every=0.5)
    logs.wait_new_checkpoint(lambda: describe(env, logs))
    says(env, {pod_name(0)}, world=3)
    return started


def says(env: RealEnv, hosts: set[str], world: int) -> JSON:
    """The status names one of ``hosts`` as the store's host, and the world that trains, as
    the operator learns them from the agents (``--ask-agents``)."""

    def told() -> JSON | None:
        status = env.status(JOB)
        return (
            status
            if status.get("storeHost") in hosts and status.get("worldSize") == world
            else None
        )

    status: JSON = wait_for(
        told, f"status naming {sorted(hosts)} at world {world}", timeout=30, every=0.5
    )
    return status


def survivors_at_world_2(
    env: RealEnv, logs: PodLogs, before: dict[int, str], old: JSON, *, first: bool = True
) -> float:
    """Wait until pods 1 and 2 have both stepped at world 2; with ``first``, the API must still
    hold the old pod 0 then: the survivors moved on before Kubernetes even created its
    replacement. Returns when they were seen (``time.time()``, the API server's clock)."""

    def moved_on() -> bool:
        return all(2 in worlds(logs, before[i]) for i in (1, 2))

    wait_for(moved_on, "pods 1 and 2 stepping at world 2", timeout=RECOVERY_TIMEOUT, every=0.1)
    seen_at = time.time()
    pod0 = env.pod(pod_name(0))
    if first:
        assert pod0 is not None and pod0["metadata"]["uid"] == old["metadata"]["uid"], (
            "pod 0 was replaced before the survivors stepped at world 2:\n" + describe(env, logs)
        )
    return seen_at


def created_at(pod: JSON) -> float:
    stamp = dt.datetime.strptime(pod["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    return stamp.replace(tzinfo=dt.UTC).timestamp()


def replaced_after(env: RealEnv, old: JSON, seen_at: float) -> JSON:
    """The replacement pod 0, created after the survivors were seen at world 2 (its
    creationTimestamp has whole seconds)."""
    new = env.replacement(old, "pod 0 created again", timeout=RECOVERY_TIMEOUT)
    assert created_at(new) >= int(seen_at), (new["metadata"]["creationTimestamp"], seen_at)
    print(f"pod 0 replaced {created_at(new) - seen_at:+.0f}s after the survivors were at world 2")
    return new


def dump(logs: PodLogs, tail: int = 40) -> str:
    """The last lines of every pod's log (its agent's and its workers'), for a failure."""
    parts = []
    for log in list(logs.logs.values()):
        shown = "\n    ".join(line for _, line in list(log.lines)[-tail:])
        parts.append(f"---- {log.name} ({log.uid}), {len(log.lines)} lines:\n    {shown}")
    return "\n".join(parts)


def finished(env: RealEnv, logs: PodLogs) -> JSON:
    status: JSON = wait_for(
        lambda: env.status(JOB).get("phase") in ("Succeeded", "Failed") and env.status(JOB),
        "the job to finish",
        timeout=FINISH_TIMEOUT,
        every=1.0,
    )
    assert status["phase"] == "Succeeded", describe(env, logs) + "\n" + dump(logs)
    assert [(f["pod"], f["reason"], f["charged"]) for f in status["failures"]] == [
        (pod_name(0), "NodeLost", False)
    ], f"{status['failures']}\n{describe(env, logs)}\n{dump(logs)}"
    assert (status["restarts"], status.get("backoffCount", 0)) == (1, 0), status
    return status


def frozen_log(
    logs: PodLogs,
    old: JSON,
    written: list[str],
    frozen_at: float,
    later: Sequence[str] = (),
    healed_at: float = 0.0,
) -> None:
    """The frozen pod 0's log, for the replay: the lines in its file when its node froze were
    logged before the freeze (its stream delivers them late, if ever), ``later`` ones once it
    was healed."""
    uid = old["metadata"]["uid"]
    streamed = logs.logs[uid].lines if uid in logs.logs else []
    assert [line for _, line in streamed[: len(written)]] == written[: len(streamed)], (
        "the frozen pod's stream is not the start of its log file"
    )
    timed = [(min(at, frozen_at), line) for at, line in streamed[: len(written)]]
    timed += [(frozen_at, line) for line in written[len(timed) :]]
    timed += [(healed_at, line) for line in later]
    logs.logs[uid] = PodLog(old["metadata"]["name"], uid, timed)


def every_step_once(logs: PodLogs, steps: int, min_runs: int, ran: set[str]) -> None:
    """Every step done once, over the logs of exactly the pods that ran (``ran``, their uids),
    each collected without an error (a stream restarted reads its log again from the start,
    skipping what it has: nothing lost)."""
    assert logs.errors == [], logs.describe()
    assert set(logs.logs) == ran, f"pods streamed and pods that ran differ:\n{logs.describe()}"
    failed = [e for log in logs.logs.values() for e in log.errors if "stream restarted" not in e]
    assert failed == [], logs.describe()
    runs = [run for log in logs.logs.values() for run in rank0_runs(log)]
    summary = "\n".join(str(run) for run in sorted(runs, key=lambda run: run.began))
    assert len(runs) >= min_runs, f"{len(runs)} runs of rank 0, expected {min_runs}+:\n{summary}"
    problems = lineage_problems(runs, steps, CKPT_EVERY)
    assert not problems, (
        "not every step done once:\n  " + "\n  ".join(problems)
        + f"\nruns of rank 0, in order:\n{summary}\n{logs.describe()}"
    )  # fmt: skip
    print(f"every step done once over {len(runs)} runs of rank 0:\n{summary}")


def checkpoint_step(tmp_path: Path) -> int:
    state = torch.load(tmp_path / "ckpt" / "latest.pt", map_location="cpu", weights_only=True)
    return int(state["step"])


def snapshot(path: Path) -> tuple[list[str], int]:
    """A log's lines and its size in bytes."""
    data = path.read_bytes()
    return data.decode(errors="replace").splitlines(), len(data)


def test_the_survivors_train_on_long_before_the_store_host_is_replaced(
    kube: KubeTest, tmp_path: Path, pod_logs: list[PodLogs]
) -> None:
    steps = 150
    env = start_job(kube, tmp_path, steps)
    logs = stream_logs(kube, env, pod_logs)
    before = training_at_world_3(env, logs)
    old = env.pod(pod_name(0))
    assert old is not None
    node = old["spec"]["nodeName"]
    frozen_at = time.monotonic()
    kube.freeze_node(node)
    written, _ = snapshot(kube.cluster.container_log(node, before[0], "trainer"))
    # Nowhere for the replacement to run, even once a survivor has finished and left its node:
    # this test is about the survivors alone (the next one heals the node and lets it run).
    for survivor in (1, 2):
        kube.cordon(kube.cluster.node_of(kube.namespace, pod_name(survivor)))
    seen_at = survivors_at_world_2(env, logs, before, old)
    moved_on = time.monotonic() - frozen_at
    # The API still says pod 0 runs (its node has not been given up on yet, or just); the
    # status says what the agents do: a survivor hosts the store, and the world is 2.
    status = says(env, {pod_name(1), pod_name(2)}, world=2)
    assert status["readyReplicas"] <= 2, status
    replaced_after(env, old, seen_at)
    print(f"pod 0's node frozen: both survivors at world 2 after {moved_on:.1f}s")
    status = finished(env, logs)
    # The replacement never ran: stranded 30 s after the survivors succeeded, then removed.
    assert status.get("succeeded") == 2, status
    logs.finish()
    frozen_log(logs, old, written, frozen_at)
    every_step_once(logs, steps, min_runs=2, ran=set(before.values()))
    assert checkpoint_step(tmp_path) == steps


def survivors(processes: list[psutil.Process]) -> list[str]:
    described = []
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            described.append(
                f"{process.pid} ppid {process.ppid()} {process.status()} "
                f"idle spare {is_idle_spare(process.pid)}: {' '.join(process.cmdline())[:200]}"
            )
    return described


def of_pod(pids: Sequence[int], uid: str) -> tuple[list[psutil.Process], list[str]]:
    """Which of a node's processes belong to pod ``uid`` (the process kubelet puts each of its
    containers in a memory cgroup named after the pod's uid), and a description of the others.

    A node's PID namespace holds more than one pod's processes: what the kubelet itself runs
    (a mount, an exec probe), and, in a full run, what earlier tests left on that node."""
    ours, others = [], []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess, OSError):
            process = psutil.Process(pid)
            cgroups = Path(f"/proc/{pid}/cgroup").read_text()
            if uid in cgroups:
                ours.append(process)
            else:
                memory = [line for line in cgroups.splitlines() if ":memory:" in line]
                others.append(f"{survivors([process])} in {memory}")
    return ours, others


def test_the_healed_store_host_trains_no_further_step(
    kube: KubeTest, tmp_path: Path, pod_logs: list[PodLogs]
) -> None:
    steps = 300
    env = start_job(kube, tmp_path, steps)
    logs = stream_logs(kube, env, pod_logs)
    before = training_at_world_3(env, logs)
    old = env.pod(pod_name(0))
    assert old is not None
    node = old["spec"]["nodeName"]
    frozen_at = time.monotonic()
    stopped = kube.freeze_node(node)
    log_path = kube.cluster.container_log(node, before[0], "trainer")
    written, size = snapshot(log_path)
    # Which came first, the survivors at world 2 or pod 0's replacement (about 15 s after the
    # freeze), is the other test's subject; here the heal is, and a loaded control plane
    # (a whole suite's namespaces still being deleted) has let the replacement come first.
    survivors_at_world_2(env, logs, before, old, first=False)
    replacement = env.replacement(old, "pod 0 created again", timeout=RECOVERY_TIMEOUT)

    # The node comes back: pod 0's processes run again, force-deleted from the API meanwhile.
    with log_path.open("rb") as log:  # kept open: the kubelet removes the file
        log.seek(size)
        processes, others = of_pod(stopped[1:], before[0])
        assert processes, f"none of {stopped} is in pod 0's cgroup; others: {others}"
        healed_at = time.monotonic()
        kube.heal_node(node, wait=False)

        def alive() -> list[psutil.Process]:
            left = []
            for process in processes:
                with contextlib.suppress(psutil.NoSuchProcess):
                    if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                        left.append(process)
            return left

        try:
            wait_for(
                lambda: not alive(), "the old pod 0's processes killed by its node's kubelet", 45
            )
        except AssertionError as exc:  # say which ones, for the next one to look at
            raise AssertionError(
                f"{exc}: still running: {survivors(alive())}; the node's others: {others}"
            ) from None
        killed = time.monotonic() - healed_at
        later = log.read().decode(errors="replace").splitlines()
    print(f"node healed: the old pod 0's {len(processes)} processes killed after {killed:.2f}s; "
          f"it logged {later}; the node's other processes: {others}")  # fmt: skip
    trained = [line for line in later if STEP_RE.search(line) or CKPT_RE.search(line)]
    assert trained == [], f"the fenced pod 0 trained on after the heal: {later}"
    assert not [line for line in later if RESUME_RE.search(line)], later
    said = kube.cluster.components[node].log_path.read_text()
    killing = f"killing {kube.namespace}/{pod_name(0)} ({before[0]}): the API no longer has it"
    assert killing in said, said[-3000:]

    # The replacement runs on the healed node and joins the survivors' store.
    def joined() -> bool:
        pod = env.pod(pod_name(0))
        uid = replacement["metadata"]["uid"]
        return bool(pod and pod["metadata"]["uid"] == uid) and 3 in worlds(logs, uid)

    try:
        wait_for(joined, "the new pod 0 stepping at world 3", timeout=RECOVERY_TIMEOUT, every=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{describe(env, logs)}\n{dump(logs)}") from None
    status = finished(env, logs)
    assert status.get("succeeded") == 3, status
    logs.finish()
    frozen_log(logs, old, written, frozen_at, later, healed_at)
    ran = {*before.values(), replacement["metadata"]["uid"]}
    every_step_once(logs, steps, min_runs=3, ran=ran)
    assert checkpoint_step(tmp_path) == steps
