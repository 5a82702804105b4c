"""``ddpjob-agent`` with real torch processes: gloo on CPU, every node on 127.0.0.1.

Each test starts agents as separate "nodes" (see ``conftest.py``), drives a failure, waits on the
training script's own log lines and on exit codes with bounded polling, and checks that nothing
outlived it.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from ddpjob_worker.contract import EXIT_INFRA, EXIT_STOPPED_BY_SIGNAL, is_retryable_exit
from ddpjob_worker.errors import EXIT_ENDPOINT_UNREACHABLE
from ddpjob_worker.state import Phase
from tests.harness.agents import CKPT_RE, Cluster, Node, wait_until

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., Cluster]


def train_args(steps: int, *, sleep: float = 0.1, every: int = 5) -> list[str]:
    return ["--steps", str(steps), "--ckpt-every", str(every), "--step-sleep", str(sleep)]


def reached(node: Node, step: int, world: int | None = None) -> Callable[[], bool]:
    def check() -> bool:
        return any(s >= step and (world is None or w == world) for s, _, w in node.steps())

    return check


def finish_ok(cluster: Cluster, nodes: list[Node], timeout: float) -> None:
    for node in nodes:
        code = node.wait_exit(timeout)
        assert code == 0, f"node {node.index} exited {code}\n{cluster.logs()}"
        assert "Fatal Python error" not in node.text(), cluster.logs()
    cluster.assert_clean()


def test_worker_sigkill_restarts_within_budget_from_last_checkpoint(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=2)
    nodes = [cluster.start(i, train_args(40)) for i in range(2)]
    wait_until("step 12 on node 1", reached(nodes[1], 12), 60)
    workers = nodes[1].worker_pids()
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    finish_ok(cluster, nodes, 90)

    resumes = nodes[1].resumes()
    assert len(resumes) == 2, cluster.logs()
    assert resumes[1][3] == 1, "TORCHELASTIC_RESTART_COUNT after one charged restart"
    # The node that held rank 0 before the kill wrote the checkpoints: the new round resumes
    # from the last one it printed before its second resume line.
    rank0 = next(n for n in nodes if n.resumes()[0][1] == 0)
    lines = rank0.lines()
    second_resume = [i for i, line in enumerate(lines) if line.startswith("DDPJOB resume")][1]
    saved = [int(m[1]) for line in lines[:second_resume] if (m := CKPT_RE.match(line))]
    assert saved, cluster.logs()
    assert resumes[1][0] == max(saved), (resumes, saved)
    state = nodes[1].state()
    assert state.phase is Phase.SUCCEEDED
    assert state.restart_count == 1
    assert state.last_failure is not None
    assert state.last_failure.exit_code == -signal.SIGKILL


def test_losing_a_non_master_node_shrinks_the_world_without_charging(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=3)
    nodes = [cluster.start(i, train_args(60)) for i in range(3)]
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", reached(node, 8, world=3), 90)
    nodes[2].kill_node()
    survivors = nodes[:2]
    for node in survivors:
        wait_until(f"world 2 on node {node.index}", reached(node, 20, world=2), 90)
    finish_ok(cluster, survivors, 120)
    for node in survivors:
        assert node.pid == node.proc.pid
        state = node.state()
        assert state.phase is Phase.SUCCEEDED
        assert state.restart_count == 0, state
        assert state.membership_restarts >= 1, state
        assert state.world_size == 2


def test_adding_a_node_grows_the_world(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=3)
    # Steps enough for the newcomer's cold start (a torch import) on a loaded machine.
    nodes = [cluster.start(i, train_args(150)) for i in range(2)]
    for node in nodes:
        wait_until(f"world 2 on node {node.index}", reached(node, 5, world=2), 90)
    nodes.append(cluster.start(2, train_args(150)))
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", reached(node, 0, world=3), 90)
    finish_ok(cluster, nodes, 120)
    for node in nodes[:2]:
        state = node.state()
        assert state.restart_count == 0, state
        assert state.world_size == 3


def _kill_and_restart_master(cluster: Cluster, nodes: list[Node], args: list[str]) -> Node:
    for node in nodes:
        wait_until(f"step 10 on node {node.index}", reached(node, 10, world=3), 90)
    nodes[0].kill_node()
    return cluster.start(0, args)


def test_losing_the_master_costs_only_a_rejoin(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=3)
    args = train_args(150)  # the restarted master's cold start must land before the end
    nodes = [cluster.start(i, args) for i in range(3)]
    pids = [node.pid for node in nodes[1:]]
    master = _kill_and_restart_master(cluster, nodes, args)
    survivors = nodes[1:]
    everyone = [master, *survivors]
    for node in everyone:
        wait_until(f"step 20 on node {node.index}", reached(node, 20), 120)
    finish_ok(cluster, everyone, 120)
    assert [node.pid for node in survivors] == pids
    for node in survivors:
        state = node.state()
        assert state.phase is Phase.SUCCEEDED
        assert state.store_recoveries >= 1, state
        assert state.restart_count == 0, state
        # Resumed from a checkpoint, not from scratch.
        assert node.resumes()[-1][0] > 0, node.resumes()


def test_stock_torchrun_survivors_exit_when_the_master_is_lost(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=3)
    args = train_args(200)
    nodes = [cluster.start(i, args, stock=True) for i in range(3)]
    _kill_and_restart_master(cluster, nodes, args)
    for node in nodes[1:]:
        code = node.wait_exit(60)
        assert code != 0
        assert "RendezvousConnectionError" in node.text()
    cluster.kill_all()
    cluster.assert_clean()


def test_sigterm_forwards_to_workers_and_exits_143(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=2)
    nodes = [cluster.start(i, train_args(400)) for i in range(2)]
    for node in nodes:
        wait_until(f"step 3 on node {node.index}", reached(node, 3), 60)
    # The readiness probe (torch-free) says ready while the workers run.
    probe = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpjob_worker.agent.probe",
            "--state-file",
            str(nodes[1].state_file),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert probe.returncode == 0, probe.stderr
    for node in nodes:
        os.kill(node.pid, signal.SIGTERM)
    for node in nodes:
        assert node.wait_exit(30) == EXIT_STOPPED_BY_SIGNAL, cluster.logs()
        assert "Fatal Python error" not in node.text(), cluster.logs()
        rank = node.resumes()[-1][1]
        assert f"DDPJOB sigterm rank={rank}" in node.text()
        assert node.state().phase is Phase.STOPPED
    cluster.assert_clean()


def test_unreachable_endpoint_fails_fast_with_a_clear_message(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=2, join_timeout=3)
    started = time.monotonic()
    node = cluster.start(1, train_args(5))  # no node 0: nobody hosts the store
    code = node.wait_exit(30)
    elapsed = time.monotonic() - started
    assert code == EXIT_ENDPOINT_UNREACHABLE, node.text()
    text = node.text()
    assert f"127.0.0.1:{cluster.port} is unreachable" in text
    assert "join timeout 3s" in text
    assert "Connection refused" in text
    assert elapsed < 20
    state = node.state()
    assert state.phase is Phase.FAILED
    assert state.last_failure is not None
    assert state.last_failure.exit_code == EXIT_ENDPOINT_UNREACHABLE
    cluster.assert_clean()


def test_worker_failures_use_up_the_budget_then_only_that_pod_fails(
    make_cluster: MakeCluster,
) -> None:
    # Every rank crashes at once, every round. Only the earliest failure of a round is charged
    # (the others are collateral), so the nodes share the charges; the first to use up its
    # budget exits with its worker's own code (1: the script failed, permanent under
    # restartPolicy ExitCode) WITHOUT closing the rendezvous, as in a DDPJob pod: the other node
    # keeps waiting for a replacement instead of failing too.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=1)
    nodes = [cluster.start(i, [*train_args(5), "--crash-always"]) for i in range(2)]
    wait_until("one node to give up", lambda: not all(n.running() for n in nodes), 120)
    failed = next(n for n in nodes if not n.running())
    other = next(n for n in nodes if n is not failed)
    assert failed.wait_exit(5) == 1, cluster.logs()
    state = failed.state()
    assert state.phase is Phase.FAILED
    assert state.restart_count == 1
    assert state.last_failure is not None
    assert state.last_failure.exit_code == 1
    if failed.index == 1:
        # The store host is up: the survivor waits in the rendezvous; its budget is not spent.
        time.sleep(3)
        assert other.running(), cluster.logs()
        assert other.state().restart_count <= 1
    os.kill(other.pid, signal.SIGTERM)
    assert other.wait_exit(30) in {EXIT_STOPPED_BY_SIGNAL, EXIT_INFRA}, cluster.logs()
    cluster.assert_clean()


def test_outside_a_ddpjob_pod_giving_up_closes_the_rendezvous_as_torch(
    make_cluster: MakeCluster,
) -> None:
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=0)
    outside = {"DDPJOB_POD_INDEX": None}
    nodes = [cluster.start(i, [*train_args(5), "--crash-always"], env=outside) for i in range(2)]
    for node in nodes:
        assert node.wait_exit(90) == 1, cluster.logs()
    assert "the rendezvous was closed by another agent" in cluster.logs()
    cluster.assert_clean()


def test_one_faulty_pod_is_charged_and_replaced_alone(make_cluster: MakeCluster) -> None:
    # maxRestarts 0: with torch's rule both agents are charged for pod 1's crash and the job
    # ends. Here pod 1's failure is the root cause (charged: it exits 1, its pod is replaced),
    # pod 0's is collateral (a free restart), and pod 0 re-admits pod 1's replacement.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=0)
    args = [*train_args(30, sleep=0.05), "--crash-once-on-pod", "1", "--crash-step", "8"]
    nodes = [cluster.start(i, args) for i in range(2)]
    assert nodes[1].wait_exit(90) == 1, cluster.logs()
    assert "DDPJOB crash pod=1" in nodes[1].text()
    assert nodes[0].running(), cluster.logs()
    replacement = cluster.start(1, args)
    finish_ok(cluster, [nodes[0], replacement], 120)
    state = nodes[0].state()
    assert state.phase is Phase.SUCCEEDED
    assert state.restart_count == 0, state
    assert state.membership_restarts >= 1, state
    # Free: collateral (its worker failed after pod 1's), or pod 1 announced the round's end.
    text = nodes[0].text()
    assert "collateral (free restart)" in text or re.search(
        r"announced its end \([^)]*failure", text
    ), text
    # TORCHELASTIC_RESTART_COUNT counts the free restart, as torchrun would: > 0 means resume.
    assert nodes[0].resumes()[-1][3] >= 1, nodes[0].resumes()
    assert nodes[0].resumes()[-1][0] > 0, "resumed from a checkpoint"


def test_with_no_restart_left_a_member_that_dies_whole_is_nobodys_charge(
    make_cluster: MakeCluster,
) -> None:
    # maxRestarts 0 and pod 1 SIGKILLed whole (a lost node, an OOM of the pod): it never
    # reports a failure. The survivors' workers fail on the broken collective; the earliest of
    # them used to be taken for the root cause after the settle window and give up with its
    # worker's exit code 1, which restartPolicy: ExitCode makes the end of the job (review
    # finding 3). A member that is gone makes it a membership change: both carry on at world 2.
    cluster = make_cluster(min_nodes=2, max_nodes=3, max_restarts=0)
    nodes = [cluster.start(i, train_args(60, sleep=0.05)) for i in range(3)]
    for node in nodes:
        wait_until(f"step 5 on node {node.index}", reached(node, 5), 120)
    nodes[1].kill_node()
    survivors = [nodes[0], nodes[2]]
    finish_ok(cluster, survivors, 180)
    for node in survivors:
        state = node.state()
        assert state.restart_count == 0, state
        assert node.resumes()[-1][2] == 2, node.resumes()  # the last run at world 2
    assert "the root cause" not in cluster.logs(), cluster.logs()


def drop_the_round(cluster: Cluster) -> None:
    """Do to the rendezvous state what a newcomer's sync does once every member's heartbeat
    has lapsed: torch's sanitizer removes them all, and the empty round gives way to the next,
    open one."""
    import pickle  # noqa: PLC0415

    from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: PLC0415
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (  # noqa: PLC0415
        C10dRendezvousBackend,
        _create_tcp_store,
    )

    from ddpjob_worker.agent.rendezvous import SealedBackend  # noqa: PLC0415
    from ddpjob_worker.membership.seal import Seal  # noqa: PLC0415

    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{cluster.port}", cluster.run_id, 1, 3, is_host="false"
    )
    store = _create_tcp_store(params)
    # As an agent of the job writes it: sealed with the job's key.
    backend = SealedBackend(
        C10dRendezvousBackend(store, cluster.run_id),
        Seal(cluster.store_key.encode()),
        f"torch.rendezvous.{cluster.run_id}",
    )
    for _ in range(20):
        current = backend.get_state()
        assert current is not None
        state = pickle.loads(current[0])
        state.participants.clear()
        state.wait_list.clear()
        state.last_heartbeats.clear()
        state.round += 1
        state.complete, state.deadline = False, None
        written = backend.set_state(pickle.dumps(state), current[1])
        if written is not None and written[2]:
            return
    raise AssertionError("could not write the rendezvous state")


def test_members_dropped_from_their_round_rejoin_and_the_newcomer_trains_with_them(
    make_cluster: MakeCluster,
) -> None:
    # torch's store server looks up every new client's name on its one thread: with a DNS
    # that does not answer it stalls for 10 s (two 5 s tries), every member's heartbeat lapses,
    # and the newcomer's sync drops them all and opens the next round, which it then waits in
    # alone. torch's agents train on in a round the state no longer has, and never see anyone
    # waiting. Ours notice they are out of it, rejoin, and the newcomer trains with them.
    # torch's c10d rendezvous: outside a DDPJob pod (in one, the hub holds the rounds).
    cluster = make_cluster(min_nodes=2, max_nodes=3)
    cluster.failover = False
    nodes = [cluster.start(i, train_args(300, sleep=0.05)) for i in range(2)]
    for node in nodes:
        wait_until(f"world 2 on node {node.index}", reached(node, 5, world=2), 120)
    drop_the_round(cluster)
    newcomer = cluster.start(2, train_args(300, sleep=0.05))
    everyone = [*nodes, newcomer]
    for node in everyone:
        wait_until(f"world 3 on node {node.index}", reached(node, 0, world=3), 90)
    for node in nodes:
        assert "no longer has us in our round" in node.text(), node.text()
    finish_ok(cluster, everyone, 180)
    assert all(node.state().restart_count == 0 for node in everyone)


def test_a_peer_failing_milliseconds_after_the_crash_is_still_collateral(
    make_cluster: MakeCluster,
) -> None:
    # Pod 1 crashes while pod 0 is already blocked in the step's allreduce: pod 0's worker
    # fails within milliseconds, and both agents notice in the same 0.1 s monitor tick. Only the
    # exit times order them: pod 1 is charged (exits 1), pod 0 restarts for free.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=0)
    args = [*train_args(30), "--crash-once-on-pod", "1", "--crash-step", "8"]
    nodes = [cluster.start(i, [*args, "--crash-delay", "0.5"]) for i in range(2)]
    assert nodes[1].wait_exit(90) == 1, cluster.logs()
    # Pod 0 restarts for free: as collateral (its worker failed and pod 1's report is earlier),
    # or because pod 1 announced the end of the round before pod 0's worker failed.
    wait_until("pod 0 decided", lambda: "restarting workers" in nodes[0].text(), 30)
    text = nodes[0].text()
    assert "collateral (free restart)" in text or "announced its end" in text, cluster.logs()
    assert "the root cause" not in text, cluster.logs()
    assert nodes[0].running(), cluster.logs()
    replacement = cluster.start(1, args)
    finish_ok(cluster, [nodes[0], replacement], 120)
    assert nodes[0].state().restart_count == 0


def test_a_peer_that_fails_after_the_host_finished_does_not_hold_it_in_the_exit_barrier(
    make_cluster: MakeCluster,
) -> None:
    # Pod 0's workers succeed and its agent waits in torch's exit barrier for the round's other
    # agent. Pod 1's worker aborts after its last step (gloo's teardown abort), so its agent
    # restarts it in a new round of its own, where it resumes at the end and succeeds. It never
    # checks in to the old round with torch's barrier, and pod 0 waited exit_barrier_timeout
    # (300 s) before exiting; now pod 1 checks in to the round it left, and both exit at once.
    cluster = make_cluster(min_nodes=1, max_nodes=2, max_restarts=3)
    args = [*train_args(12, sleep=0.05), "--abort-at-exit-once-on-pod", "1"]
    nodes = [cluster.start(i, args) for i in range(2)]
    assert nodes[1].wait_exit(90) == 0, cluster.logs()
    assert "DDPJOB abort-at-exit pod=1" in nodes[1].text()
    state = nodes[1].state()
    assert state.last_failure is not None
    assert state.last_failure.exit_code == -signal.SIGABRT, state
    assert state.rdzv_round == 2, state  # a round of its own (its restart refunded: 2 -> 1 node)
    assert nodes[1].resumes()[-1][0] == 12, "the restart resumed after the last step"
    finish_ok(cluster, nodes, 30)
    assert nodes[0].state().phase is Phase.SUCCEEDED
    assert "Error waiting on exit barrier" not in cluster.logs()


def test_a_peer_that_gives_up_after_the_host_finished_releases_it_at_once(
    make_cluster: MakeCluster,
) -> None:
    # The same teardown abort with no restart left: pod 1 gives up (134: SIGABRT) and checks in
    # to its round's exit barrier on the way out, so pod 0 exits 0 now, not in 300 s.
    cluster = make_cluster(min_nodes=1, max_nodes=2, max_restarts=0)
    args = [*train_args(12, sleep=0.05), "--abort-at-exit-once-on-pod", "1"]
    nodes = [cluster.start(i, args) for i in range(2)]
    assert nodes[1].wait_exit(90) == 128 + signal.SIGABRT, cluster.logs()
    assert nodes[0].wait_exit(30) == 0, cluster.logs()
    assert nodes[0].state().phase is Phase.SUCCEEDED
    cluster.assert_clean()


def test_when_the_faulty_pod_is_pod_0_the_others_wait_for_its_replacement(
    make_cluster: MakeCluster,
) -> None:
    # Pod 0 hosts the store. Its crash is the root cause: with maxRestarts 0 it exits 1 and its
    # store goes with it, possibly while pod 1 is still comparing failure reports in that store.
    # Pod 1 must read that as a lost store host (a free restart and a rejoin), never as a
    # charge: it waits for pod 0's replacement and the job finishes.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=0)
    args = [*train_args(30, sleep=0.05), "--crash-once-on-pod", "0", "--crash-step", "8"]
    nodes = [cluster.start(i, args) for i in range(2)]
    assert nodes[0].wait_exit(90) == 1, cluster.logs()
    time.sleep(3)
    assert nodes[1].running(), cluster.logs()
    assert nodes[1].state().restart_count == 0, cluster.logs()
    replacement = cluster.start(0, args)
    finish_ok(cluster, [replacement, nodes[1]], 150)
    state = nodes[1].state()
    assert state.phase is Phase.SUCCEEDED
    assert state.restart_count == 0, state
    assert state.store_recoveries >= 1, state


def test_a_worker_killed_by_a_signal_gives_128_plus_the_signal(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=1, max_nodes=1, max_restarts=0)
    node = cluster.start(0, train_args(400))
    wait_until("step 2", reached(node, 2), 60)
    (worker,) = node.worker_pids()
    os.kill(worker, signal.SIGKILL)  # what the OOM killer does
    assert node.wait_exit(30) == 128 + signal.SIGKILL, node.text()
    assert is_retryable_exit(128 + signal.SIGKILL)
    cluster.assert_clean()


def test_a_second_sigterm_after_a_restart_still_leaves_no_worker(
    make_cluster: MakeCluster,
) -> None:
    # torch's PContext.start reinstalls its own handler at every worker start; with it, a second
    # SIGTERM aborts the shutdown and a worker slow to stop outlives the agent.
    cluster = make_cluster(min_nodes=1, max_nodes=1, max_restarts=3, grace_seconds=3)
    node = cluster.start(0, [*train_args(400), "--sigterm-delay", "60"])
    wait_until("step 2", reached(node, 2), 60)
    (worker,) = node.worker_pids()
    os.kill(worker, signal.SIGKILL)
    wait_until("the restarted worker's step", lambda: len(node.resumes()) == 2, 60)
    wait_until("a step after the restart", lambda: node.text().count("step=") > 4, 30)
    os.kill(node.pid, signal.SIGTERM)
    wait_until("the worker got SIGTERM", lambda: "DDPJOB sigterm" in node.text(), 10, 0.02)
    # More SIGTERMs while the agent waits for its worker (a kubelet and an impatient user).
    # torch's run() retries an interrupted shutdown once in its `finally`, so it takes a third
    # signal to make torch's handler abandon the shutdown for good.
    for _ in range(3):
        if node.running():
            os.kill(node.pid, signal.SIGTERM)
        time.sleep(0.3)
    assert node.wait_exit(30) == EXIT_STOPPED_BY_SIGNAL, node.text()
    cluster.assert_clean(timeout=5)


def test_a_fractional_grace_period_is_kept(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=1, max_nodes=1)
    node = cluster.start(
        0, [*train_args(400), "--sigterm-delay", "0.3"], env={"DDPJOB_GRACE_SECONDS": "0.9"}
    )
    wait_until("step 2", reached(node, 2), 60)
    os.kill(node.pid, signal.SIGTERM)
    assert node.wait_exit(30) == EXIT_STOPPED_BY_SIGNAL, node.text()
    # int(0.9) would be 0: SIGKILL at once, before the worker's 0.3 s SIGTERM handler ends.
    assert "DDPJOB sigterm-done" in node.text(), node.text()
    cluster.assert_clean()


def test_torchs_watchdog_stops_restarts(make_cluster: MakeCluster) -> None:
    # torch's uninterruptible-state watchdog sets the remaining restarts to 0 when a worker sits
    # in D state; the agent must not restart it anyway from its own budget.
    cluster = make_cluster(min_nodes=1, max_nodes=1, max_restarts=3)
    node = cluster.start(
        0,
        [*train_args(400), "--stuck-at-step", "3", "--stuck-seconds", "4"],
        env={"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT": "1"},
    )
    assert node.wait_exit(60) == EXIT_INFRA, node.text()
    assert "torch disabled restarts" in node.text()
    assert len(node.resumes()) == 1, "no restart"
    state = node.state()
    assert state.phase is Phase.FAILED
    assert state.restart_count == 0
    cluster.assert_clean()


FREEZER = Path("/sys/fs/cgroup/freezer")


@contextlib.contextmanager
def frozen_cgroup() -> Iterator[Path]:
    """A cgroup v1 freezer of our own: a process in it, once FROZEN, does not die of a SIGKILL
    until it is THAWED (as a process stuck in a device driver does not)."""
    if not (FREEZER / "freezer.state").exists() and not (FREEZER / "tasks").exists():
        pytest.skip("no cgroup v1 freezer at /sys/fs/cgroup/freezer to hold a killed worker")
    group = FREEZER / f"ddpjob-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        yield group
    finally:
        (group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        group.rmdir()


def test_new_workers_wait_until_the_stopped_ones_are_gone(make_cluster: MakeCluster) -> None:
    # torch waits 0.25 s (our stop timeout) after its SIGKILL too, then abandons the worker and
    # starts the next: on a GPU, a worker that takes seconds to release its device (or hangs in
    # the driver) would still hold it. Pod 0's worker is held in a frozen cgroup, so its SIGKILL
    # cannot end it; pod 1's worker is killed. Pod 0 must start no worker while the old one lives.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=2)
    nodes = [cluster.start(i, train_args(60, sleep=0.05)) for i in range(2)]
    for node in nodes:
        wait_until(f"node {node.index} trains", reached(node, 3), 90)
    with frozen_cgroup() as group:
        (held,) = nodes[0].worker_pids()
        (group / "cgroup.procs").write_text(str(held))
        (group / "freezer.state").write_text("FROZEN")
        (victim,) = nodes[1].worker_pids()
        os.kill(victim, signal.SIGKILL)
        wait_until(
            "pod 0's agent waiting for its stopped worker",
            lambda: "stopped worker(s) to exit" in nodes[0].text(),
            60,
        )
        time.sleep(3.0)  # torch alone had started the next worker 0.25 s after the SIGKILL
        assert psutil.pid_exists(held) and psutil.Process(held).status() != psutil.STATUS_ZOMBIE
        assert len(nodes[0].resumes()) == 1, nodes[0].text()
    for node in nodes:
        assert node.wait_exit(120) == 0, cluster.logs()
    assert len(nodes[0].resumes()) == 2, nodes[0].text()
    # torch still says it abandons the worker after its 0.25 s; the agent then waited for it.
    assert "has not exited" not in nodes[0].text(), nodes[0].text()
    cluster.assert_clean()


@pytest.mark.parametrize(
    ("message", "cause", "code"),
    [
        ("a bug in the training script", "error", 1),
        (
            "[gloo/transport/tcp/pair.cc:537] Read error: Connection reset by peer",
            "comm",
            EXIT_INFRA,
        ),
    ],
)
def test_giving_up_after_a_communication_error_is_retryable(
    make_cluster: MakeCluster, message: str, cause: str, code: int
) -> None:
    # No restart left: a worker's own error ends the pod with its exit code (1: restartPolicy
    # ExitCode fails the job), a collective that failed under it with 200 (retryable). The
    # worker's uncaught exception reaches torch's error file through init_distributed(), and
    # the agent's failure report names its cause (review finding 3).
    cluster = make_cluster(min_nodes=1, max_nodes=1, max_restarts=0)
    node = cluster.start(0, [*train_args(30), "--raise-at-step", "3", "--raise-message", message])
    assert node.wait_exit(90) == code, node.text()
    assert re.search(rf"failure reports of this round: node 0 at [\d.]+ \({cause}\);", node.text())
    state = node.state()
    assert state.phase is Phase.FAILED
    assert state.last_failure is not None and state.last_failure.exit_code == code, state
    cluster.assert_clean()


def test_a_checkpoint_being_written_is_finished_before_its_worker_is_stopped(
    make_cluster: MakeCluster,
) -> None:
    # Rank 0 writes its step-10 checkpoint for 2 s (a large one) inside saving(); pod 1 crashes
    # meanwhile. A broken round stops workers 0.25 s after SIGTERM: the write was killed and
    # the job resumed from step 5 (review finding 6). The agent now lets the write finish.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=2)
    args = [
        *train_args(30, sleep=0.05),
        *("--ckpt-write-seconds", "2"),
        *("--crash-once-on-pod", "1", "--crash-step", "10", "--crash-delay", "0.5"),
    ]
    nodes = [cluster.start(i, args) for i in range(2)]
    finish_ok(cluster, nodes, 120)
    text = nodes[0].text()
    assert "is saving a checkpoint: letting it finish" in text, cluster.logs()
    assert "DDPJOB ckpt step=10" in text, text
    assert [node.resumes()[1][0] for node in nodes] == [10, 10], cluster.logs()


def test_the_store_host_waits_while_its_port_is_taken(make_cluster: MakeCluster) -> None:
    # The pod 0 we replace may still hold the rendezvous port (terminating on a hostNetwork
    # node): the new host tries again with a back-off instead of exiting 200 at once and
    # burning the job's budget (issue 23). Here a plain socket holds the port for 2 s.
    cluster = make_cluster(min_nodes=1, max_nodes=1)
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", cluster.port))
    holder.listen()
    try:
        node = cluster.start(0, train_args(10))
        wait_until(
            "the host saying its port is in use",
            lambda: "its port is in use" in node.text(),
            60,
        )
        time.sleep(2.0)
        assert node.running(), node.text()
        assert not node.steps()
    finally:
        holder.close()
    assert node.wait_exit(120) == 0, node.text()
    assert {step for step, _, _ in node.steps()} == set(range(10))
    cluster.assert_clean()


ORPHANS = """
import os, sys, time
for _ in range(3):
    if os.fork() == 0:  # a child that leaves a grandchild behind, as a DataLoader worker might
        if os.fork() == 0:
            time.sleep(0.3)
            os._exit(0)
        os._exit(0)
    os.wait()
