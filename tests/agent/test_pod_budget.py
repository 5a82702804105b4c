"""One faulty pod spends only its own restart budget, and is replaced alone (`ddpjob run`).

With torch's rule, a worker crash on one pod breaks the collective on every pod, every agent
is charged a restart, and with ``maxRestarts: 0`` the whole job fails. ddpjob-agent charges the
root cause only: the crashing pod's agent gives up (exit 1) without closing the rendezvous, the
runner replaces that pod, and the other pod restarts its workers for free and re-admits the
replacement. Real processes, real torch (gloo on CPU), driven as a user runs it.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train.py"
DDPJOB = shutil.which("ddpjob", path=str(Path(sys.executable).parent)) or "ddpjob"
STEP = re.compile(r"DDPJOB step=(\d+) rank=(\d+) world=(\d+)")

pytestmark = pytest.mark.slow


def _manifest(tmp: Path) -> Path:
    document = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": "budget"},
        "spec": {
            "replicas": 2,
            "minReplicas": 2,
            "maxReplicas": 2,
            "nprocPerNode": 1,
            "maxRestarts": 0,
            "backoffLimit": 3,
            "podBackoff": {"initialDelaySeconds": 1},  # pod 1's replacement after 1 s, not 10
            "template": {
                "spec": {
                    "terminationGracePeriodSeconds": 10,
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "unused-locally",
                            "command": ["ddpjob-agent"],
                            "args": [
                                str(TRAIN),
                                "--steps",
                                "40",
                                "--ckpt-every",
                                "5",
                                "--step-sleep",
                                "0.05",
                                "--crash-once-on-pod",
                                "1",
                                "--crash-step",
                                "8",
                            ],
                        }
                    ],
                }
            },
        },
    }
    path = tmp / "job.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def _leftovers(run_dir: Path) -> list[int]:
    found = []
    for process in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if process.environ().get("DDPJOB_RUN_DIR") == str(run_dir):
                found.append(process.pid)
    return found


def test_a_crash_on_one_pod_replaces_only_that_pod_with_max_restarts_0(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    out_path = tmp_path / "ddpjob-run.out"
    with out_path.open("w") as out:
        process = subprocess.Popen(
            [DDPJOB, "run", str(_manifest(tmp_path)), "--plain", "--run-dir", str(run_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=150)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGKILL)
                process.wait()
            for pid in _leftovers(run_dir):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
    output = out_path.read_text()
    logs = {p.name: p.read_text(errors="replace") for p in sorted((run_dir / "logs").glob("*.log"))}
    everything = output + "".join(
        f"\n--- {name} ---\n{text[-3000:]}" for name, text in logs.items()
    )
    assert code == 0, everything
    assert "DDPJob budget Succeeded" in output, everything
    # Pod 1's crash (exit 1) replaced pod 1, and only pod 1.
    assert re.search(r"pods replaced: 1 \(budget-worker-1 ExitCode\(1\)\)", output), everything
    assert "DDPJOB crash pod=1" in "".join(logs.values()), everything
    # Pod 0's agent restarted its workers for free: its failure was collateral damage, or pod 1
    # announced the end of the round before pod 0's worker failed.
    pod0 = "".join(text for name, text in logs.items() if "worker-0" in name)
    assert "collateral (free restart)" in pod0 or re.search(
        r"announced its end \([^)]*failure", pod0
    ), everything
    steps = {(int(m[1]), int(m[2])) for text in logs.values() for m in STEP.finditer(text)}
    assert {(39, 0), (39, 1)} <= steps, everything
    assert _leftovers(run_dir) == []
