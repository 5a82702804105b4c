"""`ddpjob validate`, `ddpjob crd` and `ddpjob scale`, as a user runs them: real processes, exit codes, stderr."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .jobs import manifest

ROOT = Path(__file__).resolve().parents[2]
DDPJOB = shutil.which("ddpjob", path=str(Path(sys.executable).parent)) or "ddpjob"


def ddpjob(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([DDPJOB, *args], capture_output=True, text=True, timeout=60, check=False)


def test_validate_accepts_the_examples() -> None:
    result = ddpjob("validate", *map(str, sorted((ROOT / "examples").glob("*.yaml"))))
    assert result.returncode == 0, result.stderr
    assert (
        "quickstart.yaml: valid DDPJob default/quickstart: replicas 2 (min 1, max 3)"
        in result.stdout
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("spec: [unclosed", "malformed YAML at line 1, column 16: expected ',' or ']'"),
        ("", "expected exactly one YAML document holding a DDPJob, found 0"),
        (yaml.safe_dump(manifest(minReplicas=5)), "spec: minReplicas (5) must be <= replicas (2)"),
        (
            yaml.safe_dump(manifest(template={"spec": {"containers": []}})),
            "spec.template.spec.containers: List should have at least 1 item",
        ),
        (
            yaml.safe_dump(manifest(template={"spec": {"containers": [{"name": "t"}]}})),
            "spec.template.spec.containers[0].image: required field is missing",
        ),
        (
            yaml.safe_dump(manifest(replicas=-3)),
            "spec.replicas: Input should be greater than or equal to 1 (got -3)",
        ),
        (yaml.safe_dump(manifest(colour="blue")), "spec.colour: unknown field; valid fields here:"),
    ],
)
def test_bad_input_exits_2_with_the_field_and_no_traceback(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(content)
    result = ddpjob("validate", str(path))
    assert result.returncode == 2
    assert message in result.stderr
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_file(tmp_path: Path) -> None:
    result = ddpjob("validate", str(tmp_path / "nope.yaml"))
    assert (result.returncode, result.stderr.strip()) == (
        2,
        f"error: {tmp_path / 'nope.yaml'}: no such file",
    )


def test_bad_usage_exits_2() -> None:
    assert ddpjob("validate").returncode == 2
    assert ddpjob("frobnicate").returncode == 2


# ---- ddpjob run's chaos options ----------------------------------------------------------------

_PARTITION = (
    "ddpjob run: error: argument --chaos-kind: partition is not possible under `ddpjob run`: "
    "every local pod listens on 127.0.0.1 in this machine's one network namespace, so no pod "
    "can be cut off from the others alone; use --chaos-kind freeze instead"
)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--chaos", "5", "--chaos-kind", "partition"], _PARTITION),
        (["--chaos-kind", "partition"], _PARTITION),
        (
            ["--chaos", "5", "--chaos-kind", "scramble"],
            "argument --chaos-kind: 'scramble' is not a chaos kind; choose from kill, freeze, worker, mixed",
        ),
        (["--chaos", "0"], "argument --chaos: '0': give more than 0 seconds"),
        (
            ["--chaos", "5", "--chaos-kind", "freeze", "--chaos-node-lost-after", "-1"],
            "argument --chaos-node-lost-after: '-1': give 0 or more seconds",
        ),
        (
            ["--chaos-kind", "freeze", "--chaos-thaw", "3"],
            "error: --chaos-kind, --chaos-thaw without --chaos SECONDS does nothing: "
            "add --chaos SECONDS",
        ),
        (
            ["--chaos", "5", "--chaos-thaw", "3"],
            "error: --chaos-thaw applies to frozen pods, and --chaos-kind kill freezes none: "
            "add --chaos-kind freeze (or mixed)",
        ),
        (
            ["--chaos", "5", "--chaos-kind", "kill", "--chaos-node-lost-after", "3"],
            "error: --chaos-node-lost-after applies to frozen pods, and --chaos-kind kill "
            "freezes none",
        ),
        (
            ["--chaos", "5", "--chaos-kind", "worker", "--chaos-thaw", "3"],
            "error: --chaos-thaw applies to frozen pods, and --chaos-kind worker freezes none",
        ),
    ],
    ids=[
        "partition",
        "partition-without-chaos",
        "unknown-kind",
        "zero-interval",
        "negative-toleration",
        "no-chaos",
        "thaw-with-kill",
        "node-lost-with-kill",
        "thaw-with-worker",
    ],
)
def test_run_refuses_chaos_options_that_cannot_work(
    tmp_path: Path, options: list[str], message: str
) -> None:
    """Exit 2 naming the option, before anything runs (the manifest need not even exist)."""
    result = ddpjob("run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run"), *options)
    assert result.returncode == 2, result
    assert message in " ".join(result.stderr.split()), result.stderr
    assert "no such file" not in result.stderr  # refused before the manifest is read
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists()


def test_run_help_names_the_chaos_kinds() -> None:
    result = ddpjob("run", "--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--chaos-kind {kill,freeze,worker,mixed}" in text
    for words in (
        "kill: SIGKILL",
        "freeze: SIGSTOP",
        "worker: SIGKILL one training process",
        "mixed: kill or freeze",
        "partition is",
    ):
        assert words in text, words
    assert "--chaos-faults N, --chaos-kills N" in text


# ---- ddpjob run's store key ---------------------------------------------------------------------


def _print_key_job(tmp_path: Path, env: list[dict[str, Any]] | None = None) -> Path:
    trainer: dict[str, object] = {
        "name": "trainer",
        "image": "unused-locally",
        "command": ["sh", "-c", 'echo "key=$DDPJOB_STORE_KEY"'],
    }
    if env is not None:
        trainer["env"] = env
    document = manifest(template={"spec": {"containers": [trainer]}})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def test_run_gives_every_pod_one_store_key_per_run(tmp_path: Path) -> None:
    """The pods' DDPJOB_STORE_KEY (a secretKeyRef to the job's store-key Secret, as on a
    cluster) is one new key per run, the same in every pod of it."""
    path = _print_key_job(tmp_path)
    keys = []
    for run in ("one", "two"):
        result = ddpjob("run", str(path), "--plain", "--run-dir", str(tmp_path / run))
        assert result.returncode == 0, result.stdout + result.stderr
        logs = sorted((tmp_path / run / "logs").glob("*.log"))
        assert [p.name for p in logs] == ["demo-worker-0.0.log", "demo-worker-1.0.log"]
        [key] = {p.read_text().strip() for p in logs}
        assert re.fullmatch(r"key=[A-Za-z0-9_-]{43}", key), key
        assert key.removeprefix("key=") not in result.stdout + result.stderr  # never shown
        keys.append(key)
    assert keys[0] != keys[1]


def test_run_resolves_no_other_secret(tmp_path: Path) -> None:
    other = {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "demo-store-key", "key": "x"}}}
    result = ddpjob("run", str(_print_key_job(tmp_path, [other])), "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2, result
    assert result.stderr.strip() == (
        "error: spec.template.spec.containers[0].env[0] (TOKEN): the local runner cannot "
        "resolve secretKeyRef {'key': 'x', 'name': 'demo-store-key'}; give it a plain value "
        "for local runs"
    )


def test_crd_prints_the_checked_in_crd() -> None:
    result = ddpjob("crd")
    assert result.returncode == 0
    assert result.stdout == (ROOT / "deploy" / "crd.yaml").read_text()


# ---- ddpjob scale ----------------------------------------------------------------------------

_TEMPLATE = {"spec": {"containers": [{"name": "t", "image": "i", "command": ["ddpjob-agent"]}]}}
_HEAD = """apiVersion: ddpjob.io/v1alpha1
kind: DDPJob
metadata:
  name: demo
  annotations:
    # replicas: 9 (a comment)
    notes: |
      replicas: 7
