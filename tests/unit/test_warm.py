"""Warm workers (ddpjob_worker.agent.warm): real spare processes, handed real scripts."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob_worker import contract
from ddpjob_worker.agent import cli, warm
from ddpjob_worker.agent.memory import Memory
from ddpjob_worker.agent.policy import resolve_settings
from ddpjob_worker.agent.warm import WarmPool, foreign_changes, parse_command, start_spare

PY = sys.executable

REPORT = """
import json, os, sys
out = {
    "name": __name__,
    "file": __file__,
    "argv": sys.argv,
    "rank": os.environ.get("RANK"),
    "path0": sys.path[0],
    "stdin": sys.stdin.read(),
    "torch_loaded": "torch" in sys.modules,
}
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump(out, f)
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


@contextlib.contextmanager
def agent_stdin(path: Path | str) -> Iterator[None]:
    """This process's fd 0, which spares started meanwhile and cold workers inherit, reads
    ``path`` (pytest leaves it ``/dev/null``, or a terminal under ``-s``)."""
    saved = os.dup(0)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.dup2(fd, 0)
        yield
    finally:
        os.close(fd)
        os.dup2(saved, 0)
        os.close(saved)


@pytest.fixture(autouse=True)
def _no_terminal_stdin() -> Iterator[None]:
    """Workers read their stdin (REPORT): never the terminal of ``pytest -s``."""
    with agent_stdin(os.devnull):
        yield


@pytest.fixture
def pool() -> Iterator[WarmPool]:
    # Spares at the normal policy: handed over as soon as they start (the tests of the idle
    # policy, which waits for ready ones, come last).
    warm = WarmPool(1, preload=("json",), after_seconds=0, idle=False)
    yield warm
    warm.close()


def spare_of(warm: WarmPool) -> int:
    warm.tick()
    (pid,) = warm.idle
    return pid


def wait(proc: subprocess.Popen[bytes]) -> int:
    return proc.wait(timeout=30)


def test_torchruns_command_forms_are_recognised_and_nothing_else() -> None:
    assert parse_command([PY, "-u", "train.py", "--lr", "1"], PY) == ["train.py", "--lr", "1"]
    assert parse_command([PY, "-u", "-m", "pkg.train", "-x"], PY) == ["-m", "pkg.train", "-x"]
    assert parse_command([PY, "train.py"], PY) is None  # not torchrun's form: no -u
    assert parse_command([PY, "-u", "-X", "dev", "train.py"], PY) is None  # another flag
    assert parse_command([PY, "-u", "-m"], PY) is None
    assert parse_command(["/other/python", "-u", "train.py"], PY) is None
    assert parse_command(["numactl", "--cpunodebind=0", PY, "-u", "t.py"], PY) is None
    assert parse_command(["./train.sh", "-u", "x"], PY) is None  # --no-python


def test_only_the_variables_torch_sets_per_worker_may_differ() -> None:
    spare = {"PATH": "/bin", "PYTHONPATH": "/a", "OMP_NUM_THREADS": "1"}
    worker = {
        **spare,
        "RANK": "3",
        "LOCAL_RANK": "0",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_ERROR_FILE": "/tmp/e.json",
    }
    assert foreign_changes(spare, worker) == []
    assert foreign_changes(spare, {**worker, "PYTHONPATH": "/b"}) == ["PYTHONPATH"]
    changed = dict(worker)
    del changed["OMP_NUM_THREADS"]
    changed["LD_PRELOAD"] = "x.so"
    assert foreign_changes(spare, changed) == ["LD_PRELOAD", "OMP_NUM_THREADS"]


