"""The hub and its members (``ddpjob_worker.membership.hub``, ``ddpjob_worker.membership.member``) on this process's
membership loop, over real loopback TCP, with real liveness sockets. No torch.

What must hold: a round forms once the members are in (ranks by pod index); a member whose agent
is gone (its connection closes, its port refuses) is cut at once; a silent one only after other
members could not hear it either; one a peer still hears is never cut; members lost together are
cut in one round change; a round never completes without a majority of the last one; a newcomer
ends the running round; a host that hands over, or whose hub is gone, is lost to its members.
"""

from __future__ import annotations

import dataclasses
import socket
import time
import uuid
from collections.abc import Iterator

import pytest

from ddpjob_worker.membership import liveness, member
from ddpjob_worker.membership.hub import Hub
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.member import Member, MemberView
from ddpjob_worker.membership.nodes import NodeIdent
from ddpjob_worker.membership.seal import Seal
from ddpjob_worker.membership.wire import Wire, run_on_loop

WIRE = Wire(Seal(b"the job's key"), "run")


class Pod:
    """A member with a liveness socket of its own, as an agent has."""

    def __init__(self, index: int, pid: int | None = None) -> None:
        self.index = index
        self.listener: liveness.Listener | None = liveness.Listener("127.0.0.1")
        self.silencer: socket.socket | None = None
        self.member = Member(
            WIRE,
            ident=NodeIdent(f"127.0.0.1_{pid or 1000 + index}"),
            index=index,
            liveness_address=self.listener.address,
        )

    @property
    def view(self) -> MemberView:
        return self.member.view

    def gone(self) -> None:
        """Its process dies: connection and liveness socket close (the port refuses)."""
        assert self.listener is not None
        self.listener.close()
        self.member.disconnect()

    def freeze(self) -> None:
        """Its process freezes: no heartbeat, and its liveness socket accepts (the kernel's
        backlog) but never answers."""
        assert self.listener is not None
        address = self.listener.address
        self.listener.close()
        host, _, port = address.rpartition(":")
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(16)
        self.silencer = sock
        run_on_loop(self.member._disconnect(), timeout=5)  # no more heartbeats, no goodbye

    def close(self) -> None:
        self.member.disconnect()
        if self.listener is not None:
            self.listener.close()
        if self.silencer is not None:
            self.silencer.close()


@pytest.fixture
def pods() -> Iterator[list[Pod]]:
    made: list[Pod] = []
    yield made
    for pod in made:
        pod.close()


def hub(**kwargs: object) -> tuple[Hub, str]:
    settings: dict[str, object] = {"gen": 1, "min_nodes": 1, "max_nodes": 64, "last_call": 0.3}
    settings.update(kwargs)
    made = Hub(WIRE, **settings)  # type: ignore[arg-type]
    address = run_on_loop(made.start("127.0.0.1"), timeout=5)
    return made, address


def start(pods: list[Pod], count: int, address: str, first: int = 0) -> list[Pod]:
    new = [Pod(first + i) for i in range(count)]
    pods.extend(new)
    for pod in new:
        pod.member.connect(address)
        pod.member.join()
    return new


def in_round(pods: list[Pod], world: int, timeout: float = 10.0) -> int:
    """Wait until every pod has a round of ``world``, the same one; its id."""
    for pod in pods:
        view = pod.member.wait(
            lambda v: v.round is not None and v.round.world == world and not v.ends, timeout
        )
        assert view.round is not None and view.round.world == world, (pod.index, view)
    ids = {pod.view.round.round for pod in pods if pod.view.round is not None}
    assert len(ids) == 1, ids
    return ids.pop()


def rejoin(pods: list[Pod], timeout: float = 10.0) -> None:
    """As the agents do once their round is over: join the next one."""
    for pod in pods:
        pod.member.wait(lambda v: bool(v.ends), timeout)
        pod.member.join()


def test_a_round_forms_with_ranks_by_pod_index(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=3, max_nodes=3)
    try:
        start(pods, 3, address)
        assert in_round(pods, 3) == 0
        assert [pod.view.round.rank for pod in pods if pod.view.round] == [0, 1, 2]
        chain = pods[0].view.round.chain if pods[0].view.round else ()
        assert [index for _, index, _ in chain] == [0, 1, 2]
        assert pods[0].view.round and pods[0].view.round.base is not None
    finally:
        run_on_loop(made.stop())


