"""Store failover with real torch processes: the store's host (node 0, "pod 0") is lost loudly,
silently or by its own SIGTERM, and the survivors carry on around a new host; a replacement
pod 0 finds the current store by itself; a host that wakes up is fenced and rejoins.

Every node has a directory port and knows its peers, as the operator's pods do
(``tests.harness.agents.Cluster.failover``). Rank 0 moves between nodes here, so "every step done
once" is checked on the lines of every node, stamped as they arrive (:class:`Stamped`).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from ddpjob_worker.contract import EXIT_STOPPED_BY_SIGNAL
from ddpjob_worker.membership import liveness
from ddpjob_worker.state import Phase
from tests.harness.agents import CKPT_RE, RESUME_RE, STEP_RE, Cluster, Node, wait_until
from tests.harness.podlogs import PodLog, lineage_problems, rank0_runs

pytestmark = pytest.mark.slow

MakeCluster = Callable[..., Cluster]
STEPS = 300
CKPT_EVERY = 5
TIMING = {
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 5,
    "last_call_timeout": 2,
    "join_timeout": 600,
}
"""DDPJob's default rendezvous timings, with a join timeout long enough that nobody gives up
while a frozen host sleeps."""
HOSTING = "hosting the rendezvous store, generation 2"
STEPPED_DOWN = "stepping down"
FOUND = "the job's pods name generation 2"


def train_args(steps: int = STEPS) -> list[str]:
    return ["--steps", str(steps), "--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0.05"]


class Stamped:
    """Every node's log lines with the time they were first seen (polled every 20 ms), so that
    runs of rank 0 on different nodes can be put in order."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.lines: dict[int, list[tuple[float, str]]] = {}
        self._seen: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.poll()

    def poll(self) -> None:
        for key, node in enumerate(self.cluster.nodes):
            lines = node.lines()
            seen = self._seen.get(key, 0)
            # The last line may still be being written: take complete lines only.
            complete = lines if node.text().endswith("\n") else lines[:-1]
            now = time.monotonic()
            self.lines.setdefault(key, []).extend((now, line) for line in complete[seen:])
            self._seen[key] = max(seen, len(complete))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()


def stepping_at(node: Node, world: int, *, after: int = 0) -> Callable[[], bool]:
    """The node logged a step at ``world`` after its first ``after`` resume lines."""

    def check() -> bool:
        resumes = 0
        for line in node.lines():
            if RESUME_RE.match(line):
                resumes += 1
            elif resumes > after and (step := STEP_RE.match(line)) and int(step[3]) == world:
                return True
        return False

    return check


def resumed(node: Node) -> int:
    return sum(1 for line in node.lines() if RESUME_RE.match(line))


@pytest.fixture
def three(make_cluster: MakeCluster) -> Iterator[tuple[Cluster, list[Node], Stamped]]:
    cluster = make_cluster(min_nodes=2, max_nodes=3, **TIMING)
    nodes = [cluster.start(i, train_args()) for i in range(3)]
    stamped = Stamped(cluster)
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", stepping_at(node, 3), 120)
    wait_until(
        "a checkpoint",
        lambda: any(CKPT_RE.match(line) for n in nodes for line in n.lines()),
        30,
    )
    yield cluster, nodes, stamped
    stamped.stop()


def every_step_once(stamped: Stamped, steps: int = STEPS) -> None:
    """The e2e suite's replay (``lineage_problems``) over rank 0's runs on every node."""
    stamped.stop()
    runs = []
    for key, lines in stamped.lines.items():
        runs += rank0_runs(PodLog(f"node-{key}", str(key), lines))
    problems = lineage_problems(runs, steps, CKPT_EVERY)
    summary = "\n".join(str(run) for run in sorted(runs, key=lambda run: run.began))
    assert not problems, "not every step done once:\n  " + "\n  ".join(problems) + f"\n{summary}"


