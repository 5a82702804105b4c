"""Label and field selectors, parsed the way the Kubernetes API server parses them.

Label selectors: ``a=b``, ``a==b``, ``a!=b``, ``a`` (exists), ``!a`` (does not exist),
``a in (x,y)``, ``a notin (x)``; a comma joins requirements with AND.
Field selectors: ``path=value``, ``path==value``, ``path!=value``, comma = AND; the path is a
dotted path into the object (``metadata.name``, ``status.phase``, ``spec.nodeName``...).
Unlike a real server, any dotted path is accepted (a real server answers 400 for fields that
a resource does not index); a missing field compares as the empty string, as it does there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FieldRequirement",
    "LabelRequirement",
    "SelectorError",
    "match_fields",
    "match_labels",
    "parse_field_selector",
    "parse_label_selector",
]


class SelectorError(ValueError):
    """A selector that cannot be parsed (the server answers 400 BadRequest)."""


@dataclass(frozen=True, slots=True)
class LabelRequirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        # "!=" and "notin" match objects without the label too, as on a real server.
        return not present or labels[self.key] not in self.values


@dataclass(frozen=True, slots=True)
class FieldRequirement:
    path: tuple[str, ...]
    negated: bool
    value: str

    def matches(self, obj: Mapping[str, Any]) -> bool:
        cur: Any = obj
        for part in self.path:
            cur = cur.get(part) if isinstance(cur, Mapping) else None
        actual = "" if cur is None else (str(cur).lower() if isinstance(cur, bool) else str(cur))
        return (actual != self.value) if self.negated else (actual == self.value)


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_KEY_RE = re.compile(rf"^{_KEY}$")
_VALUE_RE = re.compile(rf"^{_VALUE}$")
_SET_RE = re.compile(rf"^\s*({_KEY})\s+(in|notin)\s+\((.*)\)\s*$")
_EQ_RE = re.compile(r"^\s*([^=!\s]+)\s*(==|=|!=)\s*(\S*)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unbalanced parentheses in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise SelectorError(f"unbalanced parentheses in {text!r}")
    parts.append("".join(cur))
    return parts


def _check_key(key: str) -> str:
    if not _KEY_RE.match(key):
        raise SelectorError(f"invalid label key {key!r}")
    return key


def _check_value(value: str) -> str:
    if not _VALUE_RE.match(value) or len(value) > 63:
        raise SelectorError(f"invalid label value {value!r}")
    return value


def parse_label_selector(text: str | None) -> list[LabelRequirement]:
    """Parse a label selector; an empty or missing one matches everything."""
    if not text or not text.strip():
        return []
    reqs: list[LabelRequirement] = []
    for raw in _split_top_level(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"empty requirement in {text!r}")
        if m := _SET_RE.match(part):
            key, op, inner = m.group(1), m.group(3), m.group(4)
            values = frozenset(_check_value(v.strip()) for v in inner.split(",") if v.strip())
            if op == "in" and not values:
                raise SelectorError(f"{part!r}: 'in' needs at least one value")
            reqs.append(LabelRequirement(key, op, values))
        elif m := _EQ_RE.match(part):
            key, op, value = _check_key(m.group(1)), m.group(2), _check_value(m.group(3))
            reqs.append(LabelRequirement(key, "!=" if op == "!=" else "=", frozenset({value})))
        elif part.startswith("!"):
            reqs.append(LabelRequirement(_check_key(part[1:].strip()), "!"))
        else:
            reqs.append(LabelRequirement(_check_key(part), "exists"))
    return reqs


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    """Parse a field selector; an empty or missing one matches everything."""
    if not text or not text.strip():
        return []
    reqs: list[FieldRequirement] = []
    for raw in text.split(","):
        m = _EQ_RE.match(raw)
        if not m:
            raise SelectorError(f"invalid field selector requirement {raw!r}")
        path, op, value = m.group(1), m.group(2), m.group(3)
        reqs.append(FieldRequirement(tuple(path.split(".")), op == "!=", value))
    return reqs


def match_labels(reqs: list[LabelRequirement], obj: Mapping[str, Any]) -> bool:
    if not reqs:
        return True
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in reqs)


def match_fields(reqs: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all(r.matches(obj) for r in reqs)