def test_the_round_carries_rank_0s_store_address_to_every_member(pods: list[Pod]) -> None:
    # Each agent says where its rank 0 worker would serve the workers' store; the round tells
    # everyone rank 0's, so nobody reads MASTER_ADDR/PORT from the store (2N requests a round).
    made, address = hub(min_nodes=3, max_nodes=3)
    try:
        new = [Pod(i) for i in (2, 0, 1)]
        pods.extend(new)
        for pod in new:
            pod.member.connect(address)
            pod.member.join(boot=(f"10.0.0.{pod.index}", 40000 + pod.index))
        in_round(pods, 3)
        assert {pod.view.round.boot for pod in pods if pod.view.round} == {("10.0.0.0", 40000)}
        # The next round's rank 0 joins without saying (an agent of a version that does not):
        # no address in the round, and the agents fall back to the store's exchange.
        pods[1].member.end("failure")
        rejoin(pods)
        in_round(pods, 3)
        assert {pod.view.round.boot for pod in pods if pod.view.round} == {None}
    finally:
        run_on_loop(made.stop())


def test_a_member_whose_agent_is_gone_is_cut_at_once(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=2)
    try:
        start(pods, 3, address)
        in_round(pods, 3)
        pods[2].gone()
        survivors = pods[:2]
        rejoin(survivors)
        assert in_round(survivors, 2, timeout=5) == 1
        assert all(pod.view.cut == set() for pod in survivors), "a new round: nothing cut yet"
        assert made.view.cuts == 1
    finally:
        run_on_loop(made.stop())


def test_a_silent_member_is_cut_when_nobody_hears_it(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=2)
    try:
        start(pods, 4, address)
        in_round(pods, 4)
        pods[3].freeze()
        survivors = pods[:3]
        for pod in survivors:
            view = pod.member.wait(lambda v: bool(v.ends), 10)
            assert view.cut == {pods[3].member.ident}, view
        rejoin(survivors)
        in_round(survivors, 3)
    finally:
        run_on_loop(made.stop())


def test_a_member_the_hub_cannot_hear_but_a_peer_can_is_kept(pods: list[Pod]) -> None:
    """Its link to the hub is broken, its agent runs: one slow link is never a death."""
    made, address = hub(min_nodes=2)
    try:
        start(pods, 4, address)
        in_round(pods, 4)
        pods[3].member._tasks[1].cancel()  # its heartbeats stop; its agent answers its peers
        view = pods[0].member.wait(lambda v: bool(v.ends), 5.0)
        assert not view.ends, view
        assert made.view.cuts == 0
    finally:
        run_on_loop(made.stop())


def test_members_lost_together_are_one_round_change(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=4)
    try:
        start(pods, 8, address)
        in_round(pods, 8)
        before = pods[0].view.round
        for pod in pods[5:]:
            pod.freeze()
        survivors = pods[:5]  # still a majority of 8 (the silent ones count: a partition?)
        rejoin(survivors)
        in_round(survivors, 5)
        assert made.view.cuts == 1
        assert {pod.view.round.round for pod in survivors if pod.view.round} == {1}
        # Each survivor learns that members departed (the refund rule's evidence), not who.
        after = pods[0].view.round
        assert after is not None and before is not None
        assert (after.prev_id, after.left, after.departed(before)) == ("1.0", 3, True)
    finally:
        run_on_loop(made.stop())


def test_no_round_without_a_majority_of_the_last_one(pods: list[Pod]) -> None:
    base = {NodeIdent(f"127.0.0.1_{1000 + i}"): i for i in range(5)}
    made, address = hub(gen=2, min_nodes=1, base=base, base_id="1.4", expected=set(base))
    try:
        start(pods, 2, address)  # 2 of 5: maybe the cut-off side
        view = pods[0].member.wait(lambda v: v.round is not None, 2.0)
        assert view.round is None, "fenced"
        start(pods, 1, address, first=2)  # 3 of 5
        in_round(pods, 3)
    finally:
        run_on_loop(made.stop())