def test_a_spare_runs_the_script_as_main_with_the_workers_argv_and_env(
    pool: WarmPool, tmp_path: Path
) -> None:
    script = tmp_path / "scripts" / "report.py"
    script.parent.mkdir()
    script.write_text(REPORT)
    report = tmp_path / "report.json"
    pid = spare_of(pool)
    env = {**os.environ, "RANK": "5"}
    os.environ["REPORT_TO"] = str(report)  # not per worker: the spare must have it too
    try:
        pool.tick()
        proc = pool.take(
            [PY, "-u", str(script), "--a", "b"], {**env, "REPORT_TO": str(report)}, redirected=False
        )
    finally:
        del os.environ["REPORT_TO"]
    # The spare started before REPORT_TO existed: that is a foreign change, so a cold start.
    assert proc is None
    assert pool.cold_starts == 1
    with pytest.raises(ProcessLookupError):  # the unsuitable spare was killed, not leaked
        os.kill(pid, 0)

    os.environ["REPORT_TO"] = str(report)
    try:
        pid = spare_of(pool)
        proc = pool.take(
            [PY, "-u", str(script), "--a", "b"], {**os.environ, "RANK": "5"}, redirected=False
        )
    finally:
        del os.environ["REPORT_TO"]
    assert proc is not None and proc.pid == pid
    assert wait(proc) == 0
    out = json.loads(report.read_text())
    assert out == {
        "name": "__main__",
        "file": str(script),
        "argv": [str(script), "--a", "b"],
        "rank": "5",
        "path0": str(script.parent),
        "stdin": "",
        "torch_loaded": False,  # preload=("json",) here; the agent preloads torch
    }
    assert pool.handed_over == 1 and pool.idle == []


def test_a_module_runs_as_main_and_exit_codes_pass_through(
    pool: WarmPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(REPORT)
    report = tmp_path / "report.json"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("REPORT_TO", str(report))
    monkeypatch.setenv("EXIT_WITH", "7")
    spare_of(pool)
    proc = pool.take([PY, "-u", "-m", "mypkg.job", "x"], dict(os.environ), redirected=False)
    assert proc is not None
    assert wait(proc) == 7
    out = json.loads(report.read_text())
    assert out["name"] == "__main__"
    assert out["argv"] == [str(package / "job.py"), "x"]


def test_an_uncaught_exception_exits_1_with_its_traceback(
    pool: WarmPool, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "boom.py"
    script.write_text("raise ValueError('boom from the worker')\n")
    spare_of(pool)
    proc = pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False)
    assert proc is not None
    assert wait(proc) == 1
    assert "ValueError: boom from the worker" in capfd.readouterr().err


def test_redirected_output_and_other_commands_start_cold(pool: WarmPool, tmp_path: Path) -> None:
    script = tmp_path / "t.py"
    script.write_text("")
    spare_of(pool)
    assert pool.take([PY, "-u", str(script)], dict(os.environ), redirected=True) is None
    spare_of(pool)
    assert pool.take([PY, "-X", "dev", str(script)], dict(os.environ), redirected=False) is None
    assert pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False) is None  # empty
    assert pool.cold_starts == 3 and pool.handed_over == 0


def test_a_dead_spare_means_a_cold_start(pool: WarmPool, tmp_path: Path) -> None:
    pid = spare_of(pool)
    os.kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    assert pool.take([PY, "-u", str(tmp_path / "t.py")], dict(os.environ), redirected=False) is None
    assert pool.cold_starts == 1


def test_spares_wait_for_the_group_to_run_then_fill_every_slot() -> None:
    warm = WarmPool(2, preload=(), after_seconds=0.5)
    try:
        warm.group_started()
        warm.tick()
        assert warm.idle == []
        time.sleep(0.6)
        warm.tick()
        assert len(warm.idle) == 2
    finally:
        warm.close()
    assert warm.idle == []


