"""The operator's questions to the agents (``--ask-agents``): real sockets, a real agent
listener (:class:`ddpjob_worker.liveness.Listener`), and the status that follows."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator

import pytest

from ddpjob_operator import agents
from ddpjob_operator.agents import AgentAnswer
from ddpjob_operator.observe import PodPhase
from ddpjob_worker import liveness

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