def test_a_healed_pod_whose_replacement_holds_its_index_is_told_so(pods: list[Pod]) -> None:
    # Pod 0 (1000) was cut off; its replacement (2000, same index) holds index 0 in the last
    # round. The old one heals and asks to join with the others: it is told it was replaced,
    # and the round forms with the replacement, whatever the order of the joins.
    new = NodeIdent("127.0.0.1_2000")
    base = {new: 0, NodeIdent("127.0.0.1_1001"): 1, NodeIdent("127.0.0.1_1002"): 2}
    made, address = hub(
        gen=2, min_nodes=3, max_nodes=3, base={**base}, base_id="2.1", expected=set(base)
    )
    try:
        healed = Pod(0)
        healed.member.history.rounds = 3  # it trained before it was cut off
        pods.append(healed)
        healed.member.connect(address)
        healed.member.join()
        start(pods, 2, address, first=1)
        replacement = Pod(0, pid=2000)
        replacement.member.history.rounds = 1  # it joined round 2.1
        pods.append(replacement)
        replacement.member.connect(address)
        replacement.member.join()
        view = healed.member.wait(lambda v: v.replaced, 10)
        assert view.replaced and view.round is None
        assert NodeIdent("127.0.0.1_1000") in made._replaced
        in_round([replacement, *pods[1:3]], 3)
        assert replacement.view.round is not None and replacement.view.round.rank == 0
        assert made.view.participants.keys() == {new, *list(base)[1:]}
    finally:
        run_on_loop(made.stop())


def test_a_new_pod_of_an_index_takes_it_from_the_last_round(pods: list[Pod]) -> None:
    # The other way round: the holder of index 1 in the last round (1001) and a pod the job
    # has never seen with index 1 (a replacement: the old pod object was deleted). The new pod
    # is in the next round; the old holder is told it was replaced.
    made, address = hub(min_nodes=3, max_nodes=3)
    try:
        start(pods, 3, address)
        assert in_round(pods, 3) == 0
        newcomer = Pod(1, pid=3001)
        pods.append(newcomer)
        newcomer.member.connect(address)
        newcomer.member.join()
        rejoin(pods[:3])
        assert pods[1].member.wait(lambda v: v.replaced, 10).replaced
        in_round([pods[0], newcomer, pods[2]], 3)
        assert set(made.view.participants) == {
            NodeIdent("127.0.0.1_1000"),
            NodeIdent("127.0.0.1_3001"),
            NodeIdent("127.0.0.1_1002"),
        }
    finally:
        run_on_loop(made.stop())


def test_a_newcomer_ends_the_running_round(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=2)
    try:
        start(pods, 2, address)
        assert in_round(pods, 2) == 0
        before = pods[0].view.round
        start(pods, 1, address, first=2)
        rejoin(pods[:2])
        assert pods[0].view.round is not None
        assert in_round(pods, 3) == 1
        # Nobody left: a failure of this change would be charged. The newcomer's first round
        # has nothing to compare with; one that was cut off and comes back sees a change.
        grown = pods[0].view.round
        assert grown is not None and grown.departed(before) is False
        assert pods[2].view.round is not None and pods[2].view.round.departed(None) is None
        assert grown.departed(dataclasses.replace(grown, base_id="1.7")) is True
    finally:
        run_on_loop(made.stop())


def test_a_host_that_hands_over_is_lost_to_its_members_at_once(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=2)
    try:
        start(pods, 3, address)
        in_round(pods, 3)
        pods[0].member.leave(handover=True)
        for pod in pods[1:]:
            view = pod.member.wait(lambda v: v.hub_lost is not None, 3)
            assert view.hub_lost is Health.GONE
    finally:
        run_on_loop(made.stop())


def test_a_hub_that_is_gone_is_lost_to_its_members(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=2)
    start(pods, 2, address)
    in_round(pods, 2)
    run_on_loop(made.stop())
    for pod in pods:
        view = pod.member.wait(lambda v: v.hub_lost is not None, 5)
        assert view.hub_lost is Health.GONE, view


