"""Fast recovery (issue 13) with real torch processes: a pod that leaves on SIGTERM, a pod that
dies whole, and the charge settled after the restart.

The rendezvous timings here are deliberately slow (10 s heartbeats, 5 missed for a lost node,
a 30 s last call): torch alone would take 50 s to notice that a node is gone and 30 s more to
close the round, so survivors training at the smaller world within 40 s can only come from the
agent telling them (the ``left`` key, the liveness probe, the expected members). The bound
separates the two mechanisms by 40 s; it is not a speed target (those are in bench/).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Callable
from functools import partial

import pytest

from ddpjob_worker.contract import EXIT_STOPPED_BY_SIGNAL
from ddpjob_worker.state import Phase
from tests.harness.agents import Cluster, Node, descendants, is_idle_spare, wait_until

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., Cluster]
SLOW_TORCH = {"keep_alive_interval": 10, "keep_alive_max_attempt": 5, "last_call_timeout": 30}
"""torch would notice a lost node after 50 s, and close a 2-of-3 round 30 s after that."""
WITHOUT_TORCH_TIMERS = 40.0


def train_args(steps: int) -> list[str]:
    return ["--steps", str(steps), "--ckpt-every", "5", "--step-sleep", "0.1"]


def at_world(node: Node, world: int, step: int = 0) -> Callable[[], bool]:
    return lambda: any(s >= step and w == world for s, _, w in node.steps())


def three_nodes(make_cluster: MakeCluster, steps: int) -> tuple[Cluster, list[Node]]:
    cluster = make_cluster(min_nodes=2, max_nodes=3, **SLOW_TORCH)
    nodes = [cluster.start(i, train_args(steps)) for i in range(3)]
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", at_world(node, 3, step=6), 120)
    return cluster, nodes


def finish_uncharged(cluster: Cluster, survivors: list[Node]) -> None:
    for node in survivors:
        assert node.wait_exit(120) == 0, cluster.logs()
        state = node.state()
        assert state.phase is Phase.SUCCEEDED, state
        assert state.restart_count == 0, state  # a peer leaving or dying is not our failure
        assert state.world_size == 2, state
    cluster.assert_clean()


def test_a_pod_stopped_by_sigterm_leaves_and_the_others_do_not_wait_for_its_heartbeats(
    make_cluster: MakeCluster,
) -> None:
    cluster, nodes = three_nodes(make_cluster, 60)
    os.kill(nodes[2].pid, signal.SIGTERM)
    survivors = nodes[:2]
    for node in survivors:
        wait_until(f"world 2 on node {node.index}", at_world(node, 2), WITHOUT_TORCH_TIMERS)
    assert nodes[2].wait_exit(30) == EXIT_STOPPED_BY_SIGNAL, cluster.logs()
    assert "left the rendezvous" in nodes[2].text(), cluster.logs()
    for node in survivors:
        text = node.text()
        assert "announced its end (leave)" in text or "gone since the last round" in text, text
    finish_uncharged(cluster, survivors)


def test_a_pod_killed_whole_is_found_dead_by_its_peers_at_once(
    make_cluster: MakeCluster,
) -> None:
    cluster, nodes = three_nodes(make_cluster, 60)
    nodes[2].kill_node()
    survivors = nodes[:2]
    for node in survivors:
        wait_until(f"world 2 on node {node.index}", at_world(node, 2), WITHOUT_TORCH_TIMERS)
    marked = "".join(node.text() for node in survivors)
    # The store host's hub cuts it (its connection closed, its port refuses), or, outside a
    # DDPJob pod, the peer watch expires it in torch's rendezvous.
    assert (
        re.search(r"cutting 1 member\(s\): \S+ \(gone\)", marked)
        or "in the rendezvous (gone or silent)" in marked
    ), cluster.logs()
    finish_uncharged(cluster, survivors)


def test_a_worker_killed_on_one_node_is_charged_there_only_while_both_restart_at_once(
    make_cluster: MakeCluster,
) -> None:
    # The charge is settled after the restart: node 1's worker died first, node 1 is charged,
    # node 0 (whose worker failed because of it, or which restarted on node 1's announcement)
    # is not. TORCHELASTIC_RESTART_COUNT is 1 on both, as torchrun would count.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=1)
    nodes = [cluster.start(i, train_args(40)) for i in range(2)]
    for node in nodes:
        wait_until(f"step 8 on node {node.index}", at_world(node, 2, step=8), 90)
    workers = nodes[1].worker_pids()
    assert len(workers) == 1, workers
    os.kill(workers[0], signal.SIGKILL)
    for node in nodes:
        assert node.wait_exit(120) == 0, cluster.logs()
    assert [n.state().restart_count for n in nodes] == [0, 1], cluster.logs()
    assert [n.resumes()[-1][3] for n in nodes] == [1, 1], cluster.logs()
    assert "is the root cause" in nodes[1].text(), cluster.logs()
    assert "is the root cause" not in nodes[0].text(), cluster.logs()
    cluster.assert_clean()


def idle_spares(node: Node) -> list[int]:
    return [pid for pid in descendants(node.pid) if is_idle_spare(pid)]


def _trains_with_a_spare(node: Node) -> bool:
    """Training, with a spare whose imports are done (the agent's state says so: a spare still
    importing, at the idle policy, is not handed a worker)."""
    return bool(node.steps()) and len(idle_spares(node)) == 1 and node.state().spares_ready == 1


def _resumed_times(node: Node, count: int) -> bool:
    return len(node.resumes()) == count


def test_a_restart_takes_the_warm_spares_and_leaves_none_behind(
    make_cluster: MakeCluster,
) -> None:
    # Each agent keeps a spare with torch imported; a restart hands it the worker's argv and
    # env. The new workers must be those very processes, and train on without a lost step.
    cluster = make_cluster(min_nodes=2, max_nodes=2, max_restarts=2)
    nodes = [cluster.start(i, train_args(80)) for i in range(2)]
    for node in nodes:
        # training (the early spare is the worker now), and the spare for the next restart
        wait_until(f"a spare on node {node.index}", partial(_trains_with_a_spare, node), 60)
    spares = [idle_spares(node)[0] for node in nodes]
    (victim,) = nodes[1].worker_pids()
    os.kill(victim, signal.SIGKILL)
    for node in nodes:
        wait_until(f"the restart on node {node.index}", partial(_resumed_times, node, 2), 60)
    for node, spare in zip(nodes, spares, strict=True):
        assert f"local rank 0: started warm (pid {spare})" in node.text(), node.text()
        # the first workers too: spares started by the agent before its own imports
        assert node.text().count("local rank 0: started warm") == 2, node.text()
    for node in nodes:
        assert node.wait_exit(120) == 0, cluster.logs()
    for node in nodes:
        (_, second) = node.resumes()
        assert second[3] == 1, node.resumes()  # TORCHELASTIC_RESTART_COUNT reached the worker
        assert {s for s, _, _ in node.steps()} == set(range(80)), "a step was lost"
        assert "workers started warm 2 times, cold 0 times" in node.text(), node.text()
    cluster.assert_clean()  # no spare outlives its agent


def test_two_workers_per_node_start_warm_under_torchruns_omp_default(
    make_cluster: MakeCluster,
) -> None:
    # torchrun sets OMP_NUM_THREADS=1 for more than one worker per node, after the agent's early
    # spares started; spares with another environment than their workers' are never used.
    cluster = make_cluster(min_nodes=1, max_nodes=1, max_restarts=0)
    node = cluster.start(
        0, train_args(20), env={"PET_NPROC_PER_NODE": "2", "OMP_NUM_THREADS": None}
    )
    assert node.wait_exit(120) == 0, cluster.logs()
    assert "OMP_NUM_THREADS=1 for 2 workers per node, as torchrun sets it" in node.text()
    for rank in (0, 1):
        assert f"local rank {rank}: started warm" in node.text(), node.text()
    assert "workers started warm 2 times, cold 0 times" in node.text(), node.text()
    # Two workers share the log: lines may interleave, so look for what each says at its end.
    assert all(f"done steps=20 rank={rank}" in node.text() for rank in (0, 1)), node.text()
    cluster.assert_clean()


def test_warm_workers_can_be_turned_off(make_cluster: MakeCluster) -> None:
    cluster = make_cluster(min_nodes=1, max_nodes=1, max_restarts=1)
    node = cluster.start(0, train_args(80), env={"DDPJOB_WARM_WORKERS": "0"})
    wait_until("step 45 (4.5 s of training)", at_world(node, 1, step=45), 90)
    assert idle_spares(node) == []
    (victim,) = node.worker_pids()
    os.kill(victim, signal.SIGKILL)
    assert node.wait_exit(120) == 0, cluster.logs()
    assert len(node.resumes()) == 2
    assert "started warm" not in node.text()
    cluster.assert_clean()
