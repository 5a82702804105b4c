"""The state file, the readiness probe and the endpoint waiter: no torch, no real network."""

from __future__ import annotations

import json
import pkgutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import ddpjob_worker
from ddpjob_worker.agent import probe
from ddpjob_worker.agent.endpoint import is_local_address, wait_for_endpoint, wait_resolves_here
from ddpjob_worker.contract import EXIT_INFRA, is_retryable_exit
from ddpjob_worker.errors import EndpointUnreachableError
from ddpjob_worker.state import (
    AgentState,
    Failure,
    Phase,
    StateWriter,
    is_ready,
    read_state,
    write_state,
)

failures = st.none() | st.builds(
    Failure,
    reason=st.text(max_size=30),
    exit_code=st.none() | st.integers(-64, 255),
    rank=st.none() | st.integers(0, 64),
    at=st.floats(0, 2e9),
)
states = st.builds(
    AgentState,
    phase=st.sampled_from(Phase),
    pid=st.integers(1, 2**22),
    updated_at=st.floats(0, 2e9),
    rdzv_round=st.integers(0, 100),
    world_size=st.none() | st.integers(1, 1024),
    node_rank=st.none() | st.integers(0, 128),
    restart_count=st.integers(0, 10),
    membership_restarts=st.integers(0, 10),
    last_failure=failures,
)


