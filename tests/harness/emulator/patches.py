"""The three patch formats of the Kubernetes API: JSON merge, JSON (RFC 6902), strategic merge.

All functions return a new document and never modify their arguments.

Strategic merge patch (SMP) is done from a fixed table of list fields instead of the Go struct
tags of the real server: a list field whose name is in :data:`MERGE_KEYS` is merged element by
element on that key (``containers``/``env``/``volumes``... by ``name``, ``ownerReferences`` by
``uid``, pod ``conditions`` by ``type``...), a list field in :data:`SET_LISTS` (``finalizers``)
is merged as a set of primitives (union, order kept), and every other list is replaced, as in a
merge patch. The table is keyed by the field name only, wherever it occurs in the object.
Directives: ``$patch: delete`` (in a list element: remove the element with that key; in a map:
remove the map), ``$patch: replace`` (in a map: replace it; as a list element: replace the
whole list with the other elements), ``$deleteFromPrimitiveList/<field>``; ``$retainKeys`` and
``$setElementOrder/<field>`` are accepted and ignored. ``null`` deletes a key, as everywhere.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = [
    "MERGE_KEYS",
    "SET_LISTS",
    "PatchConflictError",
    "PatchError",
    "apply_json_patch",
    "apply_merge_patch",
    "apply_strategic_merge_patch",
]


class PatchError(ValueError):
    """A malformed patch, or one that cannot be applied (422 on a real server)."""


class PatchConflictError(PatchError):
    """A JSON-patch ``test`` operation failed."""


def apply_merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: dict[str, Any] = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = apply_merge_patch(result.get(key), value)
    return result


def _unescape(token: str) -> str:
    return token.replace("~1", "/").replace("~0", "~")


def _split_pointer(pointer: Any) -> list[str]:
    if not isinstance(pointer, str):
        raise PatchError(f"JSON pointer must be a string, got {pointer!r}")
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PatchError(f"JSON pointer must start with '/': {pointer!r}")
    return [_unescape(t) for t in pointer[1:].split("/")]


def _index(container: list[Any], token: str, *, for_add: bool) -> int:
    if token == "-" and for_add:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise PatchError(f"invalid array index {token!r}")
    idx = int(token)
    limit = len(container) if for_add else len(container) - 1
    if idx > limit:
        raise PatchError(f"array index {idx} out of range")
    return idx


def _resolve(doc: Any, tokens: list[str]) -> Any:
    cur = doc
    for token in tokens:
        if isinstance(cur, dict):
            if token not in cur:
                raise PatchError(f"path not found: missing key {token!r}")
            cur = cur[token]
        elif isinstance(cur, list):
            cur = cur[_index(cur, token, for_add=False)]
        else:
            raise PatchError(f"path not found at {token!r}")
    return cur


def _add(doc: Any, tokens: list[str], value: Any) -> Any:
    if not tokens:
        return value
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, last, for_add=True), value)
    else:
        raise PatchError(f"cannot add to a scalar at {last!r}")
    return doc


def _remove(doc: Any, tokens: list[str]) -> tuple[Any, Any]:
    if not tokens:
        raise PatchError("cannot remove the whole document")
    parent = _resolve(doc, tokens[:-1])
    last = tokens[-1]
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"cannot remove missing key {last!r}")
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, last, for_add=False))
    raise PatchError(f"cannot remove from a scalar at {last!r}")


def apply_json_patch(target: Any, ops: Any) -> Any:
    """RFC 6902 JSON patch: add, remove, replace, move, copy, test."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    doc = copy.deepcopy(target)
    for op in ops:
        if not isinstance(op, dict) or "op" not in op:
            raise PatchError(f"invalid operation {op!r}")
        kind = op["op"]
        path = _split_pointer(op.get("path"))
        if kind == "add":
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "remove":
            doc, _ = _remove(doc, path)
        elif kind == "replace":
            if not path:
                doc = copy.deepcopy(op.get("value"))
                continue
            _resolve(doc, path)  # must exist
            doc, _ = _remove(doc, path)
            doc = _add(doc, path, copy.deepcopy(op.get("value")))
        elif kind == "move":
            src = _split_pointer(op.get("from"))
            doc, value = _remove(doc, src)
            doc = _add(doc, path, value)
        elif kind == "copy":
            src = _split_pointer(op.get("from"))
            doc = _add(doc, path, copy.deepcopy(_resolve(doc, src)))
        elif kind == "test":
            try:
                actual = _resolve(doc, path)
            except PatchError as e:
                raise PatchConflictError(f"test failed: {e}") from e
            if actual != op.get("value"):
                raise PatchConflictError(
                    f"test failed: {op.get('path')} is {actual!r}, not {op.get('value')!r}"
                )
        else:
            raise PatchError(f"unknown operation {kind!r}")
    return doc


