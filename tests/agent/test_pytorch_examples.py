"""pytorch/examples' own scripts on the training-state API, under ``ddpjob run`` with faults:
``distributed/ddp-tutorial-series/multinode.py`` (a DataLoader over DistributedSampler, a
``.mean()`` loss), the same with gradient accumulation, and minGPT-ddp (its DataLoader with
loader workers, AMP's GradScaler, ``clip_grad_norm_``). The scripts are fetched at a pinned
commit and patched (``examples/pytorch-examples``, :mod:`tests.harness.pytorch_examples`); where
they cannot be fetched (no network, no ``DDPJOB_PYTORCH_EXAMPLES``) the tests skip and say so.

Each run's audit (``DDPJOB_TRAIN_AUDIT``, :mod:`ddpjob_worker.train.audit`) is checked: every
restore's ranks hold the same model, the kept steps follow each other from the start to the
last epoch's end (no sample skipped or trained twice), and no restore lost a step.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddpjob_worker.train import audit
from tests.harness import pytorch_examples

pytestmark = pytest.mark.slow
DDPJOB = str(Path(sys.executable).parent / "ddpjob")


@pytest.fixture(scope="module")
def fetched() -> None:
    reason = pytorch_examples.unavailable()
    if reason is not None:
        pytest.skip(reason)


def job(folder: Path, name: str, args: list[str], audit_dir: Path, **spec: Any) -> Path:
    document = {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name},
        "spec": {
            "replicas": 2,
            "minReplicas": 1,
            "maxReplicas": 3,
            "nprocPerNode": 1,
            **spec,
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "trainer",
                            "image": "unused-locally",
                            "command": ["ddpjob-agent"],
                            "args": args,
                            "env": [{"name": audit.DDPJOB_TRAIN_AUDIT, "value": str(audit_dir)}],
                        }
                    ]
                }
            },
        },
    }
    path = folder / "job.yaml"  # `ddpjob run` starts the pods in the manifest's folder
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def run(manifest: Path, run_dir: Path, *chaos: str, timeout: float = 280) -> str:
    done = subprocess.run(
        [DDPJOB, "run", str(manifest), "--plain", "--run-dir", str(run_dir), *chaos],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    logs = "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
        for p in sorted((run_dir / "logs").glob("*.log"))
    )
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{logs}"
    return done.stdout


def checked(audit_dir: Path, size: int, epochs: int) -> audit.Lineage:
    found = audit.check(audit.read(audit_dir), size)
    assert found.problems == []
    assert found.end == [epochs, 0]  # every epoch to its end
    assert found.lost and max(found.lost) == 0, found.lost
    return found


@pytest.mark.usefixtures("fetched")
@pytest.mark.parametrize("script", ["multinode", "multinode-accumulate"])
def test_multinode_trains_every_sample_once_through_lost_pods(tmp_path: Path, script: str) -> None:
    folder = pytorch_examples.checkout(script, tmp_path / "src")
    epochs = 40
    manifest = job(folder, "multinode", ["multinode.py", str(epochs), "1000"], tmp_path / "audit")
    out = run(manifest, tmp_path / "run", "--chaos", "8", "--chaos-faults", "1", "--seed", "4")
    assert out.count("chaos: SIGKILL") == 1, out
    found = checked(tmp_path / "audit", 2048, epochs)
    # The start, and the restore after the loss (one fault: a second one while the job forms
    # again can take the last holder of the state, and the script keeps no checkpoint).
    assert len(found.restores) == 2, found.restores


@pytest.mark.usefixtures("fetched")
def test_mingpt_with_loader_workers_and_amp_through_a_frozen_pod(tmp_path: Path) -> None:
    missing = [m for m in ("hydra", "fsspec", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"minGPT-ddp imports {', '.join(missing)}: pip install hydra-core fsspec boto3")
    folder = pytorch_examples.checkout("mingpt", tmp_path / "src")
    overrides = [
        "data_config.path=data/input.txt", "data_config.truncate=0.004",
        "data_config.block_size=32", "gpt_config.n_layer=2", "gpt_config.n_head=2",
        "gpt_config.n_embd=32", "trainer_config.batch_size=16", "trainer_config.max_epochs=3",
        "trainer_config.data_loader_workers=2", "trainer_config.save_every=1000",
        "trainer_config.use_amp=True",
    ]  # fmt: skip
    manifest = job(folder / "mingpt", "mingpt", ["main.py", *overrides], tmp_path / "audit")
    chaos = ("--chaos", "12", "--chaos-kind", "freeze", "--chaos-faults", "1", "--seed", "2")
    out = run(manifest, tmp_path / "run", *chaos, "--chaos-node-lost-after", "4")
    assert "chaos: SIGSTOP" in out, out
    text = (folder / "mingpt" / "data" / "input.txt").read_text()
    size = int(len(text) * 0.004) - 32
    train = int(size * 0.9)
    checked(tmp_path / "audit", train, 3)
