"""A silent peer (a frozen pod: SIGSTOP of the agent, its workers and its spares) with real torch
processes: dropped from the round within seconds, back when it wakes, and short stalls forgiven.

A frozen pod sends no reset: its kernel still accepts connections, its sockets stay open, and
its workers' gloo peers block in their collective until gloo's timeout (30 min by default).
Only the agents' liveness answers (``ddpjob_worker.membership.liveness.PeerWatch``) tell it apart. The
store host (node 0) is never frozen for longer than a stall here: a silent store host is "store
lost", another story.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from ddpjob_worker.membership import liveness
from ddpjob_worker.state import Phase
from tests.harness.agents import CKPT_RE, RESUME_RE, STEP_RE, Cluster, Node, wait_until
from tests.harness.podlogs import PodLog, lineage_problems, rank0_runs

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., Cluster]
STEPS = 400
CKPT_EVERY = 5
SILENT_TIMING = {
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
    "last_call_timeout": 2,
    "join_timeout": 600,
}
"""torch alone: a frozen node's heartbeats lapse after 5 s, but its peers' workers sit in their
allreduce until gloo's timeout, so nobody ever asks torch. The long join timeout keeps a waiting
node from giving up while the frozen one sleeps."""
DROPPED = "re-forming without"
"""What an agent logs when it drops a silent member (``DdpjobAgent._drop_silent``)."""


def train_args(steps: int = STEPS) -> list[str]:
    return ["--steps", str(steps), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0.05"]


@dataclass
class Run:
    """One run of a node's worker: its resume line and the steps it logged after it."""

    resume: int
    rank: int
    world: int
    steps: list[int] = field(default_factory=list)


def runs(node: Node) -> list[Run]:
    """The runs of the node's worker (nprocPerNode 1: each resume line begins one)."""
    found: list[Run] = []
    for line in node.lines():
        if resume := RESUME_RE.match(line):
            found.append(Run(int(resume[1]), int(resume[2]), int(resume[3])))
        elif found and (step := STEP_RE.match(line)):
            found[-1].steps.append(int(step[1]))
    return found


def stepping_at(node: Node, world: int, *, after_run: int = 0) -> Callable[[], bool]:
    """A run of the node's worker after its first ``after_run`` ones stepped at ``world``."""
    return lambda: any(run.world == world and run.steps for run in runs(node)[after_run:])


def checkpointed(cluster: Cluster) -> bool:
    return any(CKPT_RE.match(line) for node in cluster.nodes for line in node.lines())


def start_three(make_cluster: MakeCluster, **timing: int) -> tuple[Cluster, list[Node]]:
    cluster = make_cluster(min_nodes=2, max_nodes=3, **timing)
    nodes = [cluster.start(i, train_args()) for i in range(3)]
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", stepping_at(node, 3), 120)
    wait_until("a checkpoint", lambda: checkpointed(cluster), 30)
    return cluster, nodes


def finish_ok(cluster: Cluster, nodes: list[Node], timeout: float) -> None:
    for node in nodes:
        code = node.wait_exit(timeout)
        assert code == 0, f"node {node.index} exited {code}\n{cluster.logs()}"
        assert "Fatal Python error" not in node.text(), cluster.logs()
        assert node.state().phase is Phase.SUCCEEDED, node.state()
    cluster.assert_clean()


def every_step_once(cluster: Cluster) -> None:
    """Replay rank 0's runs (``lineage_problems`` of the e2e suite): each resumes at the newest
    checkpoint and steps on without a gap, and the lineage ends at ``0..STEPS-1``, each once.

    The runs are ordered by their line numbers, which needs them all in one log: torch ranks the
    nodes of a round by their agents' pids (same address), so rank 0 stays with node 0, the
    first started, as long as it is a member."""
    homes = {node.index for node in cluster.nodes for run in runs(node) if run.rank == 0}
    assert homes == {0}, f"rank 0 ran on nodes {sorted(homes)}, not on node 0 alone"
    log = PodLog(
        "node-0", "", [(float(i), line) for i, line in enumerate(cluster.nodes[0].lines())]
    )
    rank0 = rank0_runs(log)
    problems = lineage_problems(rank0, STEPS, CKPT_EVERY)
    summary = "\n".join(str(run) for run in rank0)
    assert not problems, "not every step done once:\n  " + "\n  ".join(problems) + f"\n{summary}"


