"""The operator's questions to the agents (``--ask-agents``): real sockets, a real agent
listener (:class:`ddpjob_worker.membership.liveness.Listener`), and the status that follows."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import Iterator

import pytest

from ddpjob_operator import agents
from ddpjob_operator.agents import AgentAnswer, _told
from ddpjob_operator.observe import PodPhase
from ddpjob_worker.membership import liveness

from .test_reconcile import make_job, pod, run


@pytest.fixture
def listener() -> Iterator[liveness.Listener]:
    served = liveness.Listener("127.0.0.1")
    yield served
    served.close()


def port_of(listener: liveness.Listener) -> int:
    return int(listener.address.rpartition(":")[2])


def test_an_agents_answer_is_read_over_a_real_socket(listener: liveness.Listener) -> None:
    listener.info = {"v": 1, "index": 2, "phase": "running", "world": 6, "host": True, "gen": 3}
    answer = asyncio.run(agents.ask("127.0.0.1", port_of(listener)))
    assert answer == AgentAnswer(index=2, phase="running", world=6, host=True, gen=3)
    listener.info = {"v": 1, "index": 2, "phase": "rendezvous", "world": 0, "gen": 3}
    answer = asyncio.run(agents.ask("127.0.0.1", port_of(listener)))
    assert answer == AgentAnswer(index=2, phase="rendezvous", world=0, host=False, gen=3)


def test_a_silent_or_absent_agent_is_no_answer() -> None:
    with socket.socket() as silent:  # the kernel completes the handshake; nobody writes
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        began = time.monotonic()
        assert asyncio.run(agents.ask("127.0.0.1", silent.getsockname()[1], 0.3)) is None
        assert time.monotonic() - began < 2
        refused = silent.getsockname()[1]
    assert asyncio.run(agents.ask("127.0.0.1", refused, 0.3)) is None


def test_an_older_agents_answer_is_no_answer(listener: liveness.Listener) -> None:
    """Before the phase was in the answer, the line said only which store it used."""
    listener.info = {"v": 1, "index": 0, "gen": 1, "store": "a:29400", "host": True}
    assert asyncio.run(agents.ask("127.0.0.1", port_of(listener))) is None
    assert agents.parse_answer(b"not json") is None
    assert agents.parse_answer(b'{"phase": "running", "index": "x"}') is None


def test_answers_lower_readiness_and_name_the_world_that_trains() -> None:
    pods = (pod(0, ip="a"), pod(1, ip="b"), pod(2, ip="c"))
    answers: dict[str, AgentAnswer | None] = {
        "demo-worker-0": AgentAnswer(0, "rendezvous", 0, host=True, gen=1),
        "demo-worker-1": AgentAnswer(1, "running", 4, host=False, gen=1),
        "demo-worker-2": None,  # its node froze: the API still says Ready
    }
    seen = agents.apply(pods, answers)
    assert [(p.ready, p.world_size, p.store_host) for p in seen] == [
        (False, 0, True),
        (True, 4, False),
        (False, None, False),
    ]


def test_no_answer_at_all_keeps_the_apis_view() -> None:
    """A NetworkPolicy of the user's, plain torchrun pods: nobody answers, nothing changes."""
    pods = (pod(0, ip="a"), pod(1, ip="b"))
    assert agents.apply(pods, dict.fromkeys(["demo-worker-0", "demo-worker-1"])) == pods


def test_an_answer_from_another_index_is_no_answer() -> None:
    """A pod's address taken over by a new pod of another index answers for that one."""
    pods = (pod(0, ip="a"), pod(1, ip="b"))
    answers: dict[str, AgentAnswer | None] = {
        "demo-worker-0": AgentAnswer(0, "running", 2, host=True, gen=1),
        "demo-worker-1": AgentAnswer(3, "running", 2, host=False, gen=1),
    }
    assert [(p.ready, p.world_size) for p in agents.apply(pods, answers)] == [
        (True, 2),
        (False, None),
    ]