# Lists merged element by element on a key (from the Go struct tags of core/v1 and meta/v1).
MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "ownerReferences": "uid",
    "conditions": "type",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
}
# Lists of primitives merged as sets.
SET_LISTS: frozenset[str] = frozenset({"finalizers"})


def _ports_key(items: list[Any]) -> str | None:
    for item in items:
        if isinstance(item, dict):
            if "containerPort" in item:
                return "containerPort"
            if "port" in item:
                return "port"
    return None


def _merge_keyed_list(field: str, key: str, original: list[Any], patch: list[Any]) -> list[Any]:
    if any(isinstance(p, dict) and p.get("$patch") == "replace" for p in patch):
        return [copy.deepcopy(p) for p in patch if not (isinstance(p, dict) and "$patch" in p)]
    result = [copy.deepcopy(o) for o in original]
    positions = {o.get(key): i for i, o in enumerate(result) if isinstance(o, dict) and key in o}
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"{field}: every element needs the merge key {key!r}")
        k = item[key]
        if item.get("$patch") == "delete":
            if k in positions:
                result[positions[k]] = None
            continue
        if k in positions and result[positions[k]] is not None:
            result[positions[k]] = _smp(result[positions[k]], item)
        else:
            positions[k] = len(result)
            result.append(_smp({}, item))
    return [r for r in result if r is not None]


def _merge_set_list(original: list[Any], patch: list[Any]) -> list[Any]:
    result = list(original)
    for item in patch:
        if item not in result:
            result.append(item)
    return result


def _smp(original: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "delete":
        return None
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result: dict[str, Any] = copy.deepcopy(original) if isinstance(original, dict) else {}
    deletions: dict[str, list[Any]] = {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            deletions[key.split("/", 1)[1]] = value if isinstance(value, list) else [value]
            continue
        if key.startswith("$setElementOrder/") or key in ("$retainKeys", "$patch"):
            continue
        if value is None:
            result.pop(key, None)
            continue
        current = result.get(key)
        if isinstance(value, list) and isinstance(current, list):
            merge_key = MERGE_KEYS.get(key) or (
                _ports_key(current + value) if key == "ports" else None
            )
            if merge_key is not None:
                result[key] = _merge_keyed_list(key, merge_key, current, value)
            elif key in SET_LISTS:
                result[key] = _merge_set_list(current, value)
            else:
                result[key] = copy.deepcopy(value)
        elif isinstance(value, list):
            result[key] = [
                _smp({}, v) if isinstance(v, dict) else copy.deepcopy(v)
                for v in value
                if not (isinstance(v, dict) and v.get("$patch") in ("delete", "replace"))
            ]
        elif isinstance(value, dict):
            merged = _smp(current, value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        else:
            result[key] = value
    for field, values in deletions.items():
        if isinstance(result.get(field), list):
            result[field] = [v for v in result[field] if v not in values]
    return result


def apply_strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch from the fixed table described in the module docstring."""
    if not isinstance(patch, dict):
        raise PatchError("a strategic merge patch must be a JSON object")
    result = _smp(target, patch)
    return {} if result is None else result
