"""Parsing a manifest into a :class:`~ddpjob_operator.api.DDPJob`, with errors a person can
act on: every problem names its field path and, where it can, the fix."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic

from ddpjob_operator.api import API_VERSION, KIND, MAX_JOB_NAME, DDPJob
from ddpjob_operator.errors import FieldProblem, SpecError

_HINTS = {
    "metadata.name": (
        f"use a lowercase DNS label of at most {MAX_JOB_NAME} characters, e.g. 'mnist-ddp' "
        "(pod names are <name>-worker-<index>)"
    ),
    "spec.template.spec.containers": "give at least one container; the first one is the trainer",
    "apiVersion": f"use apiVersion: {API_VERSION}",
    "kind": f"use kind: {KIND}",
}


_UNION_TAG = re.compile(r"^(constrained-|function-|literal\[)")


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("int", "str") or _UNION_TAG.match(part):
            continue  # pydantic's union-branch and validator tags, not field names
        else:
            out += f".{part}" if out else str(part)
    return out


def _allowed_fields(root: type[pydantic.BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    model: type[pydantic.BaseModel] | None = root
    for part in loc[:-1]:
        if model is None or isinstance(part, int):
            continue
        field = next((f for f in model.model_fields.values() if f.alias == part), None)
        if field is None:
            return []
        model = _model_of(field.annotation)
    if model is None:
        return []
    return sorted(f.alias or name for name, f in model.model_fields.items())


def _model_of(annotation: Any) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _problem(error: Mapping[str, Any]) -> FieldProblem:
    loc = tuple(error["loc"])
    path = _path(loc)
    kind = error["type"]
    if kind == "extra_forbidden":
        allowed = _allowed_fields(DDPJob, loc)
        hint = f"; valid fields here: {', '.join(allowed)}" if allowed else ""
        return FieldProblem(path, f"unknown field{hint}")
    if kind == "missing":
        return FieldProblem(path, "required field is missing" + _hint(path))
    if path == "spec.nprocPerNode":
        return FieldProblem(path, f"must be an integer >= 1 or 'auto' (got {error.get('input')!r})")
    message = str(error["msg"]).removeprefix("Value error, ")
    given = error.get("input")
    got = "" if isinstance(given, Mapping | list) else f" (got {given!r})"
    return FieldProblem(path, f"{message}{got}{_hint(path)}")


def _hint(path: str) -> str:
    generic = re.sub(r"\[\d+\]", "", path)
    hint = _HINTS.get(path) or _HINTS.get(generic)
    return f": {hint}" if hint else ""


def parse_job(document: object, source: str = "<input>") -> DDPJob:
    """Validate a manifest (already parsed from YAML/JSON) into a :class:`DDPJob`.

    Raises :class:`SpecError` listing every problem with its field path.
    """
    if not isinstance(document, Mapping):
        raise SpecError(
            source,
            [FieldProblem("", f"expected a DDPJob mapping, got {type(document).__name__}")],
        )
    try:
        return DDPJob.model_validate(document)
    except pydantic.ValidationError as exc:
        problems: list[FieldProblem] = []
        for error in exc.errors():
            problem = _problem(error)
            if problem not in problems:
                problems.append(problem)
        raise SpecError(source, problems) from exc


def parse_job_lenient(document: object, source: str = "<input>") -> tuple[DDPJob, list[str]]:
    """:func:`parse_job` for the operator: fields this version does not know are ignored (and
    returned, as paths), the way Kubernetes clients skip fields of a newer API.

    A newer CRD defaults its new fields on every read, so an operator that refused unknown
    fields would find every job invalid after the CRD upgrade. Every other problem still
    raises :class:`SpecError`.
    """
    if not isinstance(document, Mapping):
        return parse_job(document, source), []
    data = copy.deepcopy(dict(document))
    ignored: list[str] = []
    for _ in range(32):  # each round drops what the last validation reported
        try:
            return DDPJob.model_validate(data), ignored
        except pydantic.ValidationError as exc:
            extra = [e["loc"] for e in exc.errors() if e["type"] == "extra_forbidden"]
            if not extra:
                break
            for loc in extra:
                if _drop(data, loc):
                    ignored.append(_path(tuple(loc)))
    return parse_job(data, source), ignored


def _drop(data: Any, loc: Sequence[int | str]) -> bool:
    """Delete the value at ``loc`` (pydantic's union tags, which are no keys, are skipped)."""
    node = data
    for part in loc[:-1]:
        in_map = isinstance(node, Mapping) and part in node
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if in_map or in_list:
            node = node[part]
    last = loc[-1]
    if isinstance(node, dict) and last in node:
        del node[last]
        return True
    return False