def finish_ok(cluster: Cluster, nodes: list[Node], timeout: float) -> None:
    for node in nodes:
        code = node.wait_exit(timeout)
        assert code == 0, f"node {node.index} exited {code}\n{cluster.logs()}"
        assert node.state().phase is Phase.SUCCEEDED, node.state()
    cluster.assert_clean()


def carried_on(cluster: Cluster, survivors: list[Node]) -> None:
    """Both survivors train at world 2 around a new host, with nothing charged."""
    before = {node.index: resumed(node) for node in survivors}
    for node in survivors:
        wait_until(
            f"world 2 on node {node.index}",
            stepping_at(node, 2, after=before[node.index] - 1),
            60,
        )
    hosts = [node for node in survivors if HOSTING in node.text()]
    assert len(hosts) == 1, f"one new host, not {len(hosts)}\n{cluster.logs()}"
    for node in survivors:
        state = node.state()
        assert state.restart_count == 0, state
        assert state.store_recoveries == 1, state
        # What the operator reads (--ask-agents) and the local runner's status shows.
        assert (state.store_host, state.store_gen) == (node in hosts, 2), state
        if cluster.netns:
            continue  # its address is inside the test's namespaces, not reachable from here
        answer = liveness.ask(cluster.directory(node.index))
        assert answer.info is not None, answer
        said = {key: answer.info.get(key) for key in ("index", "phase", "world", "host", "gen")}
        assert said == {
            "index": node.index,
            "phase": "running",
            "world": 2,
            "host": node in hosts,
            "gen": 2,
        }, said


def test_the_store_hosts_death_costs_a_rejoin_around_a_survivor(
    three: tuple[Cluster, list[Node], Stamped],
) -> None:
    """Pod 0 is SIGKILLed whole and never comes back: the survivors train on at world 2 (they
    waited for its replacement before), and finish the job."""
    cluster, nodes, stamped = three
    nodes[0].kill_node()
    survivors = nodes[1:]
    carried_on(cluster, survivors)
    finish_ok(cluster, survivors, 180)
    every_step_once(stamped)


def test_a_replacement_pod_0_joins_the_store_the_survivors_moved_to(
    three: tuple[Cluster, list[Node], Stamped],
) -> None:
    """The operator's replacement for pod 0 has pod 0's env (it would host the store): it asks
    the others first, finds generation 2 and joins it; the world is 3 again."""
    cluster, nodes, stamped = three
    nodes[0].kill_node()
    survivors = nodes[1:]
    carried_on(cluster, survivors)
    replacement = cluster.start(0, train_args())
    wait_until("world 3 on the replacement", stepping_at(replacement, 3), 90)
    assert FOUND in replacement.text(), cluster.logs()
    assert HOSTING not in replacement.text(), cluster.logs()
    finish_ok(cluster, [replacement, *survivors], 180)
    every_step_once(stamped)


def test_a_draining_store_host_hands_over(
    three: tuple[Cluster, list[Node], Stamped],
) -> None:
    """SIGTERM (scale-down, eviction, drain, kubectl delete) of pod 0: it hands the store over,
    exits 143, and the others carry on at once without waiting for it to die."""
    cluster, nodes, stamped = three
    os.kill(nodes[0].pid, signal.SIGTERM)
    survivors = nodes[1:]
    carried_on(cluster, survivors)
    assert nodes[0].wait_exit(60) == EXIT_STOPPED_BY_SIGNAL, cluster.logs()
    assert "handed the rendezvous store over" in nodes[0].text(), cluster.logs()
    for node in survivors:
        assert "hands over" in node.text(), cluster.logs()
    finish_ok(cluster, survivors, 180)
    every_step_once(stamped)