print("orphans left", flush=True)
time.sleep(float(sys.argv[1]))
"""


def test_as_pid_1_the_agent_reaps_the_orphans_its_workers_leave(tmp_path: Path) -> None:
    # In a pod with no init the agent is PID 1: the worker's own children, orphaned, become its
    # children, and their zombies stayed until the pod ended (review finding A). Here the agent
    # runs as PID 1 of a PID namespace of its own.
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is needed to run the agent as PID 1")
    script = tmp_path / "orphans.py"
    script.write_text(ORPHANS)
    log = tmp_path / "agent.log"
    agent = [sys.executable, "-m", "ddpjob_worker.agent.cli", "--standalone", "--nnodes", "1"]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount", "--mount-proc", *agent, str(script), "6"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "DDPJOB_WARM_WORKERS": "0"},
        )
    try:
        wait_until("the worker leaving orphans", lambda: "orphans left" in log.read_text(), 60)
        (pid1,) = psutil.Process(proc.pid).children()  # unshare forks the namespace's PID 1
        time.sleep(2.0)  # the grandchildren exit 0.3 s in; the agent looks once a second

        def zombies() -> list[int]:
            found = []
            for child in pid1.children():
                with contextlib.suppress(psutil.NoSuchProcess):  # reaped as we look
                    if child.status() == psutil.STATUS_ZOMBIE:
                        found.append(child.pid)
            return found

        # A loaded machine may delay the agent's next look: its zombies must go, not at once.
        wait_until("the orphans reaped", lambda: not zombies(), 15)
        assert proc.wait(timeout=60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
