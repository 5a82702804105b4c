"""Warm workers see what cold ones see (review finding 11): stdin, sys.path, CUDA's devices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddpjob_worker.agent import spare
from ddpjob_worker.agent.spare import cuda_pinned
from ddpjob_worker.agent.warm import WarmPool
from tests.unit.test_warm import agent_stdin, wait_ready

PY = sys.executable


@pytest.fixture(autouse=True)
def _no_terminal_stdin() -> Iterator[None]:
    """Workers may read their stdin: never the terminal of ``pytest -s``."""
    with agent_stdin(os.devnull):
        yield


STDIN = """
import json, os, sys
out = {
    "read": sys.stdin.read(),
    "fd0": os.readlink("/proc/self/fd/0"),
    "name": sys.stdin.name,
    "mode": sys.stdin.mode,
    "seekable": sys.stdin.seekable(),
    "encoding": sys.stdin.encoding,
    "errors": sys.stdin.errors,
    "line_buffering": sys.stdin.line_buffering,
    "is_dunder": sys.stdin is sys.__stdin__,
}
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump(out, f)
"""


def report_of(command: list[str], pool: WarmPool | None, report: Path) -> object:
    """What ``command`` wrote to ``report``, started cold (``pool`` None) or by ``pool``."""
    if report.exists():
        report.unlink()
    if pool is None:
        done = subprocess.run(command, env=dict(os.environ), capture_output=True, check=False)
        assert done.returncode == 0, done.stderr
    else:
        wait_ready(pool)  # the pool's spares are handed over once ready
        proc = pool.take(command, dict(os.environ), redirected=False)
        assert proc is not None
        assert proc.wait(timeout=30) == 0
    return json.loads(report.read_text())


def test_a_warm_worker_reads_the_agents_stdin_as_a_cold_one_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A spare's stdin was /dev/null after the handover: ``ddpjob-agent train.py < input`` and
    # breakpoint() under ``kubectl attach -it`` read end-of-file in warm workers only.
    data, report = tmp_path / "input.txt", tmp_path / "report.json"
    data.write_text("the agent's stdin\nline two\n")
    script = tmp_path / "stdin.py"
    script.write_text(STDIN)
    monkeypatch.setenv("REPORT_TO", str(report))
    command = [PY, "-u", str(script)]
    with agent_stdin(data):
        cold = report_of(command, None, report)
    pool = WarmPool(1, preload=("json",), after_seconds=0)
    try:
        with agent_stdin(data):  # a fresh open: the cold worker read the other one to its end
            pool.tick()
        warm_report = report_of(command, pool, report)  # the spare kept the stdin it started with
    finally:
        pool.close()
    assert isinstance(cold, dict) and cold["read"] == "the agent's stdin\nline two\n"
    assert cold["fd0"] == str(data) and cold["seekable"] is True and cold["name"] == "<stdin>"
    assert warm_report == cold


PATH_REPORT = """
import json, os, sys
import shadowed
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump({"path": sys.path, "shadowed": shadowed.WHERE}, f)
"""


@pytest.mark.parametrize("module", [False, True])
def test_the_working_directory_shadows_nothing_a_spare_preloads_and_sys_path_is_a_cold_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, module: bool
) -> None:
    # The spare ran ``python -m``: the working directory was first on sys.path while it
    # imported torch, so a sympy.py there shadowed torch's sympy in the spare only.
    lib, cwd, scripts = tmp_path / "lib", tmp_path / "cwd", tmp_path / "scripts"
    for directory in (lib, cwd, scripts):
        directory.mkdir()
    (lib / "shadowed.py").write_text("WHERE = 'lib'\n")
    (cwd / "shadowed.py").write_text("WHERE = 'the working directory'\n")
    (lib / "path_report.py").write_text(PATH_REPORT)
    (scripts / "path_report.py").write_text(PATH_REPORT)
    report = tmp_path / "report.json"
    monkeypatch.setenv("PYTHONPATH", str(lib))
    monkeypatch.setenv("REPORT_TO", str(report))
    monkeypatch.chdir(cwd)
    command = (
        [PY, "-u", "-m", "path_report"] if module else [PY, "-u", str(scripts / "path_report.py")]
    )
    cold = report_of(command, None, report)
    pool = WarmPool(1, preload=("shadowed",), after_seconds=0)
    try:
        pool.tick()
        warm_report = report_of(command, pool, report)
    finally:
        pool.close()
    assert isinstance(cold, dict) and isinstance(warm_report, dict)
    assert warm_report["shadowed"] == "lib"  # preloaded from where the cold worker's path had it
    assert cold["path"][0] == str(cwd if module else scripts)
    assert warm_report["path"] == cold["path"]
    if not module:  # python -m puts the working directory first: its own shadows in cold only
        assert cold["shadowed"] == "lib"


def test_cuda_is_pinned_by_an_open_gpu_device_or_torchs_own_flag() -> None:
    opened = ["/dev/null", "pipe:[123]", "socket:[9]", "/usr/lib/libcuda.so.1", "/dev/nvme0n1"]
    assert not cuda_pinned(opened, False)
    for device in ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/kfd"):
        assert cuda_pinned([*opened, device], False)
    assert cuda_pinned(opened, True)
    assert cuda_pinned([], True)


def test_a_spare_sees_its_own_open_files(tmp_path: Path) -> None:
    device = tmp_path / "nvidia0"
    device.write_text("")
    with device.open() as _:
        assert str(device) in spare._fd_targets()
    assert spare._torch_cuda_initialized() is False  # pytest's process never initialises CUDA


CUDA_REPORT = """
import json, os, sys
with open(os.environ["REPORT_TO"], "w") as f:
    json.dump({"pid": os.getpid(), "warm": "torch.cuda" in sys.modules,
               "devices": os.environ["CUDA_VISIBLE_DEVICES"], "argv": sys.argv}, f)
"""


@pytest.mark.parametrize("devices", ["0,1", "1"])
def test_a_spare_that_initialised_cuda_starts_a_worker_with_other_devices_cold(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    devices: str,
) -> None:
    # A sitecustomize or a preloaded module initialised CUDA in the spare: the driver keeps the
    # spare's CUDA_VISIBLE_DEVICES, and a worker handed other ones saw the wrong GPUs. Here a
    # torch.cuda of our own says it is initialised (no GPU needed).
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    (fake / "cuda.py").write_text("def is_initialized():\n    return True\n")
    script, report = tmp_path / "cuda_report.py", tmp_path / "report.json"
    script.write_text(CUDA_REPORT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("REPORT_TO", str(report))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    pool = WarmPool(1, preload=("torch.cuda",), after_seconds=0)
    try:
        pool.tick()
        wait_ready(pool)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=devices)
        proc = pool.take([PY, "-u", str(script), "--x"], env, redirected=False)
        assert proc is not None and proc.wait(timeout=30) == 0
    finally:
        pool.close()
    out = json.loads(report.read_text())
    same = devices == "0,1"
    assert out["pid"] == proc.pid  # the spare's process either way: torch's Popen sees its exit
    assert out["warm"] is same  # other devices: a fresh python, without the spare's torch.cuda
    assert out["devices"] == devices and out["argv"] == [str(script), "--x"]
    refused = "CUDA was initialised in this spare" in capfd.readouterr().err
    assert refused is not same