def test_closing_the_pool_kills_idle_spares_and_a_closed_pipe_ends_one() -> None:
    warm = WarmPool(2, preload=(), after_seconds=0)
    warm.tick()
    first, second = warm.idle
    # The agent dies: the spare reads end-of-file on its stdin and exits 0 by itself.
    spare = warm._spares[0]
    assert spare.proc.stdin is not None
    spare.proc.stdin.close()
    assert spare.proc.wait(timeout=10) == 0
    warm.close()
    for pid in (first, second):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_warm_workers_are_on_by_default_and_switched_by_env() -> None:
    assert resolve_settings({}, {}).warm_workers is True
    assert resolve_settings({}, {contract.DDPJOB_WARM_WORKERS: "0"}).warm_workers is False
    assert resolve_settings({}, {contract.DDPJOB_WARM_WORKERS: "true"}).warm_workers is True
    with pytest.raises(ValueError, match="DDPJOB_WARM_WORKERS"):
        resolve_settings({}, {contract.DDPJOB_WARM_WORKERS: "sometimes"})


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_early_spares_are_adopted_up_to_the_slots_with_the_agents_env_and_alive(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stale = start_spare(preload=())  # the agent's env changes after it started (OMP_NUM_THREADS)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    report = tmp_path / "report.json"
    monkeypatch.setenv("REPORT_TO", str(report))
    dead, good, extra = start_spare(preload=()), start_spare(preload=()), start_spare(preload=())
    assert stale and dead and good and extra
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(timeout=10)
    pool = WarmPool(1, preload=(), after_seconds=60)
    try:
        pool.adopt([stale, dead, good, extra])
        assert pool.idle == [good.proc.pid]
        assert not alive(stale.proc.pid) and not alive(extra.proc.pid)
        script = tmp_path / "t.py"
        script.write_text(REPORT)
        env = dict(os.environ, RANK="0")
        proc = pool.take([PY, "-u", str(script)], env, redirected=False)
        assert proc is not None and proc.pid == good.proc.pid
        assert wait(proc) == 0
        assert json.loads(report.read_text())["rank"] == "0"
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("argv", "env", "count"),
    [
        (["train.py"], {}, 1),
        (["train.py"], {contract.PET_NPROC_PER_NODE: "3"}, 3),
        (["train.py"], {contract.PET_NPROC_PER_NODE: "gpu"}, 1),
        (["train.py"], {contract.DDPJOB_WARM_WORKERS: "0"}, 0),
        (["train.py"], {contract.DDPJOB_WARM_WORKERS: "sometimes"}, 0),  # reported later, exit 2
        (["--no-python", "echo"], {}, 0),
        (["--help"], {}, 0),
    ],
)
def test_the_agent_starts_early_spares_before_its_own_imports_unless_they_cannot_serve(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], env: dict[str, str], count: int
) -> None:
    asked: list[int] = []

    def start_early(n: int, into: list[warm.Spare]) -> list[warm.Spare]:
        asked.append(n)
        return into

    monkeypatch.setattr(warm, "start_early", start_early)
    cli._early_spares(argv, env, [])
    assert asked == ([count] if count else [])


GATED = """
import os, time
while not os.path.exists(os.environ["IMPORT_GATE"]):
    time.sleep(0.02)
"""

FDS = """
import json, os
fds = {}
for fd in os.listdir("/proc/self/fd"):
    try:
        fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        pass
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump(fds, f)
"""


