"""Generate the DDPJob CustomResourceDefinition from the pydantic models.

pydantic writes JSON Schema (draft 2020-12: ``$ref``/``$defs``, ``anyOf: [X, null]``);
the API server wants a *structural* OpenAPI v3 schema: every node typed, no ``$ref``, no
``anyOf`` with null, no ``additionalProperties`` next to ``properties``, and int-or-string as
``x-kubernetes-int-or-string``. :func:`structural` does that translation, and
:func:`structural_problems` checks the result (tests run it: kubernetes-validate does not).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from ddpjob_operator import api

JSON = dict[str, Any]

_DROP = {"title", "$schema", "discriminator"}


def _inline(node: Any, defs: JSON) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**target, **extra}, defs)
    return {key: _inline(value, defs) for key, value in node.items()}


def _is_null(node: Any) -> bool:
    return isinstance(node, dict) and node.get("type") == "null"


def _structural_node(node: JSON) -> JSON:
    node = {k: v for k, v in node.items() if k not in _DROP}
    for key in ("anyOf", "oneOf"):
        if key not in node:
            continue
        branches = [b for b in node.pop(key) if not _is_null(b)]
        types = {b.get("type") for b in branches}
        if len(branches) == 1:
            node = {**branches[0], **node}
        elif types == {"integer", "string"}:
            node["x-kubernetes-int-or-string"] = True
        else:
            raise ValueError(f"cannot express {key} over {sorted(map(str, types))} structurally")
        if node.get("default", 0) is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    if isinstance(node.get("default"), dict | list):
        del node["default"]  # nested defaults come from the models; keep the CRD's simple
    if node.get("additionalProperties") is True:
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "properties" in node:
        node.pop("additionalProperties", None)
        node["properties"] = {k: _structural_node(v) for k, v in node["properties"].items()}
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural_node(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = _structural_node(node["items"])
    if "type" not in node and "properties" in node:
        node["type"] = "object"
    if "type" not in node and "enum" in node:
        node["type"] = "string"
    return node


def structural(model_schema: JSON) -> JSON:
    """Translate one pydantic JSON schema into a structural OpenAPI v3 schema."""
    schema = copy.deepcopy(model_schema)
    defs = schema.pop("$defs", {})
    return _structural_node(_inline(schema, defs))


def _walk(node: Any, path: str) -> Iterator[tuple[str, JSON]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def structural_problems(schema: JSON) -> list[str]:
    """What a real API server would reject as non-structural (empty when the schema is fine)."""
    problems = []
    for path, node in _walk(schema, ""):
        for banned in ("$ref", "anyOf", "oneOf", "allOf", "not", "const", "$defs", "nullable"):
            if banned in node:
                problems.append(f"{path or '.'}: uses {banned}")
        untyped_ok = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        if "type" not in node and not untyped_ok:
            problems.append(f"{path or '.'}: has no type")
        if "properties" in node and "additionalProperties" in node:
            problems.append(f"{path or '.'}: has both properties and additionalProperties")
        if "default" in node and node["default"] is None:
            problems.append(f"{path or '.'}: has a null default")
        bound = node.get("exclusiveMinimum")
        if isinstance(bound, int | float) and not isinstance(bound, bool):
            problems.append(f"{path or '.'}: numeric exclusiveMinimum (OpenAPI v3 wants a bool)")
    return problems


def openapi_schema() -> JSON:
    """The openAPIV3Schema of the DDPJob CRD."""
    spec = structural(api.DDPJobSpec.model_json_schema(by_alias=True, mode="validation"))
    status = structural(api.DDPJobStatus.model_json_schema(by_alias=True, mode="serialization"))
    spec["description"] = "What the user asks for. docs/reference/ddpjob.md has every field."
    status["description"] = "What the operator observed. Written by the operator only."
    return {
        "type": "object",
        "description": "An elastic PyTorch DDP training job.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "maxLength": api.MAX_JOB_NAME,
                        "pattern": api.JOB_NAME_PATTERN,
                    }
                },
            },
            "spec": spec,
            "status": status,
        },
    }


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas"},
    {"name": "World", "type": "integer", "jsonPath": ".status.worldSize"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
    {"name": "Store", "type": "string", "jsonPath": ".status.storeHost", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def custom_resource_definition() -> JSON:
    """The whole CRD object, as ``ddpjob crd`` prints it."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": [api.SHORT_NAME],
                # Not in "all": `kubectl delete all --all` must not delete training jobs (their
                # pods, which it deletes too, are replaced; a deleted job is gone).
                "categories": ["ddpjob"],
            },
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                }
            ],
        },
    }
