"""Issue 23 on the real control plane: a pod that fails at once is re-created with growing
gaps, not in a tight loop, and the job fails only when its budget is spent.

The trainer is a real process in a real pod (the process kubelet's ``python`` image) that exits
1 as soon as it starts; the real API server stamps each pod's ``creationTimestamp``, and the
gaps between them are the evidence: at least the configured delay (3 s, then 6 s, then 12 s)
and growing. Both stamps have a resolution of one second, and the delay counts from the
trainer's ``finishedAt``, never before the pod's creation, so whole seconds hold. The upper
bounds are generous: a busy machine adds seconds to a start, never takes them away.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from pathlib import Path

import pytest

from tests.harness.kube.fixtures import KubeTest
from tests.harness.operator_env import real_env, wait_for

pytestmark = pytest.mark.slow

DELAYS = [3.0, 6.0, 12.0]
"""spec.podBackoff initialDelaySeconds 3, maxDelaySeconds 12: the waits after failures 1-3 (steps
of 3 s and 6 s, so that a slow start on a busy machine cannot hide the growth)."""


def stamp(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_a_pod_that_fails_at_once_comes_back_with_growing_gaps(
    kube: KubeTest, tmp_path: Path
) -> None:
    env = real_env(kube, tmp_path, fake_trainer=False)
    env.start_operator()
    env.create_job(
        "crashy",
        replicas=1,
        minReplicas=1,
        maxReplicas=1,
        backoffLimit=len(DELAYS),
        podBackoff={"initialDelaySeconds": 3, "maxDelaySeconds": 12, "resetAfterSeconds": 600},
        template={
            "spec": {
                "terminationGracePeriodSeconds": 5,
                "containers": [
                    {
                        "name": "trainer",
                        "image": "python",
                        "command": ["python3", "-c", "import sys; sys.exit(1)"],
                    }
                ],
            }
        },
    )
    created: dict[str, dt.datetime] = {}
    waits: list[dict[str, object]] = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for pod in env.pods("crashy"):
            meta = pod["metadata"]
            created.setdefault(meta["uid"], stamp(meta["creationTimestamp"]))
        status = env.status("crashy")
        waits += [w for w in status.get("waiting") or [] if w.get("reason") == "BackOff"]
        if status.get("phase") == "Failed":
            break
        time.sleep(0.1)
    assert status.get("phase") == "Failed", status
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded", failed
    # Every pod failed, each was charged once, and the budget (3) was spent by the fourth.
    assert (status["restarts"], status["backoffCount"]) == (4, 4), status
    assert [f["reason"] for f in status["failures"]] == ["ExitCode(1)"] * 4, status
    assert len(created) == 4, created
    times = sorted(created.values())
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
    print(f"gaps between the pods' creation timestamps: {gaps}")  # shown with -s
    for gap, delay in zip(gaps, DELAYS, strict=True):
        assert delay <= gap < delay + 20, (gaps, DELAYS)  # each at least its growing delay
    # status.waiting said who waits and until when, while it waited.
    assert {(w["pod"], w["index"]) for w in waits} == {("crashy-worker-0", 0)}, waits
    assert all(w.get("retryTime") for w in waits), waits
    # One BackOff event per back-off (three), however many passes each lasted.
    backoffs = wait_for(
        lambda: len(found := env.events(reason="BackOff")) >= 3 and found, "3 BackOff events"
    )
    messages = sorted(str(e["message"]) for e in backoffs)
    assert len(messages) == 3, messages
    assert sum(e.get("count", 1) for e in backoffs) == 3, backoffs
    for delay in DELAYS:
        assert sum(f"back-off {delay:g}s after" in m for m in messages) == 1, messages
    assert status.get("podBackoff") == [], status
