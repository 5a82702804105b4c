"""The restore's choice of its source (:func:`ddpjob_worker.train.restore.choose`): pure."""

from __future__ import annotations

import pytest

from ddpjob_worker.train.restore import Choice, Newest, choose


def test_no_rank_holds_a_snapshot() -> None:
    assert choose([None, None, None]) is None
    assert choose([]) is None


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        # the highest step wins, wherever it is
        (
            [Newest(7, 0, 11), Newest(9, 0, 22), None],
            Choice(source=1, step=9, have=(False, True, False)),
        ),
        # ties go to the lowest rank; ranks with the same step and bytes keep their own copy
        (
            [Newest(9, 1, 22), Newest(9, 0, 22), Newest(8, 0, 5)],
            Choice(source=0, step=9, have=(True, True, False)),
        ),
        # the same step with other bytes is not the source's: it receives them
        (
            [Newest(9, 0, 22), Newest(9, 0, 23)],
            Choice(source=0, step=9, have=(True, False)),
        ),
        # the generation does not decide (it is per node; a scale-up does not change it)
        (
            [Newest(5, 3, 1), Newest(6, 0, 2)],
            Choice(source=1, step=6, have=(False, True)),
        ),
    ],
)
def test_the_source_is_the_highest_step_then_the_lowest_rank(
    held: list[Newest | None], expected: Choice
) -> None:
    assert choose(held) == expected
