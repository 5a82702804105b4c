"""The scale benchmark's hollow agents (``tests.harness.hollow_agents``, ``bench/bench_membership.py``), small:
the same agent as a pod's, many to a process, with stand-in workers. A job of 6 forms one round
of all, which stands while nothing happens (a harness whose stand-in collectives broke each new
round re-formed rounds forever), and one whose process is killed is cut: the 5 others carry on
in one round of 5, one round change."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from tests.harness.hollow_agents import Job

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not Path("/proc/net/snmp").exists(), reason="needs Linux")
def test_a_hollow_job_forms_and_cuts_a_killed_agent(tmp_path: Path) -> None:
    job = Job("ddpjob", 6, per_process=3, singles=[5], node=[], log_dir=tmp_path)
    try:
        first = job.wait(list(range(6)), 6, 0.0, 180)
        assert first is not None, job.logs()
        time.sleep(3.0)
        assert job.rounds_after(list(range(6)), first[0]) == {first[1]}, job.logs()
        at = time.time()
        job.signal(job.proc_of(5), signal.SIGKILL)
        found = job.wait(list(range(5)), 5, at, 60)
        assert found is not None, job.logs()
        time.sleep(1.0)
        assert job.rounds_after(list(range(5)), at) == {found[1]}, job.logs()
        assert not {i: e for i, e in job.exits.items() if i != 5 and e}, job.logs()
    finally:
        job.close()
