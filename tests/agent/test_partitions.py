"""Partitions for real: every node in a network namespace of its own (``tests.harness.netns``), live
processes on both sides, links cut (no reset: packets go nowhere), not processes frozen.

What must hold whatever the cut: two groups never train at once, a side without a majority of
the last round never trains, and once healed everyone trains together again. The store's host
decides every round (``ddpjob_worker.membership.hub``): a side is a majority or it waits.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable

import pytest

from ddpjob_worker.contract import DDPJOB_POD_INDEX, DDPJOB_RDZV_HOST, PET_RDZV_CONF
from tests.agent.test_agent_failover import Stamped, every_step_once, finish_ok
from tests.harness.agents import STEP_RE, Cluster, Node, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="network namespaces need root and iproute2",
    ),
]

MakeCluster = Callable[..., Cluster]
TIMING = {
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
    "last_call_timeout": 2,
    "join_timeout": 600,
}


def train_args(steps: int) -> list[str]:
    return ["--steps", str(steps), "--ckpt-every", "5", "--step-sleep", "0.05"]


def steps_at(node: Node, after: int = 0) -> list[int]:
    """The worlds of the steps ``node`` logged after its first ``after`` lines."""
    return [int(m[3]) for line in node.lines()[after:] if (m := STEP_RE.match(line))]


def stepping(node: Node, world: int, after: int = 0) -> Callable[[], bool]:
    return lambda: world in steps_at(node, after)


def started(
    make_cluster: MakeCluster, count: int, *, min_nodes: int, steps: int
) -> tuple[Cluster, list[Node], Stamped]:
    cluster = make_cluster(min_nodes=min_nodes, max_nodes=count, **TIMING)
    cluster.netns = True
    nodes = [cluster.start(i, train_args(steps)) for i in range(count)]
    stamped = Stamped(cluster)
    for node in nodes:
        wait_until(f"world {count} on node {node.index}", stepping(node, count), 180)
    return cluster, nodes, stamped


def quiet(nodes: list[Node], seconds: float) -> dict[int, list[int]]:
    """Wait ``seconds``; the worlds each node stepped at meanwhile."""
    marks = {node.index: len(node.lines()) for node in nodes}
    time.sleep(seconds)
    return {node.index: steps_at(node, marks[node.index]) for node in nodes}


def test_an_even_split_trains_on_neither_side(make_cluster: MakeCluster) -> None:
    """2|2 of 4 pods with ``minReplicas: 1``: neither side holds a majority of the last round,
    so neither trains; joined again, all 4 finish the job, every step done once (never two
    rank 0s at once)."""
    steps = 600
    cluster, nodes, stamped = started(make_cluster, 4, min_nodes=1, steps=steps)
    assert cluster.fabric is not None
    cluster.fabric.split({2, 3})
    time.sleep(6)  # the silence window, the cut, the restart: any side that could would train
    worlds = quiet(nodes, 8)
    assert all(not steps for steps in worlds.values()), f"a side trained alone: {worlds}"
    assert any("waits for a majority" in node.text() for node in nodes), cluster.logs()
    cluster.fabric.join({2, 3})
    finish_ok(cluster, nodes, 300)
    every_step_once(stamped, steps)


def test_a_cut_off_member_never_trains_alone(make_cluster: MakeCluster) -> None:
    """A non-host pod cut off, ``minReplicas: 1``: the two others (a majority) train at world
    2; the cut-off one would be allowed at world 1 by its bounds, never by the majority."""
    cluster, nodes, _ = started(make_cluster, 3, min_nodes=1, steps=2000)
    cut = nodes[2]
    mark = len(cut.lines())
    cluster.cut(2)
    for node in nodes[:2]:
        wait_until(f"world 2 on node {node.index}", stepping(node, 2), 60)
    time.sleep(5)
    assert 1 not in steps_at(cut, mark) and 2 not in steps_at(cut, mark), cut.text()[-3000:]
    marks = {node.index: len(node.lines()) for node in nodes}
    cluster.heal(2)
    for node in nodes:
        wait_until(f"world 3 again on node {node.index}", stepping(node, 3, marks[node.index]), 120)
    cluster.kill_all()


def test_a_healed_host_stops_once_its_replacement_joined(make_cluster: MakeCluster) -> None:
    """The store's host (pod 0) is cut off; the others carry on around a new host; the operator
    replaces pod 0 (a new pod of index 0, elsewhere) and it joins them. When the old pod 0
    heals, it finds the newer store, steps down, and is told it was replaced: it stops, and
    never trains beside its replacement."""
    cluster, nodes, _ = started(make_cluster, 3, min_nodes=1, steps=3000)
    old = nodes[0]
    mark = len(old.lines())
    cluster.cut(0)
    for node in nodes[1:]:
        wait_until(f"world 2 on node {node.index}", stepping(node, 2), 60)
    # A step of the old group of 3 may end as the cut goes in (its all-reduce was through);
    # alone (min_nodes is 1) it must never train, and after the others' round of 2 not at all.
    assert set(steps_at(old, mark)) <= {3}, "the old pod 0 trained alone after the cut"
    mark = len(old.lines())
    contract = cluster.contract(0)
    conf = ",".join(f"{k}={v}" for k, v in contract.rdzv_conf().items())
    replacement = cluster.start(
        3,
        train_args(3000),
        env={DDPJOB_POD_INDEX: "0", DDPJOB_RDZV_HOST: "1", PET_RDZV_CONF: conf},
    )
    for node in [*nodes[1:], replacement]:
        wait_until(f"world 3 on node {node.index}", stepping(node, 3), 120)
    cluster.heal(0)
    wait_until("the old pod 0 stops", lambda: not old.running(), 60)
    assert "replaced us" in old.text(), old.text()[-3000:]
    assert not steps_at(old, mark), "the old pod 0 trained after the others moved on"
    cluster.kill_all()


def test_a_scale_up_during_a_failover_joins_the_new_store(make_cluster: MakeCluster) -> None:
    """Pod 0 is killed whole and a new pod arrives while the others carry on around a new host:
    it finds the store they moved to (not pod 0's endpoint, whose pod is gone), and the three
    train together."""
    cluster = make_cluster(min_nodes=2, max_nodes=4, **TIMING)
    nodes = [cluster.start(i, train_args(2000)) for i in range(3)]
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", stepping(node, 3), 180)
    nodes[0].kill_node()
    newcomer = cluster.start(3, train_args(2000))
    marks = {node.index: len(node.lines()) for node in nodes[1:]}
    for node in [*nodes[1:], newcomer]:
        after = marks.get(node.index, 0)
        wait_until(f"world 3 again on node {node.index}", stepping(node, 3, after), 120)
    cluster.kill_all()


def test_one_link_down_never_makes_two_groups(make_cluster: MakeCluster) -> None:
    """Pods 1 and 3 cannot reach each other, everyone else can: they disagree about who is
    gone. The store's host alone decides the rounds, so there is only ever one group: the job
    finishes with every step done once, and never two rank 0s at once."""
    steps = 600
    cluster, nodes, stamped = started(make_cluster, 4, min_nodes=1, steps=steps)
    assert cluster.fabric is not None
    cluster.fabric.block(1, 3)
    cluster.fabric.block(3, 1)
    time.sleep(12)
    cluster.fabric.unblock(1)
    cluster.fabric.unblock(3)
    finish_ok(cluster, nodes, 300)
    every_step_once(stamped, steps)
