"""Static checks of the root Dockerfile (docs/images.md): cheap guards, no docker needed.

The image builds themselves (``make images-offline``) need root and a Docker daemon, so they are
not part of ``make test``; this only reads the Dockerfile, .dockerignore and the Makefile.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
NON_ROOT_UID = "65532"  # the Helm chart's securityContext.runAsUser


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None

    def copied_from(self) -> list[str]:
        stages = []
        for args in self.all("COPY"):
            match = re.search(r"--from=(\S+)", args)
            if match:
                stages.append(match.group(1))
        return stages


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: dict[str, Stage]
    order: list[str]


def logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comment lines dropped (also inside a
    continuation, as Docker does)."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse(text: str) -> Dockerfile:
    global_args: dict[str, str | None] = {}
    stages: dict[str, Stage] = {}
    order: list[str] = []
    stage: Stage | None = None
    for line in logical_lines(text):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            match = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)\s+AS\s+(\S+)", args, re.IGNORECASE)
            assert match, f"every FROM names its stage: FROM {args}"
            stage = Stage(name=match.group(2), base=match.group(1))
            assert stage.name not in stages, f"stage {stage.name} defined twice"
            stages[stage.name] = stage
            order.append(stage.name)
        elif stage is None:
            assert keyword == "ARG", f"only ARG may come before the first FROM, not {keyword}"
            name, _, default = args.partition("=")
            global_args[name] = default or None
        else:
            stage.instructions.append((keyword, args))
    return Dockerfile(global_args=global_args, stages=stages, order=order)


def chain(dockerfile: Dockerfile, name: str) -> list[Stage]:
    """The stage, the stages it is built FROM, and the stages it COPYs from, transitively."""
    seen: list[Stage] = []
    todo = [name]
    while todo:
        current = todo.pop()
        if current not in dockerfile.stages or any(s.name == current for s in seen):
            continue
        stage = dockerfile.stages[current]
        seen.append(stage)
        todo.append(stage.base)
        todo.extend(stage.copied_from())
    return seen


def pip_installs(stage: Stage) -> list[str]:
    """Every ``pip install`` command of the stage's RUN lines (split on ; && ||)."""
    commands = []
    for run in stage.all("RUN"):
        for part in re.split(r";|&&|\|\|", run):
            if re.search(r"\bpip\s+install\b", part):
                commands.append(part.strip())
    return commands


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse(DOCKERFILE.read_text())


def test_the_three_targets_exist(dockerfile: Dockerfile) -> None:
    for target in ("operator", "worker-cpu", "worker-cuda"):
        assert target in dockerfile.stages


def test_base_images_are_build_args_with_public_defaults(dockerfile: Dockerfile) -> None:
    assert dockerfile.global_args.get("PYTHON_BASE"), "PYTHON_BASE needs a default"
    cuda = dockerfile.global_args.get("CUDA_BASE")
    assert cuda, "CUDA_BASE needs a default"
    # The agent refuses an untested torch: the CUDA base must bring the tested minor release.
    assert re.fullmatch(r"pytorch/pytorch:2\.13\.\d+-cuda[\d.]+-cudnn\d+-runtime", cuda), cuda
    for stage in dockerfile.stages.values():
        if stage.base in dockerfile.stages:
            continue
        arg = re.fullmatch(r"\$\{?(\w+)\}?", stage.base)
        assert arg, f"stage {stage.name} is FROM a literal image {stage.base}: use a build arg"
        assert arg.group(1) in dockerfile.global_args


def test_one_builder_stage_builds_the_wheel(dockerfile: Dockerfile) -> None:
    wheel_builds = [
        stage.name
        for stage in dockerfile.stages.values()
        if any(re.search(r"\bpip\s+wheel\b", run) for run in stage.all("RUN"))
    ]
    assert wheel_builds == ["builder"]
    for target in ("operator", "worker-cpu", "worker-cuda"):
        assert "builder" in {s.name for s in chain(dockerfile, target)}, target


def test_operator_stage_has_no_torch_and_runs_as_65532(dockerfile: Dockerfile) -> None:
    stages = chain(dockerfile, "operator")
    installs = [command for stage in stages for command in pip_installs(stage)]
    assert installs, "the operator's chain installs ddpjob[operator] somewhere"
    assert any("[operator]" in command for command in installs)
    for command in installs:
        assert "torch" not in command, command
        assert "[worker" not in command and "[local" not in command, command
    operator = dockerfile.stages["operator"]
    assert operator.last("USER") in (NON_ROOT_UID, f"{NON_ROOT_UID}:{NON_ROOT_UID}")
    entrypoint = operator.last("ENTRYPOINT")
    assert entrypoint is not None
    assert json.loads(entrypoint) == ["ddpjob", "operator"]


def test_worker_cpu_runs_as_non_root_with_the_examples(dockerfile: Dockerfile) -> None:
    worker = dockerfile.stages["worker-cpu"]
    assert worker.last("USER") in (NON_ROOT_UID, f"{NON_ROOT_UID}:{NON_ROOT_UID}")
    assert any(
        args.split()[-1].rstrip("/") == "/opt/ddpjob/examples" for args in worker.all("COPY")
    )
    installs = [c for stage in chain(dockerfile, "worker-cpu") for c in pip_installs(stage)]
    assert any("[worker]" in command for command in installs)
    assert not any("[operator" in command or "[local" in command for command in installs)
    # Online, torch comes from the CPU wheel index (an unpinned PyPI torch is the CUDA build).
    assert "download.pytorch.org/whl/cpu" in " ".join(
        args for stage in chain(dockerfile, "worker-cpu") for args in stage.all("ARG")
    )


def test_worker_cuda_keeps_the_base_torch(dockerfile: Dockerfile) -> None:
    cuda = dockerfile.stages["worker-cuda"]
    assert cuda.base in ("${CUDA_BASE}", "$CUDA_BASE")
    installs = pip_installs(cuda)
    assert installs
    for command in installs:
        assert "--no-deps" in command and "torch" not in command, command


def test_the_cuda_stage_comes_last(dockerfile: Dockerfile) -> None:
    """The classic builder builds every stage before the target: a CUDA base pulled (or missing)
    for the operator or worker-cpu build would make them slow (or impossible offline)."""
    assert dockerfile.order[-1] == "worker-cuda"


def test_dockerignore_keeps_the_context_small() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "a whitelist: .git, .venv, caches and run directories stay out"
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    assert {"pyproject.toml", "README.md", "operator", "worker", "examples"} <= included
    assert not included & {".git", ".venv", ".ddpjob", ".images"}


def test_make_images_offline_exists_and_is_not_part_of_make_test() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^images-offline:", makefile, re.MULTILINE)
    test_rule = re.search(r"^test:[^\n]*\n((?:\t[^\n]*\n)*)", makefile, re.MULTILINE)
    assert test_rule
    recipe = test_rule.group(1)
    assert "images" not in recipe and "docker" not in recipe
    script = ROOT / "scripts" / "images-offline.sh"
    assert script.stat().st_mode & 0o111, "scripts/images-offline.sh must be executable"


def test_parser_joins_continuations_and_skips_comments() -> None:
    parsed = parse("ARG BASE=x:1\nFROM ${BASE} AS a\nRUN one \\\n  # a comment\n  two\nUSER 1:1\n")
    assert parsed.stages["a"].all("RUN") == ["one two"]
    assert parsed.global_args == {"BASE": "x:1"}
