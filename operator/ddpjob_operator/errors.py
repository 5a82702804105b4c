"""ddpjob's own errors. Third-party errors are wrapped at the edge with ``raise ... from exc``.

Every error a user can cause names the field as a dotted path
(``spec.template.spec.containers[0].image``) and says what would be valid.
"""

from __future__ import annotations

import dataclasses

EXIT_OK = 0
EXIT_JOB_FAILED = 1
"""``ddpjob run``: the job ended Failed."""
EXIT_BAD_INPUT = 2
"""A file, YAML, spec or command line that ddpjob cannot use (argparse's own code too)."""
EXIT_INTERRUPTED = 130
"""Ctrl-C (128 + SIGINT, as a shell reports it)."""


class DDPJobError(Exception):
    """Base class of every error ddpjob raises on purpose."""


@dataclasses.dataclass(frozen=True)
class FieldProblem:
    """One thing wrong with one field."""

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path or '<document>'}: {self.message}"


class SpecError(DDPJobError):
    """A DDPJob manifest is not valid. Holds every problem found, not just the first."""

    def __init__(self, source: str, problems: list[FieldProblem]) -> None:
        self.source = source
        self.problems = problems
        lines = [f"{source}: invalid DDPJob ({len(problems)} problem{'s' * (len(problems) != 1)})"]
        lines += [f"  - {problem}" for problem in problems]
        super().__init__("\n".join(lines))


class ManifestError(DDPJobError):
    """A manifest file cannot be read or parsed (missing file, malformed YAML)."""