def test_a_hub_that_stops_answering_is_silent_to_its_members_but_not_to_its_hosts(
    pods: list[Pod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The host's own member shares the hub's process and loop: the hub's silence is that
    process stalled, which must not make the host leave the job (at 1,024 hollow agents a
    starved successor did, and everyone failed over again)."""
    made, address = hub(min_nodes=2)
    try:
        start(pods, 2, address)
        pods[0].member.local = True
        in_round(pods, 2)
        monkeypatch.setattr(made, "_ack", lambda session: None)  # heard, never answered
        view = pods[1].member.wait(lambda v: v.hub_lost is not None, 5)
        assert view.hub_lost is Health.SILENT, view
        time.sleep(1.0)
        assert pods[0].view.hub_lost is None, pods[0].view
    finally:
        run_on_loop(made.stop())


def test_a_hub_forming_its_first_round_gets_three_silence_windows(
    pods: list[Pod], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hub forming its first round is asked by the whole job at once: its members wait
    three windows for an answer, not one, before they take it as lost."""
    made, address = hub(min_nodes=3)  # two members: no round forms
    try:
        start(pods, 2, address)
        pods[0].member.wait(lambda v: v.gen > 0, 5)
        monkeypatch.setattr(made, "_ack", lambda session: None)  # heard, never answered
        started = time.monotonic()
        time.sleep(liveness.SILENT_AFTER_SECONDS + 1.0)
        assert all(pod.view.hub_lost is None for pod in pods), [p.view for p in pods]
        view = pods[1].member.wait(lambda v: v.hub_lost is not None, 6)
        assert view.hub_lost is Health.SILENT, view
        assert time.monotonic() - started >= member.FIRST_ROUND_SILENT_SECONDS - 0.6
    finally:
        run_on_loop(made.stop())


def test_a_message_without_the_jobs_key_is_dropped(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=1)
    try:
        start(pods, 1, address)
        in_round(pods, 1)
        host, _, port = address.rpartition(":")
        with socket.create_connection((host, int(port))) as sock:
            forged = Wire(Seal(b"another key"), "run").encode({"t": "hello", "ident": "x"})
            sock.sendall(forged + Wire(Seal(None), "run").encode({"t": "close"}))
        assert made.view.connected == {pods[0].member.ident}
        view = pods[0].member.wait(lambda v: v.closed, 1.0)
        assert not view.closed
    finally:
        run_on_loop(made.stop())


def test_the_hub_answers_every_heartbeat_and_asks_nobody_else(pods: list[Pod]) -> None:
    """Steady state: per member, a heartbeat and its answer every half second; nothing else."""
    import time  # noqa: PLC0415

    made, address = hub(min_nodes=4)
    try:
        start(pods, 4, address)
        in_round(pods, 4)
        sent = [pod.member.sent for pod in pods]
        received = [pod.member.received for pod in pods]
        time.sleep(3.0)
        for pod, before, got in zip(pods, sent, received, strict=True):
            heartbeats, answers = pod.member.sent - before, pod.member.received - got
            # At most 2 a second (a loaded box sends fewer, never more), each answered once.
            assert 1 <= heartbeats <= 7, "2 heartbeats a second"
            assert heartbeats - 1 <= answers <= heartbeats + 1, "their answers, nothing more"
    finally:
        run_on_loop(made.stop())


def test_unique_run_ids_do_not_mix(pods: list[Pod]) -> None:
    other = Wire(Seal(b"the job's key"), uuid.uuid4().hex)
    assert WIRE.decode(other.encode({"t": "hb"})) is None


def test_a_members_view_rings_its_agent_when_it_changes_and_only_then(pods: list[Pod]) -> None:
    made, address = hub(min_nodes=2)
    try:
        rings: list[tuple[int, object]] = []
        first, second = start(pods, 2, address)
        in_round(pods, 2)
        first.member.on_change = lambda: rings.append((1, first.view.ends))
        second.member.on_change = lambda: rings.append((2, second.view.ends))
        second.gone()
        view = first.member.wait(lambda v: bool(v.ends), 10.0)
        assert view.ends
        # The round's end rang, once (acks that change nothing since do not).
        time.sleep(1.5)  # a heartbeat and its ack
        assert [who for who, _ in rings] == [1], rings
    finally:
        run_on_loop(made.stop())


def test_a_hang_verdict_ends_the_round_for_all_names_the_stuck_member_and_cuts_nobody(
    pods: list[Pod],
) -> None:
    made, address = hub(min_nodes=2, max_nodes=3)
    try:
        start(pods, 3, address)
        assert in_round(pods, 3) == 0
        stuck = pods[2].member.ident

        async def verdict() -> None:  # what the hub's watch calls (test_hubwatch drives it)
            made._hung(frozenset({stuck}))

        run_on_loop(verdict(), timeout=5)
        views = [pod.member.wait(lambda v: bool(v.ends), 5.0) for pod in pods]
        assert [view.ends for view in views] == [frozenset({"failure", "hung"})] * 3
        assert [view.hung for view in views] == [False, False, True]
        assert [view.cut for view in views] == [frozenset()] * 3
        rejoin(pods)
        # One round change, with all three: the stuck member's agent stops its worker and
        # comes back at once (cut, it came back after the next round had formed: two).
        assert in_round(pods, 3) == 1
        assert [pod.view.hung for pod in pods] == [False] * 3
    finally:
        run_on_loop(made.stop())