"""


def _spec_replicas(path: Path) -> int:
    return int(yaml.safe_load(path.read_text())["spec"]["replicas"])


def test_scale_edits_spec_replicas_only_and_keeps_comments(tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    text = _HEAD + (
        "spec:\n"
        f"  template: {json.dumps(_TEMPLATE)}\n"
        "  replicas: 2   # scaled by ddpjob scale\n"
        "  maxReplicas: 4\n"
    )
    path.write_text(text)
    result = ddpjob("scale", str(path), "3")
    assert (result.returncode, result.stdout.strip()) == (0, f"{path}: spec.replicas 2 -> 3")
    assert path.read_text() == text.replace("replicas: 2   #", "replicas: 3 #")
    assert _spec_replicas(path) == 3
    assert yaml.safe_load(path.read_text())["metadata"]["annotations"]["notes"] == "replicas: 7\n"


@pytest.mark.parametrize(
    ("spec", "replicas", "message"),
    [
        # Flow style: the only `replicas: N` line is inside the annotation's block scalar.
        (
            "spec: " + json.dumps({"replicas": 2, "maxReplicas": 4, "template": _TEMPLATE}),
            "3",
            "left untouched: no 'replicas: N' line is spec.replicas (editing line 8 would not "
            "read back as spec.replicas 3",
        ),
        (
            "spec:\n  replicas: 2\n  maxReplicas: 4\n  template: " + json.dumps(_TEMPLATE),
            "5",
            "replicas 5 is outside minReplicas..maxReplicas (2..4)",
        ),
    ],
    ids=["not-spec-replicas", "out-of-range"],
)
def test_scale_refuses_and_leaves_the_file_untouched(
    tmp_path: Path, spec: str, replicas: str, message: str
) -> None:
    path = tmp_path / "job.yaml"
    text = _HEAD + spec + "\n"
    path.write_text(text)
    result = ddpjob("scale", str(path), replicas)
    assert result.returncode == 2, result
    assert result.stderr.startswith(f"error: {path}: "), result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert path.read_text() == text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


@pytest.mark.parametrize(
    ("missing", "argv", "extra"),
    [
        ("psutil", ["run", "examples/quickstart.yaml"], "local"),
        ("rich", ["run", "examples/quickstart.yaml"], "local"),
        ("torch", ["run", "examples/quickstart.yaml"], "local"),
        ("kopf", ["operator", "--namespace", "ml"], "operator"),
        ("prometheus_client", ["operator", "--namespace", "ml"], "operator"),
    ],
)
def test_a_command_whose_extra_is_missing_says_what_to_install(
    missing: str, argv: list[str], extra: str
) -> None:
    """Without its extra, a command exits 2 with one line naming the install (issue 13)."""
    code = (
        f"import sys; sys.modules[{missing!r}] = None\n"
        "from ddpjob_operator.entry import main\n"
        f"sys.exit(main({argv!r}))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"error: `ddpjob {argv[0]}` needs the {missing!r} package, which is not installed: "
        f"pip install 'ddpjob[{extra}]'"
    ]