def test_a_frozen_member_is_dropped_and_rejoins_when_it_wakes(make_cluster: MakeCluster) -> None:
    cluster, nodes = start_three(make_cluster, **SILENT_TIMING)
    frozen, survivors = nodes[1], [nodes[0], nodes[2]]
    frozen.freeze()
    frozen_at = time.monotonic()
    for node in survivors:
        # Without the liveness answers: until gloo's timeout (30 min) in the allreduce.
        wait_until(f"world 2 on node {node.index}", stepping_at(node, 2), 60)
    dropped_after = time.monotonic() - frozen_at
    assert any(DROPPED in node.text() for node in survivors), cluster.logs()
    for node in survivors:
        state = node.state()
        assert state.restart_count == 0, state  # a silent peer is not our failure
        assert state.membership_restarts >= 1, state
        assert node.running(), cluster.logs()
    assert frozen.running(), "a frozen process cannot exit"

    frozen.thaw()
    worlds_2 = {node.index: len(runs(node)) for node in survivors}
    for node in survivors:
        wait_until(
            f"world 3 again on node {node.index}",
            stepping_at(node, 3, after_run=worlds_2[node.index]),
            90,
        )
    wait_until("node 1 stepping in a new round", stepping_at(frozen, 3, after_run=1), 90)
    assert frozen.state().restart_count == 0, frozen.state()

    finish_ok(cluster, nodes, 120)
    for node in nodes:
        state = node.state()
        assert state.restart_count == 0, (node.index, state)
        assert state.world_size == 3, (node.index, state)
    every_step_once(cluster)
    print(f"both survivors at world 2 {dropped_after:.1f}s after the freeze")


def test_short_stalls_restart_nobody(make_cluster: MakeCluster) -> None:
    # Shorter than the silence window (SILENT_AFTER_SECONDS): a GC pause, a loaded machine, a
    # frozen cgroup for a second. Node 0, the store host, included.
    stall = 0.7  # with room for a loaded machine to stretch the sleep and the freeze
    assert stall < liveness.SILENT_AFTER_SECONDS / 1.5
    rng = random.Random(20261125)
    victims = [0, 1, 2, rng.randrange(3)]
    rng.shuffle(victims)
    cluster, nodes = start_three(make_cluster)
    # From here on: a node that started late may have made the first round at world 2, and
    # its join then restarted the others once; the stalls must add nothing to that.
    begun = [(n.state().membership_restarts, len(n.resumes()), len(n.steps())) for n in nodes]
    for index in victims:
        assert all(node.running() for node in nodes), f"finished before the stalls {victims}"
        nodes[index].freeze()
        time.sleep(stall)
        nodes[index].thaw()
        time.sleep(3.0)
    for node, (restarts, resumes, steps) in zip(nodes, begun, strict=True):
        state = node.state()
        assert state.restart_count == 0, (node.index, victims, state)
        assert state.membership_restarts == restarts, (node.index, victims, state)
        assert len(node.resumes()) == resumes, (node.index, victims, node.resumes())
        assert {world for _, _, world in node.steps()[steps:]} == {3}, (node.index, victims)
        assert DROPPED not in node.text(), cluster.logs()
    finish_ok(cluster, nodes, 120)
    for node, (restarts, resumes, _) in zip(nodes, begun, strict=True):
        assert len(node.resumes()) == resumes, (node.index, victims, node.resumes())
        assert node.state().membership_restarts == restarts, (node.index, victims, node.state())
    every_step_once(cluster)