def test_only_live_started_pods_with_an_address_are_asked(listener: liveness.Listener) -> None:
    listener.info = {"v": 1, "index": 0, "phase": "running", "world": 2, "host": True, "gen": 1}
    pods = (
        pod(0, ip="127.0.0.1"),
        pod(1),  # not scheduled yet: no address
        pod(2, PodPhase.SUCCEEDED, ip="127.0.0.1"),
    )
    answers = asyncio.run(agents.ask_pods(pods, port_of(listener)))
    assert answers == {"demo-worker-0": AgentAnswer(0, "running", 2, host=True, gen=1)}


def test_status_names_the_store_host_of_the_newest_generation() -> None:
    job = make_job(replicas=3)
    assert run(job, pod(0), pod(1), pod(2)).status.store_host is None
    after_failover = run(
        job,
        pod(0, store_host=True, store_gen=1),  # the old host, not yet fenced
        pod(1, store_host=True, store_gen=2),
        pod(2, store_gen=2),
    )
    assert after_failover.status.store_host == "demo-worker-1"
    assert after_failover.status.model_dump(by_alias=True)["storeHost"] == "demo-worker-1"


def test_status_world_is_zero_while_the_agents_rendezvous() -> None:
    job = make_job(replicas=2)
    training = run(job, pod(0, world_size=2), pod(1, world_size=2))
    assert training.status.world_size == 2
    answers: dict[str, AgentAnswer | None] = {
        "demo-worker-0": AgentAnswer(0, "rendezvous", 0, host=True, gen=1),
        "demo-worker-1": None,
    }
    seen = agents.apply((pod(0, ip="a"), pod(1, ip="b")), answers)
    status = run(job, *seen).status
    assert (status.world_size, status.ready_replicas, status.store_host) == (0, 0, "demo-worker-0")


# ---- asking a thousand pods: a kept survey and an operator-wide budget ------------------------


def test_the_budget_grants_a_burst_then_its_rate() -> None:
    budget = agents.Budget(rate=10.0, burst=20, now=0.0)
    assert budget.take(50, now=0.0) == 20
    assert budget.take(50, now=0.5) == 5
    assert budget.take(3, now=10.0) == 3  # refilled to the burst, not beyond
    assert budget.take(50, now=10.0) == 17


def test_a_job_of_up_to_a_burst_of_pods_is_asked_whole_every_2_s() -> None:
    pods = tuple(pod(i, ip=f"10.0.0.{i}") for i in range(agents.ASK_BURST))
    survey, budget = agents.Survey(), agents.Budget(now=0.0)
    for second in (0.0, 2.0, 4.0):
        asked = survey.pick(pods, budget, second)
        assert len(asked) == len(pods)
        survey.record(dict.fromkeys((p.name for p in asked), None), asked, second)


def test_a_large_job_is_asked_new_pods_first_then_the_host_then_the_longest_unasked() -> None:
    pods = [pod(i, ip=f"10.0.{i // 200}.{i % 200}") for i in range(1024)]
    survey, budget = agents.Survey(), agents.Budget(rate=32.0, burst=64, now=0.0)
    first = survey.pick(pods, budget, 0.0)
    assert [p.index for p in first] == list(range(64))
    answer = {
        p.name: AgentAnswer(p.index, "running", 1024, host=p.index == 0, gen=1) for p in first
    }
    survey.record(answer, first, 0.0)
    # 2 s later: 64 more questions; pods never asked come first, and the host of the store
    # (pod 0, asked at 0 s) before the others asked then.
    second = survey.pick(pods, budget, 2.0)
    assert [p.index for p in second] == list(range(64, 128))
    survey.record(dict.fromkeys((p.name for p in second), None), second, 2.0)
    # A replacement of pod 5 (a new address) is asked before anyone else.
    pods[5] = pod(5, ip="10.9.9.9")
    third = survey.pick(pods, budget, 4.0)
    assert [p.index for p in third][:1] == [5]
    # Every pod is asked within 1,024 / 32 s; no more than the budget ever.
    asked_total = 64 + 64 + len(third)
    survey.record(dict.fromkeys((p.name for p in third), None), third, 4.0)
    when = 4.0
    while len(survey.answers(pods, when)) < len(pods):
        when += 2.0
        more = survey.pick(pods, budget, when)
        asked_total += len(more)
        survey.record(dict.fromkeys((p.name for p in more), None), more, when)
    assert when <= 4.0 + 1024 / 32.0
    assert asked_total <= 64 + 32.0 * when