def gated_import(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A module ``slow_import`` on the path whose import waits for the returned file to exist."""
    (tmp_path / "slow_import.py").write_text(GATED)
    gate = tmp_path / "gate"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("IMPORT_GATE", str(gate))
    return gate


def wait_ready(pool: WarmPool, timeout: float = 30) -> None:
    """Until a spare of ``pool`` has done its imports (or ``timeout``: the caller asserts)."""
    deadline = time.monotonic() + timeout
    while pool.ready == 0 and time.monotonic() < deadline:
        time.sleep(0.02)


def test_a_spare_is_ready_once_its_imports_are_done_and_its_worker_inherits_no_pipe_of_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate, report = gated_import(monkeypatch, tmp_path), tmp_path / "fds.json"
    monkeypatch.setenv("REPORT_TO", str(report))
    pool = WarmPool(1, preload=("slow_import",), after_seconds=0)
    try:
        pool.tick()
        time.sleep(1.0)  # time enough to start and import anything but the gated module
        assert pool.ready == 0
        gate.touch()
        wait_ready(pool)
        assert pool.ready == 1
        script = tmp_path / "fds.py"
        script.write_text(FDS)
        proc = pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False)
        assert proc is not None and wait(proc) == 0
        fds = json.loads(report.read_text())
        # stdin (the agent's after the handover), stdout, stderr and the listing's own: no pipe.
        assert fds["0"] == os.readlink("/proc/self/fd/0") == os.devnull
        assert not [link for fd, link in fds.items() if int(fd) > 2 and "pipe:" in link]
        assert pool.ready == 0
    finally:
        pool.close()


def test_a_spare_whose_import_fails_is_ready_and_its_worker_reports_the_failure(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    (tmp_path / "broken_import.py").write_text("raise ImportError('no such library')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    pool = WarmPool(1, preload=("broken_import",), after_seconds=0)
    try:
        pool.tick()
        wait_ready(pool)
        assert pool.ready == 1  # nothing more to wait for: a cold worker would fail the same way
        script = tmp_path / "imports.py"
        script.write_text("import broken_import\n")
        proc = pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False)
        assert proc is not None and wait(proc) == 1
    finally:
        pool.close()


def test_spares_start_only_as_far_as_the_containers_memory_holds_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gib = 1 << 30
    assert warm.spares_that_fit(8, None) == 8  # no limit
    # 8 GiB limit, 7 GiB in use: 1 GiB free, 0.8 GiB of it kept for the workers.
    assert warm.spares_that_fit(2, Memory(limit=8 * gib, working_set=7 * gib)) == 0
    # 2 GiB in use: 5.2 GiB for spares of 400 MiB: 13 of them.
    assert warm.spares_that_fit(2, Memory(limit=8 * gib, working_set=2 * gib)) == 2
    assert warm.spares_that_fit(20, Memory(limit=8 * gib, working_set=2 * gib)) == 13

    looks: list[Memory] = []
    full = Memory(limit=8 * gib, working_set=8 * gib)
    roomy = Memory(limit=8 * gib, working_set=gib)
    answers = iter([full, roomy])

    def memory() -> Memory:
        looks.append(next(answers))
        return looks[-1]

    pool = WarmPool(1, preload=(), after_seconds=0, memory=memory)
    try:
        pool.tick()
        assert pool.idle == []
        pool.tick()  # short of memory: no second look for MEMORY_LOOK_SECONDS
        assert looks == [full]
        monkeypatch.setattr(warm, "MEMORY_LOOK_SECONDS", 0.0)
        pool._memory_look = 0.0  # the look's time has come
        pool.tick()
        assert looks == [full, roomy]
        assert len(pool.idle) == 1
    finally:
        pool.close()


OOM_SCORE = """
import json, os
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump(open("/proc/self/oom_score_adj").read().strip(), f)
"""


def test_an_idle_spare_is_the_oom_killers_first_choice_and_its_worker_is_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ours = Path("/proc/self/oom_score_adj").read_text().strip()
    report = tmp_path / "score.json"
    monkeypatch.setenv("REPORT_TO", str(report))
    pool = WarmPool(1, preload=("json",), after_seconds=0)
    try:
        pool.tick()
        wait_ready(pool)
        (pid,) = pool.idle
        assert Path(f"/proc/{pid}/oom_score_adj").read_text().strip() == "1000"
        script = tmp_path / "score.py"
        script.write_text(OOM_SCORE)
        proc = pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False)
        assert proc is not None and wait(proc) == 0
        assert json.loads(report.read_text()) == ours
    finally:
        pool.close()


@pytest.mark.parametrize(
    ("argv", "env", "count", "omp"),
    [
        (["train.py"], {contract.PET_NPROC_PER_NODE: "4"}, 4, "1"),  # torchrun's default
        (["train.py"], {contract.PET_NPROC_PER_NODE: "4", "OMP_NUM_THREADS": "8"}, 4, "8"),
        (["train.py"], {contract.PET_NPROC_PER_NODE: "1"}, 1, None),  # torchrun leaves it
        # A flag may override the variable: only torchrun's parser knows, so nothing is set.
        (["--nproc-per-node=2", "train.py"], {contract.PET_NPROC_PER_NODE: "4"}, 1, None),
        (["--nproc_per_node", "2", "train.py"], {}, 1, None),
    ],
)
def test_early_spares_get_torchruns_omp_default_when_torchrun_will_set_it(
    monkeypatch: pytest.MonkeyPatch,
    argv: list[str],
    env: dict[str, str],
    count: int,
    omp: str | None,
) -> None:
    asked: list[int] = []

    def start_early(n: int, into: list[warm.Spare]) -> list[warm.Spare]:
        asked.append(n)
        return into

    monkeypatch.setattr(warm, "start_early", start_early)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if "OMP_NUM_THREADS" in env:
        monkeypatch.setenv("OMP_NUM_THREADS", env["OMP_NUM_THREADS"])
    cli._early_spares(argv, env, [])
    assert asked == [count]
    assert os.environ.get("OMP_NUM_THREADS") == omp


SAVES = """
import os, signal
from pathlib import Path
from ddpjob_worker import saving
marker = Path(os.environ["DDPJOB_SAVING_DIR"]) / str(os.getpid())
with saving():
    print("marker", marker.exists(), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # the pod stops mid-save
    print("still saving", flush=True)
print("after the save", flush=True)
"""


def test_saving_announces_the_save_and_holds_a_sigterm_until_it_ends(tmp_path: Path) -> None:
    script = tmp_path / "saves.py"
    script.write_text(SAVES)
    env = dict(os.environ, DDPJOB_SAVING_DIR=str(tmp_path))
    done = subprocess.run(
        [PY, str(script)], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    # The held SIGTERM is delivered once the block ends: the default action, at once.
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert done.stdout.splitlines() == ["marker True", "still saving"]
    assert [p.name for p in tmp_path.iterdir()] == ["saves.py"]  # the marker is gone


def test_a_spare_that_dies_idle_is_reaped_and_replaced() -> None:
    pool = WarmPool(1, preload=("json",), after_seconds=0)
    try:
        pool.tick()
        (first,) = pool.idle
        os.kill(first, signal.SIGKILL)  # the OOM killer's first choice
        deadline = time.monotonic() + 10
        while Path(f"/proc/{first}").exists() and time.monotonic() < deadline:
            pool.tick()  # reaps it: no zombie left behind
            time.sleep(0.02)
        assert not Path(f"/proc/{first}").exists()
        (second,) = pool.idle
        assert second != first
    finally:
        pool.close()


PICKLES_AT_EXIT = """
import atexit, os, pickle, sys

class Thing:
    pass

def save() -> None:  # an async checkpoint's upload, torch.save(model) at exit...
    data = pickle.dumps(Thing())
    with open(os.environ["REPORT_TO"], "wb") as f:
        f.write(data)

atexit.register(save)
"""


@pytest.mark.parametrize("module", [False, True])
def test_a_warm_worker_keeps_its_main_module_after_the_body_as_a_cold_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: bool
) -> None:
    # runpy put its own __main__ back once the body returned: pickling a class of the script
    # from an atexit handler failed in warm workers only (review finding 11).
    (tmp_path / "atexit_pickle.py").write_text(PICKLES_AT_EXIT)
    report = tmp_path / "thing.pickle"
    monkeypatch.setenv("REPORT_TO", str(report))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    command = (
        [PY, "-u", "-m", "atexit_pickle"]
        if module
        else [PY, "-u", str(tmp_path / "atexit_pickle.py")]
    )
    cold = subprocess.run(command, env=dict(os.environ), capture_output=True, check=False)
    assert cold.returncode == 0 and report.exists(), cold.stderr
    report.unlink()
    pool = WarmPool(1, preload=("json",), after_seconds=0)
    try:
        pool.tick()
        wait_ready(pool)
        proc = pool.take(command, dict(os.environ), redirected=False)
        assert proc is not None and wait(proc) == 0
        assert report.exists()
    finally:
        pool.close()


def test_a_large_handover_does_not_wait_for_the_spares_imports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The agent writes the worker's argv and environment to the spare's stdin; beyond the
    # pipe's 64 KiB the write blocked until the spare had imported torch and read it, and a
    # spare stuck in an import hung the agent (review finding 11).
    gate, report = gated_import(monkeypatch, tmp_path), tmp_path / "report.json"
    monkeypatch.setenv("REPORT_TO", str(report))
    for i in range(8):  # 256 KiB in all (one variable may not exceed 128 KiB)
        monkeypatch.setenv(f"SERVICE_{i}_PORT", "x" * (32 << 10))
    # Spares at the normal policy (the agent's early ones) are handed over before they are ready.
    pool = WarmPool(1, preload=("slow_import",), after_seconds=0, idle=False)
    try:
        pool.tick()
        script = tmp_path / "t.py"
        script.write_text(REPORT)
        taken: list[subprocess.Popen[bytes] | None] = []
        thread = threading.Thread(
            target=lambda: taken.append(
                pool.take([PY, "-u", str(script)], dict(os.environ, RANK="0"), redirected=False)
            ),
            daemon=True,
        )
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "the handover waited for the spare's imports"
        assert not report.exists()  # the spare still imports
        gate.touch()
        (proc,) = taken
        assert proc is not None and wait(proc) == 0
        assert json.loads(report.read_text())["rank"] == "0"
    finally:
        gate.touch()
        pool.close()


POLICIES = """
import json, os
policies = {}
for tid in os.listdir("/proc/self/task"):
    try:
        policies[tid] = os.sched_getscheduler(int(tid))
    except OSError:
        pass
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump({"main": os.sched_getscheduler(0), "threads": policies}, f)
"""

IDLE_PROBE = """
import os, threading, time
with open(os.environ["PROBE_TO"], "w") as f:
    f.write(str(os.sched_getscheduler(0)))
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()  # inherits the policy
"""


def test_a_pool_spare_imports_at_the_idle_policy_and_its_worker_runs_at_the_normal_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The import thread runs SCHED_IDLE (measured: it never slows the workers' own start-up);
    # the worker, and a thread the import started (which inherited the idle policy), do not.
    (tmp_path / "idle_probe.py").write_text(IDLE_PROBE)
    probe, report = tmp_path / "probe", tmp_path / "report.json"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PROBE_TO", str(probe))
    monkeypatch.setenv("REPORT_TO", str(report))
    pool = WarmPool(1, preload=("idle_probe",), after_seconds=0)
    try:
        pool.tick()
        wait_ready(pool)
        assert pool.ready == 1
        assert int(probe.read_text()) == os.SCHED_IDLE
        script = tmp_path / "policies.py"
        script.write_text(POLICIES)
        proc = pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False)
        assert proc is not None and wait(proc) == 0
        seen = json.loads(report.read_text())
        assert seen["main"] == os.SCHED_OTHER
        assert len(seen["threads"]) >= 2  # the main thread and the probe's sleeper
        assert set(seen["threads"].values()) == {os.SCHED_OTHER}
        assert pool.handed_over == 1
    finally:
        pool.close()


def test_an_idle_spare_not_done_importing_stays_for_the_next_restart_and_the_worker_starts_cold(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gate, report = gated_import(monkeypatch, tmp_path), tmp_path / "report.json"
    monkeypatch.setenv("REPORT_TO", str(report))
    pool = WarmPool(1, preload=("slow_import",), after_seconds=0)
    script = tmp_path / "t.py"
    script.write_text(REPORT)
    try:
        pool.tick()
        time.sleep(0.5)
        spare = pool.idle
        assert len(spare) == 1 and pool.ready == 0
        assert pool.take([PY, "-u", str(script)], dict(os.environ), redirected=False) is None
        assert pool.cold_starts == 1 and pool.idle == spare  # kept, not killed
        gate.touch()
        wait_ready(pool)
        proc = pool.take([PY, "-u", str(script)], dict(os.environ, RANK="3"), redirected=False)
        assert proc is not None and proc.pid == spare[0] and wait(proc) == 0
        assert json.loads(report.read_text())["rank"] == "3"
        assert pool.handed_over == 1
    finally:
        gate.touch()
        pool.close()
