"""The hub's suspicions, as pure functions: who observes a suspect, what answers mean, and
when the lost are cut (together)."""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import zlib

from ddpjob_worker.membership.liveness import CONFIRM_AFTER_SECONDS, PROBE_TIMEOUT_SECONDS, Health
from ddpjob_worker.membership.nodes import NodeIdent
from ddpjob_worker.membership.suspicion import (
    BATCH_SECONDS,
    OBSERVERS,
    PROBE_SECONDS,
    SILENT_AFTER_SECONDS,
    Suspicion,
    after_stall,
    judge,
    observers,
    observers_among,
    verdict,
)


def idents(n: int) -> list[NodeIdent]:
    return [NodeIdent(f"node-{i:04d}") for i in range(n)]


def test_observers_are_others_spread_over_the_members_and_stable() -> None:
    members = idents(64)
    target = members[5]
    chosen = observers(target, members)
    assert len(chosen) == OBSERVERS
    assert target not in chosen
    assert chosen == observers(target, list(reversed(members)))  # order of the input: no matter
    positions = sorted(members.index(m) for m in chosen)
    # Spread a third of the ring apart, not the target's neighbours in a row.
    gaps = [b - a for a, b in itertools.pairwise(positions)]
    assert all(gap >= 64 // OBSERVERS - 1 for gap in gaps), positions


def test_observers_with_few_or_no_others() -> None:
    a, b = idents(2)
    assert observers(a, [a]) == []
    assert observers(a, [a, b]) == [b]
    assert observers(a, []) == []


def test_observers_from_a_list_sorted_once_are_the_same_choice() -> None:
    """The hub sorts its members once per tick and picks each suspect's observers from that
    list, the suspect in it or not: the same members as from the suspect's own list of the
    others (spelled out here as the rule was first written)."""
    rng = random.Random(7)
    for _ in range(300):
        members = sorted(set(rng.sample(idents(200), rng.randint(0, 40))))
        target = rng.choice(idents(200))
        others = [m for m in members if m != target]
        expected = (
            sorted(
                {
                    others[
                        (
                            zlib.crc32(target.encode()) % len(others)
                            + k * max(1, len(others) // OBSERVERS)
                        )
                        % len(others)
                    ]
                    for k in range(OBSERVERS)
                }
            )
            if others
            else []
        )
        assert observers_among(target, members) == expected
        assert observers(target, reversed(members)) == expected


def test_a_quiet_suspect_one_observer_hears_is_kept() -> None:
    case = Suspicion.quiet(now=10.0)
    case.asked = {NodeIdent("x"), NodeIdent("y"), NodeIdent("z")}
    case.answers = [Health.SILENT, Health.ALIVE]
    assert verdict(case, 10.1) is Health.ALIVE


def test_a_quiet_suspect_nobody_hears_is_silent_once_all_answered_or_time_is_up() -> None:
    case = Suspicion.quiet(now=10.0)
    case.asked = {NodeIdent("x"), NodeIdent("y")}
    case.answers = [Health.SILENT]
    assert verdict(case, 10.1) is None  # one answer still out
    case.answers.append(Health.UNKNOWN)
    assert verdict(case, 10.1) is Health.SILENT
    late = Suspicion.quiet(now=10.0)
    late.asked = {NodeIdent("x")}
    assert verdict(late, 10.0 + PROBE_SECONDS - 0.01) is None
    assert verdict(late, 10.0 + PROBE_SECONDS) is Health.SILENT


def test_refused_twice_is_gone_whatever_else_was_said() -> None:
    for case in (Suspicion.quiet(now=0.0), Suspicion.closed(now=0.0)):
        case.answers = [Health.ALIVE, Health.GONE]
        assert verdict(case, 0.0) is Health.GONE


def test_a_closed_connection_whose_agent_answers_waits_the_silence_window() -> None:
    case = Suspicion.closed(now=0.0)
    case.answers = [Health.ALIVE]
    assert verdict(case, SILENT_AFTER_SECONDS - 0.01) is None  # it may say hello again
    assert verdict(case, SILENT_AFTER_SECONDS) is Health.SILENT


def test_a_closed_connection_with_no_answer_is_silent_at_its_deadline() -> None:
    case = Suspicion.closed(now=0.0)
    assert verdict(case, case.deadline - 0.01) is None
    assert verdict(case, case.deadline) is Health.SILENT


def test_a_closed_connection_waits_for_its_own_probe_to_time_out() -> None:
    # The hub's probe is slow on a loaded node (CI saw a pod killed whole cut as silent
    # 0.7 s after its connection closed, before the refused connect was confirmed).
    case = Suspicion.closed(now=0.0)
    later = PROBE_TIMEOUT_SECONDS + CONFIRM_AFTER_SECONDS
    assert verdict(case, later) is None
    case.answers.append(Health.GONE)
    assert verdict(case, later) is Health.GONE
    unknown = Suspicion.closed(now=0.0)
    unknown.answers.append(Health.UNKNOWN)  # its probe timed out: no need to wait longer
    assert verdict(unknown, 0.01) is Health.SILENT


def test_confirmed_losses_wait_for_the_others_probes_then_are_cut_together() -> None:
    a, b, c = idents(3)
    gone = Suspicion.closed(now=0.0)
    gone.answers = [Health.GONE]
    probing = Suspicion.quiet(now=0.1)
    probing.asked = {c}
    suspects = {a: gone, b: probing}
    first = judge(suspects, now=0.2)
    assert (first.cleared, dict(first.cut)) == (frozenset(), {})
    assert gone.verdict is Health.GONE  # recorded once, kept while it waits
    probing.answers = [Health.SILENT]
    both = judge(suspects, now=0.3)
    assert dict(both.cut) == {a: Health.GONE, b: Health.SILENT}


def test_a_batch_waits_at_most_batch_seconds() -> None:
    a, b, c = idents(3)
    gone = Suspicion.closed(now=0.0)
    gone.answers = [Health.GONE]
    slow = Suspicion.quiet(now=0.0)
    slow.asked = {c}
    slow.deadline = 100.0  # its observers never answer
    suspects = {a: gone, b: slow}
    assert dict(judge(suspects, now=BATCH_SECONDS - 0.01).cut) == {}
    assert dict(judge(suspects, now=BATCH_SECONDS).cut) == {a: Health.GONE}


def test_a_suspect_heard_after_all_is_cleared_and_does_not_hold_back_a_cut() -> None:
    a, b, c = idents(3)
    gone = Suspicion.closed(now=0.0)
    gone.answers = [Health.GONE]
    heard = Suspicion.quiet(now=0.0)
    heard.asked = {c}
    heard.answers = [Health.ALIVE]
    judgement = judge({a: gone, b: heard}, now=0.1)
    assert judgement.cleared == frozenset({b})
    assert dict(judgement.cut) == {a: Health.GONE}


def test_the_suspicion_module_imports_without_torch() -> None:
    code = "import sys, ddpjob_worker.membership.suspicion; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_after_its_own_stall_the_hub_drops_open_quiet_cases_and_keeps_the_evidence() -> None:
    quiet, loud, decided = idents(3)
    open_quiet = Suspicion.quiet(now=0.0)
    open_quiet.asked = {NodeIdent("observer")}
    open_loud = Suspicion.closed(now=0.0)
    open_loud.answers = [Health.ALIVE]
    settled = Suspicion.quiet(now=0.0)
    settled.verdict = Health.SILENT
    cases = {quiet: open_quiet, loud: open_loud, decided: settled}
    # The loop did not run for 3 s: every deadline passed while nobody listened.
    left = after_stall(cases, stalled=3.0)
    assert set(left) == {loud, decided}
    assert left[decided].verdict is Health.SILENT
    # The loud case's clock moved on by the stall: its silence window starts again.
    assert verdict(left[loud], now=3.1) is None
    assert verdict(left[loud], now=3.0 + SILENT_AFTER_SECONDS) is Health.SILENT
    # Before: the same cases at the same moment would have been cut.
    assert verdict(Suspicion.quiet(now=0.0), now=3.1) is Health.SILENT