def test_the_host_is_asked_first_among_pods_asked_before() -> None:
    pods = tuple(pod(i, ip=f"10.0.0.{i}") for i in range(4))
    survey, budget = agents.Survey(), agents.Budget(rate=1.0, burst=1, now=0.0)
    host = {"demo-worker-2": AgentAnswer(2, "running", 4, host=True, gen=3)}
    survey.record(host, pods, 0.0)
    survey.record(dict.fromkeys(["demo-worker-0", "demo-worker-1", "demo-worker-3"]), pods, 1.0)
    assert [p.name for p in survey.pick(pods, budget, 5.0)] == ["demo-worker-2"]


def test_a_silent_pods_node_is_asked_next() -> None:
    """Pods of a node are lost together: once one is found silent, the others of its node that
    were asked before that are asked next (a node of 64 in a pass, not one by one over the
    sweep, each a change of the job's counts), then the sweep goes on."""
    pods = [pod(i, ip=f"10.0.{i // 200}.{i % 200}", node=f"node-{i // 64}") for i in range(1024)]
    survey, budget = agents.Survey(), agents.Budget(rate=32.0, burst=64, now=0.0)
    running = {p.name: AgentAnswer(p.index, "running", 1024, host=False, gen=1) for p in pods}
    survey.record(running, pods, 0.0)
    # Pod 1,000 (node 15: pods 960-1,023) is asked first in its turn, and is silent.
    survey.record({"demo-worker-1000": None}, pods, 1.0)
    asked = survey.pick(pods, budget, 2.0)
    assert sorted(p.index for p in asked[:63]) == [i for i in range(960, 1024) if i != 1000]
    assert [p.index for p in asked[63:]] == [0]  # then the sweep, the longest unasked first
    survey.record(dict.fromkeys((p.name for p in asked[:63]), None), asked[:63], 2.0)
    survey.record({"demo-worker-0": running["demo-worker-0"]}, asked[63:], 2.0)
    # Asked since: the sweep goes on, and the silent ones are asked once more ASK_EVERY_SECONDS
    # after their first silence (an agent not listening yet, or slow), then left to the sweep.
    later = survey.pick(pods, budget, 3.0)
    assert [p.index for p in later] == [1000, *range(1, 32)]
    survey.record({p.name: running[p.name] for p in later[1:]}, later[1:], 3.0)
    survey.record({"demo-worker-1000": None}, later[:1], 3.0)
    again = survey.pick(pods, agents.Budget(now=4.0), 2.0 + agents.ASK_EVERY_SECONDS)
    assert sorted(p.index for p in again[:63]) == [i for i in range(960, 1024) if i != 1000]
    assert [p.index for p in again[63:]] == [32]
    survey.record(dict.fromkeys((p.name for p in again[:63]), None), again[:63], 4.0)
    survey.record({"demo-worker-32": running["demo-worker-32"]}, again[63:], 4.0)
    # Twice silent: left to the sweep.
    assert [p.index for p in survey.pick(pods, agents.Budget(now=6.0), 6.0)] == list(range(33, 97))