@given(states)
def test_state_round_trips_through_json(state: AgentState) -> None:
    assert AgentState.from_json(state.to_json()) == state


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[]", "must be a JSON object"),
        ("{", "not JSON"),
        ('{"pid": 1, "updated_at": 0}', "no 'phase'"),
        ('{"phase": "dancing", "pid": 1, "updated_at": 0}', "unknown phase 'dancing'"),
        ('{"phase": "running", "pid": 1, "updated_at": 0, "colour": 1}', "unknown fields"),
        ('{"phase": "running"}', "incomplete"),
    ],
)
def test_from_json_names_the_problem(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AgentState.from_json(text)


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "state.json"
    write_state(path, AgentState(phase=Phase.RUNNING, pid=1, updated_at=5.0))
    write_state(path, AgentState(phase=Phase.STOPPED, pid=1, updated_at=6.0))
    assert read_state(path).phase is Phase.STOPPED
    assert [p.name for p in path.parent.iterdir()] == ["state.json"]


def test_writer_updates_the_file_and_survives_an_unwritable_path(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    writer = StateWriter(str(path), max_restarts=3, pid=42)
    writer.update(phase=Phase.RUNNING, world_size=4)
    assert json.loads(path.read_text())["world_size"] == 4
    blocked = tmp_path / "file"
    blocked.write_text("")
    broken = StateWriter(str(blocked / "s.json"))
    assert broken.update(phase=Phase.RUNNING).phase is Phase.RUNNING


@pytest.mark.parametrize(
    ("phase", "age", "ready"),
    [
        (Phase.RUNNING, 1.0, True),
        (Phase.RUNNING, 31.0, False),
        (Phase.RECOVERING, 1.0, False),
        (Phase.SUCCEEDED, 0.0, False),
    ],
)
def test_is_ready(phase: Phase, age: float, ready: bool) -> None:
    state = AgentState(phase=phase, pid=1, updated_at=100.0)
    assert is_ready(state, max_age=30.0, now=100.0 + age) is ready


def test_probe_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "s.json"
    assert probe.main(["--state-file", str(path)]) == probe.EXIT_NO_STATE
    writer = StateWriter(str(path))
    writer.update(phase=Phase.RENDEZVOUS)
    assert probe.main(["--state-file", str(path)]) == probe.EXIT_NOT_READY
    writer.update(phase=Phase.RUNNING)
    assert probe.main(["--state-file", str(path)]) == probe.EXIT_READY
    assert probe.main(["--state-file", str(path), "--max-age", "-1"]) == probe.EXIT_NOT_READY
    assert "ready: phase=running" in capsys.readouterr().out


def test_light_paths_never_import_torch(tmp_path: Path) -> None:
    """``import ddpjob_worker`` and the probe must stay cheap: no torch."""
    code = (
        "import sys, ddpjob_worker, ddpjob_worker.agent.probe, ddpjob_worker.state, "
        "ddpjob_worker.agent.policy, ddpjob_worker.agent.endpoint\n"
        "from ddpjob_worker.agent.cli import main\n"
        f"rc = main(['--probe', '--state-file', {str(tmp_path / 'none.json')!r}])\n"
        "assert rc == 3, rc\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_wait_for_endpoint_retries_with_backoff_until_it_connects() -> None:
    fake = FakeTime()
    answers = iter(["DNS lookup of 'pod-0' failed", "TCP connect failed", None])
    probe_result = wait_for_endpoint(
        "pod-0",
        29400,
        10,
        connect=lambda h, p, t: next(answers),
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert probe_result.attempts == 3
    assert fake.sleeps == pytest.approx([0.05, 0.1])


def test_the_store_host_waits_until_its_name_resolves_to_itself() -> None:
    # A resumed job's new pod 0 hosts the store, and torch's client of it connects by the
    # endpoint's name: that name resolves only once the EndpointSlice controller has published
    # the new pod (CI saw pod 0 exit 200 on it, charged to the job). First no record, then the
    # address of the pod it replaces, then its own.
    fake = FakeTime()
    answers: list[list[str] | None] = [None, ["10.0.0.7"], ["10.0.0.9"]]
    seen: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        assert (host, port) == ("job-worker-0.job.ns.svc", 29400)
        answer = answers.pop(0)
        if answer is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return answer

    probe = wait_resolves_here(
        "job-worker-0.job.ns.svc",
        29400,
        30,
        resolver=resolver,
        local=lambda address: address == "10.0.0.9",
        clock=fake.clock,
        sleep=fake.sleep,
        on_retry=lambda p: seen.append(p.last_error),
    )
    assert probe.attempts == 3
    assert seen == [
        "DNS lookup of 'job-worker-0.job.ns.svc' failed: Name or service not known",
        "'job-worker-0.job.ns.svc' resolves to 10.0.0.7, not to this pod",
    ]
    assert fake.sleeps == pytest.approx([0.1, 0.2])


def test_the_store_host_gives_up_when_its_name_never_names_it() -> None:
    fake = FakeTime()
    with pytest.raises(EndpointUnreachableError) as info:
        wait_resolves_here(
            "job-worker-0.job.ns.svc",
            29400,
            5,
            resolver=lambda host, port: ["10.0.0.7"],
            local=lambda address: False,
            clock=fake.clock,
            sleep=fake.sleep,
            join_timeout=600,
        )
    message = str(info.value)
    assert "hosts the rendezvous store at job-worker-0.job.ns.svc:29400" in message
    assert "within 5.0s (join timeout 600s)" in message
    assert "last: 'job-worker-0.job.ns.svc' resolves to 10.0.0.7, not to this pod" in message
    assert info.value.exit_code == EXIT_INFRA


def test_local_addresses_are_the_ones_a_socket_binds() -> None:
    assert is_local_address("127.0.0.1")
    assert is_local_address("127.0.0.2")  # all of 127/8 is the loopback's
    assert not is_local_address("192.0.2.1")  # TEST-NET-1: never assigned, nothing sent


def test_wait_for_endpoint_gives_up_at_the_deadline_naming_what_it_tried() -> None:
    fake = FakeTime()
    with pytest.raises(EndpointUnreachableError) as info:
        wait_for_endpoint(
            "pod-0.svc",
            29400,
            5,
            connect=lambda h, p, t: "DNS lookup of 'pod-0.svc' failed",
            clock=fake.clock,
            sleep=fake.sleep,
            join_timeout=600,
        )
    message = str(info.value)
    assert "pod-0.svc:29400 is unreachable" in message
    assert "over 5.0s (join timeout 600s)" in message
    assert "last error: DNS lookup of 'pod-0.svc' failed" in message
    assert fake.now == pytest.approx(5.0)
    # Retryable under restartPolicy: ExitCode (it was 69, which ExitCode reads as permanent).
    assert info.value.exit_code == EXIT_INFRA
    assert is_retryable_exit(info.value.exit_code)


TORCH_SIDE = {
    "ddpjob_worker.agent.elastic",
    "ddpjob_worker.agent.judge",
    "ddpjob_worker.agent.launch",
    "ddpjob_worker.agent.storelink",
    "ddpjob_worker.agent.rendezvous",
    "ddpjob_worker.agent.hubrdzv",
    "ddpjob_worker.agent.workers",
    "ddpjob_worker.train.trainstate",
    "ddpjob_worker.train.commit",
    "ddpjob_worker.train.restore",
    "ddpjob_worker.train.payload",
    "ddpjob_worker.train.phases",
    "ddpjob_worker.train.flat",
    "ddpjob_worker.train.snapwriter",
}
"""The worker's modules that import torch: the agent on torch's subclass, its launch, the store
link, the rendezvous adapters and the worker processes; the training state and its snapshot
buffer, its commits, restore, payload and progress marks. Every other module, the membership core and the shared base among them, imports without
it (one job of 1,024 pods runs many agents' membership cores to a process, with no torch)."""


def _worker_modules() -> set[str]:
    return {
        info.name
        for info in pkgutil.walk_packages(ddpjob_worker.__path__, "ddpjob_worker.")
        if not info.ispkg
    }


def test_every_module_but_the_torch_side_imports_without_torch() -> None:
    """Each module of ``ddpjob_worker`` but :data:`TORCH_SIDE` imports in a fresh interpreter
    without torch, and so does each package; a new module is covered without a list to edit."""
    code = (
        "import json, pkgutil, subprocess, sys, ddpjob_worker\n"
        "light = []\n"
        "for info in pkgutil.walk_packages(ddpjob_worker.__path__, 'ddpjob_worker.'):\n"
        "    check = f'import sys, {info.name}; sys.exit(\"torch\" in sys.modules)'\n"
        "    if subprocess.run([sys.executable, '-c', check]).returncode == 0:\n"
        "        light.append(info.name)\n"
        "print(json.dumps(light))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code], check=True, timeout=600, capture_output=True, text=True
    )
    light = set(json.loads(run.stdout))
    modules = _worker_modules()
    assert modules >= TORCH_SIDE, sorted(TORCH_SIDE - modules)
    packages = {"ddpjob_worker.agent", "ddpjob_worker.membership", "ddpjob_worker.train"}
    assert light == (modules - TORCH_SIDE) | packages, sorted(light ^ (modules - TORCH_SIDE))
    membership = {m for m in modules if m.startswith("ddpjob_worker.membership.")}
    assert len(membership) >= 12
    assert membership <= light