def test_a_frozen_store_host_is_fenced_when_it_wakes(
    three: tuple[Cluster, list[Node], Stamped],
) -> None:
    """Pod 0 freezes (its kernel still accepts, nothing answers): the survivors carry on around
    a new host. When it wakes, its workers' group is gone; it cannot complete a round in its
    own store (no majority), finds generation 2, steps down and rejoins: never two groups."""
    cluster, nodes, stamped = three
    old, survivors = nodes[0], nodes[1:]
    old.freeze()
    carried_on(cluster, survivors)
    frozen_runs = resumed(old)
    old.thaw()
    wait_until("the old host steps down", lambda: STEPPED_DOWN in old.text(), 60)
    wait_until("the old host at world 3", stepping_at(old, 3, after=frozen_runs), 90)
    # It trained only with the others: never a step at a world of its own.
    worlds = {int(m[3]) for line in old.lines() if (m := STEP_RE.match(line))}
    assert worlds == {3}, worlds
    assert HOSTING not in old.text(), cluster.logs()
    state = old.state()
    assert state.restart_count == 0, state
    finish_ok(cluster, nodes, 180)
    every_step_once(stamped)


def test_a_two_pod_job_cannot_tell_a_silent_host_from_a_partition(
    make_cluster: MakeCluster,
) -> None:
    """With two pods, the one left after the other went silent is not a majority of two: it
    must not train alone (the other may be training alone behind a partition). When the
    host wakes, the two train together again."""
    cluster = make_cluster(min_nodes=1, max_nodes=2, **TIMING)
    nodes = [cluster.start(i, train_args(200)) for i in range(2)]
    for node in nodes:
        wait_until(f"world 2 on node {node.index}", stepping_at(node, 2), 120)
    old, survivor = nodes
    before = resumed(survivor)
    old.freeze()
    wait_until("the survivor drops its store host", lambda: HOSTING in survivor.text(), 30)
    time.sleep(8)  # a survivor that did not wait for a majority would train at world 1 now
    assert not stepping_at(survivor, 1, after=before)(), cluster.logs()
    assert "waits for a majority" in survivor.text(), cluster.logs()
    runs = {node.index: resumed(node) for node in nodes}
    old.thaw()
    for node in nodes:
        wait_until(
            f"world 2 again on node {node.index}",
            stepping_at(node, 2, after=runs[node.index]),
            90,
        )
    finish_ok(cluster, nodes, 180)
    for node in nodes:
        worlds = {int(m[3]) for line in node.lines() if (m := STEP_RE.match(line))}
        assert worlds == {2}, (node.index, worlds)


def test_a_cut_off_store_host_never_trains_alone_and_rejoins_when_healed(
    make_cluster: MakeCluster,
) -> None:
    """A real partition (each node in a network namespace of its own; pod 0's link goes down):
    with ``minReplicas: 1`` the cut-off host could train alone at world 1 while the others train
    at world 2. The majority rule forbids it: only the side with 2 of the 3 trains. Healed, the
    old host finds generation 2, steps down and rejoins."""
    cluster = make_cluster(min_nodes=1, max_nodes=3, **TIMING)
    cluster.netns = True
    steps = 800  # the others must still train when the partition heals
    nodes = [cluster.start(i, train_args(steps)) for i in range(3)]
    stamped = Stamped(cluster)
    for node in nodes:
        wait_until(f"world 3 on node {node.index}", stepping_at(node, 3), 120)
    old, survivors = nodes[0], nodes[1:]
    cluster.cut(0)
    carried_on(cluster, survivors)
    wait_until("the cut-off host waits for a majority", lambda: "majority" in old.text(), 30)
    time.sleep(3)  # time enough to train at world 1, if it could
    cluster.heal(0)
    wait_until("the old host steps down", lambda: STEPPED_DOWN in old.text(), 60)
    runs = resumed(old)
    wait_until("the old host at world 3", stepping_at(old, 3, after=runs - 1), 90)
    worlds = {int(m[3]) for line in old.lines() if (m := STEP_RE.match(line))}
    assert worlds == {3}, f"the cut-off host trained at worlds {sorted(worlds)}"
    finish_ok(cluster, nodes, 180)
    every_step_once(stamped, steps)
