"""Read DDPJob manifests from files: the YAML and file errors a person can act on."""

from __future__ import annotations

from pathlib import Path

import yaml

from ddpjob_operator import api
from ddpjob_operator.errors import ManifestError
from ddpjob_operator.parse import parse_job


def load_job_file(path: str | Path) -> api.DDPJob:
    """Read and validate one DDPJob from a YAML (or JSON) file.

    Raises :class:`ManifestError` for a missing/unreadable file or malformed YAML, and
    :class:`~ddpjob_operator.errors.SpecError` for an invalid spec.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ManifestError(f"{path}: no such file") from exc
    except IsADirectoryError as exc:
        raise ManifestError(f"{path}: is a directory, not a DDPJob manifest") from exc
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read it: {exc}") from exc
    try:
        documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise ManifestError(f"{path}: malformed YAML{where}: {problem}") from exc
    if len(documents) != 1:
        raise ManifestError(
            f"{path}: expected exactly one YAML document holding a DDPJob, found {len(documents)}"
        )
    return parse_job(documents[0], source=str(path))
