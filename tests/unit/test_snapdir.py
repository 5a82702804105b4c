"""The agent's snapshot directory (:mod:`ddpjob_worker.snapdir`): its name, which leftovers a
starting agent removes (only its own run's, only of agents that are gone), and the CLI's part
(made before the workers start, named in the env, removed at exit)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ddpjob_worker import snapdir
from ddpjob_worker.agent import cli
from ddpjob_worker.contract import DDPJOB_SNAPSHOT_DIR, PET_RDZV_ID


@pytest.mark.parametrize(
    ("run_id", "pid", "name"),
    [
        ("job-a", 12, "ddpjob-job_a-12"),
        ("default/my job", 1, "ddpjob-default_my_job-1"),
        ("", 7, "ddpjob-none-7"),
        ("r.1_x", 99, "ddpjob-r.1_x-99"),
    ],
)
def test_names_round_trip(run_id: str, pid: int, name: str) -> None:
    assert snapdir.dir_name(run_id, pid) == name
    assert snapdir.parse_dir_name(name) == (snapdir.safe_run_id(run_id), pid)


@pytest.mark.parametrize("name", ["ddpjob-", "ddpjob-x", "ddpjob-x-", "ddpjob--3", "other-x-3"])
def test_other_names_are_not_ours(name: str) -> None:
    assert snapdir.parse_dir_name(name) is None


def test_only_this_runs_directories_of_gone_agents_are_stale() -> None:
    names = [
        "ddpjob-run-10",  # alive: kept
        "ddpjob-run-11",  # dead: stale
        "ddpjob-run-1",  # our own pid (a restarted container's PID 1): stale
        "ddpjob-other-11",  # another run: never touched
        "ddpjob-saving-abc",  # not a snapshot directory
        "unrelated",
    ]
    found = snapdir.stale(names, "run", me=1, alive=lambda pid: pid == 10 or pid == 1)
    assert found == ["ddpjob-run-1", "ddpjob-run-11"]


def test_make_sweeps_stale_directories_and_remove_cleans_up(tmp_path: Path) -> None:
    dead = tmp_path / "ddpjob-run-999999999"  # no such pid
    dead.mkdir()
    (dead / "rank0.snap").write_bytes(b"x")
    live = tmp_path / f"ddpjob-run-{os.getppid()}"
    live.mkdir()
    other = tmp_path / "ddpjob-other-999999999"
    other.mkdir()
    made = snapdir.make("run", base=tmp_path)
    assert made == tmp_path / f"ddpjob-run-{os.getpid()}"
    assert made.is_dir() and (made.stat().st_mode & 0o777) == 0o700
    assert not dead.exists() and live.exists() and other.exists()
    (made / "rank0.snap").write_bytes(b"y")
    snapdir.remove(made)
    snapdir.remove(made)  # gone already: no error
    assert not made.exists()


def test_base_dir_falls_back_to_the_temp_dir(tmp_path: Path) -> None:
    assert snapdir.base_dir(tmp_path) == tmp_path
    assert snapdir.base_dir(tmp_path / "missing") != tmp_path / "missing"


def test_the_cli_names_the_directory_to_the_workers_and_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapdir, "base_dir", lambda shm=snapdir.SHM: tmp_path)
    env = {PET_RDZV_ID: "from-env"}
    made = cli._snapshot_dir(["--rdzv-id", "flag", "train.py"], env)
    assert made is not None and made.name == f"ddpjob-flag-{os.getpid()}"
    assert env[DDPJOB_SNAPSHOT_DIR] == str(made)
    # Set already (an outer agent's): left alone.
    assert cli._snapshot_dir([], env) is None
    assert cli._run_id(["--rdzv_id=x"], {}) == "x"
    assert cli._run_id([], env) == "from-env"
    assert cli._run_id([], {}) == "none"
    monkeypatch.setenv(DDPJOB_SNAPSHOT_DIR, str(made))
    cli._clean_up([], None, made)
    assert not made.exists() and DDPJOB_SNAPSHOT_DIR not in os.environ