def test_the_store_hosts_successor_is_looked_for_until_it_hosts() -> None:
    """The pod that hosts the store falls silent: its successor (the lowest-ranked survivor)
    takes over seconds later. The lowest-indexed pods that answer are asked at most once a
    second until one says it hosts, not in their turn of the sweep (a status write each for
    storeHost: unknown, then the successor); then the sweep goes on."""
    pods = [pod(i, ip=f"10.0.0.{i}") for i in range(128)]
    survey, budget = agents.Survey(), agents.Budget(rate=1000.0, burst=20, now=0.0)
    said = {p.name: AgentAnswer(p.index, "running", 128, host=p.index == 0, gen=1) for p in pods}
    survey.record(said, pods, 0.0)
    assert [p.index for p in survey.pick(pods, budget, 0.5)][:1] == [0]  # the host first
    survey.record({"demo-worker-0": None}, pods, 1.0)  # silent
    first = survey.pick(pods, budget, 2.0)
    assert [p.index for p in first[:16]] == list(range(1, 17))
    not_yet = {f"demo-worker-{i}": said[f"demo-worker-{i}"] for i in range(1, 17)}
    survey.record(not_yet, pods, 2.0)
    assert not {p.index for p in survey.pick(pods, budget, 2.5)} & set(range(1, 17))
    again = survey.pick(pods, budget, 3.5)  # a second later: asked again (after pod 0, silent
    # at its first question 2.5 s ago: asked once more)
    assert [p.index for p in again[:17]] == list(range(17))
    took_over = AgentAnswer(1, "running", 127, host=True, gen=2)
    survey.record({**not_yet, "demo-worker-1": took_over}, pods, 3.5)
    after = survey.pick(pods, budget, 5.0)
    assert [p.index for p in after][:1] == [1]  # the new host, then the sweep
    assert not {p.index for p in after} & set(range(2, 17))


def test_kept_answers_are_forgotten_at_a_new_address_or_when_old() -> None:
    pods = (pod(0, ip="a"), pod(1, ip="b"))
    survey = agents.Survey()
    said = {p.name: AgentAnswer(p.index, "running", 2, host=False, gen=1) for p in pods}
    survey.record(said, pods, 0.0)
    assert set(survey.answers(pods, 1.0)) == {"demo-worker-0", "demo-worker-1"}
    moved = (pod(0, ip="a"), pod(1, ip="c"))  # pod 1 replaced
    assert set(survey.answers(moved, 1.0)) == {"demo-worker-0"}
    assert survey.answers(moved, agents.KEEP_SECONDS + 1.0) == {}


def test_the_world_is_the_newest_rounds_not_one_kept_from_before() -> None:
    """A node of 64 pods went: the pods asked since say 960 (round 8); those asked before
    still say 1,024 (round 7) until they are asked again."""
    pods = (pod(0, ip="a"), pod(1, ip="b"), pod(2, ip="c"))
    answers: dict[str, AgentAnswer | None] = {
        "demo-worker-0": AgentAnswer(0, "running", 960, host=True, gen=1, round=8),
        "demo-worker-1": AgentAnswer(1, "running", 1024, host=False, gen=1, round=7),
        "demo-worker-2": AgentAnswer(2, "running", 1024, host=False, gen=1, round=7),
    }
    seen = agents.apply(pods, answers)
    assert [p.world_size for p in seen] == [960, None, None]
    assert run(make_job(replicas=3), *seen).status.world_size == 960
    assert agents.parse_answer(b'{"phase": "running", "index": 1, "round": 8}') == AgentAnswer(
        1, "running", 0, host=False, gen=0, round=8
    )


def test_what_an_agent_says_is_the_record_dataclasses_replace_makes() -> None:
    """``agents.apply`` copies fields instead of calling ``dataclasses.replace`` (a thousand
    pods a pass): the same record, equal and hashed alike, and the original untouched."""
    original = pod(3, ip="10.0.0.3")
    told = _told(original, ready=False, world_size=7, store_host=True, store_gen=2)
    replaced = dataclasses.replace(
        original, ready=False, world_size=7, store_host=True, store_gen=2
    )
    assert told == replaced
    assert hash(told) == hash(replaced)
    assert original.world_size is None and original.ready
    assert _told(original, ready=original.ready) is original
