"""The hub's watch over its members, driven by hand: a clock, sessions as plain records, the
messages it sends and the cuts it asks for recorded."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ddpjob_worker.hang import FLOOR_SECONDS
from ddpjob_worker.membership.hubwatch import STALL_SECONDS, HubWatch
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeIdent
from ddpjob_worker.membership.suspicion import OBSERVERS, PROBE_SECONDS, SILENT_AFTER_SECONDS
from ddpjob_worker.membership.wire import Message
from ddpjob_worker.progress import Phase, Progress


@dataclasses.dataclass
class Session:
    liveness: str | None
    closed: bool = False
    left: bool = False
    progress: tuple[int, list[Progress]] | None = None


class Rig:
    def __init__(self, n: int) -> None:
        self.now = 100.0
        self.idents = [NodeIdent(f"node-{i:02d}") for i in range(n)]
        self.peers = {
            ident: Session(f"127.0.0.1:{9000 + i}") for i, ident in enumerate(self.idents)
        }
        self.sent: list[tuple[NodeIdent, Message]] = []
        self.cuts: list[dict[NodeIdent, Health]] = []
        self.hangs: list[frozenset[NodeIdent]] = []
        self.watch = HubWatch(
            self.peers,
            send=lambda ident, message: self.sent.append((ident, message)),
            cut=self.cut,
            hung=self.hangs.append,
            probe=lambda address: Health.ALIVE,
            clock=lambda: self.now,
        )
        for ident in self.idents:
            self.watch.greeted(ident)

    def cut(self, lost: Mapping[NodeIdent, Health]) -> None:
        self.cuts.append(dict(lost))
        for ident in lost:
            self.watch.forget(ident)

    def advance(
        self,
        seconds: float,
        *,
        quiet: frozenset[NodeIdent] = frozenset(),
        running: tuple[str, int] | None = None,
    ) -> None:
        """Time passes in ticks; every member but ``quiet`` speaks at each. ``running``: the
        round that runs (its id and number), None while one forms."""
        end = self.now + seconds
        while self.now < end:
            self.now = round(self.now + 0.1, 6)
            for ident in self.idents:
                if ident not in quiet and ident in self.peers:
                    self.watch.heard(ident)
            self.watch.tick(self.idents, running)


def test_a_quiet_member_is_probed_by_others_and_cut_once_they_all_answer_silent() -> None:
    rig = Rig(8)
    frozen = rig.idents[3]
    rig.advance(SILENT_AFTER_SECONDS + 0.2, quiet=frozenset({frozen}))
    assert frozen in rig.watch
    probes = [(to, m) for to, m in rig.sent if m["t"] == "probe"]
    assert len(probes) == OBSERVERS
    assert {m["target"] for _, m in probes} == {rig.peers[frozen].liveness}
    assert frozen not in {to for to, _ in probes}
    assert rig.cuts == []  # not on the hub's word alone
    for _, message in probes:
        rig.watch.probed({"t": "probed", "req": message["req"], "health": "silent"})
    rig.advance(0.1, quiet=frozenset({frozen}))
    assert rig.cuts == [{frozen: Health.SILENT}]
    assert frozen not in rig.watch


def test_one_observer_hearing_it_keeps_a_quiet_member_in() -> None:
    rig = Rig(8)
    slow = rig.idents[0]
    rig.advance(SILENT_AFTER_SECONDS + 0.2, quiet=frozenset({slow}))
    first = next(m for _, m in rig.sent if m["t"] == "probe")
    rig.watch.probed({"t": "probed", "req": first["req"], "health": "alive"})
    rig.advance(PROBE_SECONDS + 0.2, quiet=frozenset({slow}))  # past the deadline, still quiet
    assert rig.cuts == []
    assert slow not in rig.watch


def test_a_quiet_member_whose_probes_time_out_is_cut_at_the_deadline() -> None:
    rig = Rig(8)
    frozen = rig.idents[6]
    rig.advance(SILENT_AFTER_SECONDS + 0.2, quiet=frozenset({frozen}))
    assert frozen in rig.watch  # asked, no answer yet
    rig.advance(PROBE_SECONDS + 0.2, quiet=frozenset({frozen}))
    assert rig.cuts == [{frozen: Health.SILENT}]


def test_after_its_own_stall_the_watch_judges_nobody_for_that_time() -> None:
    rig = Rig(4)
    rig.advance(0.5)
    rig.now += SILENT_AFTER_SECONDS + STALL_SECONDS + 3  # the hub's loop did not run
    rig.watch.tick(rig.idents, None)
    assert not any(ident in rig.watch for ident in rig.idents)
    assert [m for _, m in rig.sent if m["t"] == "probe"] == []
    rig.advance(1.0)
    assert rig.cuts == []


def test_a_member_that_left_is_never_suspected() -> None:
    rig = Rig(4)
    leaver = rig.idents[2]
    rig.peers[leaver].left = True
    rig.advance(SILENT_AFTER_SECONDS + PROBE_SECONDS + 1, quiet=frozenset({leaver}))
    assert leaver not in rig.watch
    assert rig.cuts == []


def test_questions_nobody_answered_are_forgotten_once_their_case_is_closed() -> None:
    """A quiet member speaks again before any observer answered: its case closes, and the
    questions about it do not stay in the hub for the rest of the job."""
    rig = Rig(8)
    for ident in rig.idents[:4]:  # one after another, each back before anyone answers
        rig.advance(SILENT_AFTER_SECONDS + 0.2, quiet=frozenset({ident}))
        assert ident in rig.watch
        rig.advance(0.2)
        assert ident not in rig.watch
    assert len([m for _, m in rig.sent if m["t"] == "probe"]) == 4 * OBSERVERS
    assert rig.watch._probes == {}
    assert rig.cuts == []


def test_a_member_whose_worker_holds_the_round_up_is_named_hung_not_cut() -> None:
    # Three of four workers wait in step 7's all-reduce; node-02's has computed step 7 since.
    # Its agent speaks all along: the round ends with it named, and nobody is cut.
    rig = Rig(4)
    since = rig.now
    for ident in rig.idents:
        phase = Phase.COMPUTE if ident == rig.idents[2] else Phase.COLLECTIVE
        rig.peers[ident].progress = (3, [Progress(7, phase, since, 0.5)])
    rig.advance(FLOOR_SECONDS - 0.5, running=("1.3", 3))
    assert rig.hangs == []  # the threshold (its floor: the steps are short) is not past
    rig.advance(1.0, running=("1.3", 3))
    assert rig.hangs[0] == frozenset({rig.idents[2]})
    assert rig.cuts == []
    assert not [m for _, m in rig.sent if m["t"] == "probe"]  # its agent was never quiet
