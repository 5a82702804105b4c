"""The operator-health check every operator test ends with (``tests.harness.kube.fixtures``): what in
an operator's log, and in its exit, counts as the operator going wrong."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.kube.fixtures import OperatorRun, operator_log_problems


def record(message: str, severity: str = "info", **extra: object) -> str:
    return json.dumps({"message": message, "severity": severity, **extra})


JOB = {"apiVersion": "ddpjob.io/v1alpha1", "kind": "DDPJob", "name": "a", "namespace": "ns"}
NORMAL = [
    record("Activity 'startup' succeeded."),
    record("Handler 'job_changed' succeeded.", object=JOB),
    record("phase Pending; actions: create a-worker-0; events: CreatedPods", object=JOB),
    record("ignoring fields this operator does not know (...): spec.x", "warn", object=JOB),
    record("released pod a-worker-1, which no job counts", "warn"),
    record("Signal SIGTERM is received. Operator is stopping."),
    record("Daemon 'job_loop' succeeded.", object=JOB),
    record("Activity 'cleanup' succeeded."),
]
TRACE = "Traceback (most recent call last):\n  File \"x.py\", line 1\nKeyError: 'x'"


@pytest.mark.parametrize(
    ("line", "found"),
    [
        (record("Handler 'job_changed' failed with an exception", "error", exc_info=TRACE),
         "error: Handler 'job_changed' failed with an exception\n" + TRACE),
        (record("invalid DDPJob: spec.replicas", "error", object=JOB),
         "error: invalid DDPJob: spec.replicas [DDPJob ns/a]"),
        (record("Daemon 'job_loop' is cancelled. Will escalate.", "warn"),
         "warn: Daemon 'job_loop' is cancelled. Will escalate."),
        (record("reconcile failed (500 boom); retrying in 1s", "warn", object=JOB),
         "warn: reconcile failed (500 boom); retrying in 1s [DDPJob ns/a]"),
        (TRACE, "output that is no log record:\n" + TRACE),
    ],
)  # fmt: skip
def test_a_json_log_problem_is_found_among_a_normal_runs_lines(line: str, found: str) -> None:
    assert operator_log_problems("\n".join(NORMAL)) == []
    assert operator_log_problems("\n".join([*NORMAL[:3], line, *NORMAL[3:]])) == [found]


def test_a_plain_log_gives_its_failure_lines_and_tracebacks() -> None:
    plain = [
        "Handler 'job_changed' succeeded.",
        "reconcile failed (403 Forbidden: no); retrying in 1s",
        "Handler 'pod_changed' failed temporarily: x",
        "something went wrong",
        TRACE,
        "Daemon 'job_loop' succeeded.",
    ]
    assert operator_log_problems("\n".join(plain)) == [
        "reconcile failed (403 Forbidden: no); retrying in 1s",
        "Handler 'pod_changed' failed temporarily: x",
        "something went wrong\n" + TRACE,
    ]


def run(tmp_path: Path, code: str, up: bool = True) -> OperatorRun:
    """A process standing in for the operator (once it has said it is up, with ``up``)."""
    log = tmp_path / "operator.log"
    log.write_text("\n".join(NORMAL) + "\n")
    if up:
        code += "; print('up', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None
    assert not up or process.stdout.readline() == "up\n"
    return OperatorRun(process, log)  # type: ignore[arg-type]


ON_SIGTERM = "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit({}))"


def test_a_stop_must_be_clean_and_an_exit_by_itself_is_reported(tmp_path: Path) -> None:
    clean = run(tmp_path, ON_SIGTERM.format(0))
    assert clean.stop() == []
    [problem] = run(tmp_path, ON_SIGTERM.format(4)).stop()
    assert problem.startswith(f"the operator of {tmp_path}/operator.log: exited 4 on SIGTERM")
    killed = run(tmp_path, "import time")
    killed.stopped_by_test = True
    killed.process.kill()
    killed.process.wait(timeout=30)
    assert killed.stop() == []  # the test's own doing
    exits = run(tmp_path, "import sys; sys.exit(3)", up=False)
    exits.process.wait(timeout=30)
    assert exits.stop() == [
        f"the operator of {tmp_path}/operator.log: exited by itself with code 3"
    ]
    exits.expected.append("exited by itself with code 3$")
    assert exits.stop() == []
