"""Write the DDPJob field reference, docs/reference/ddpjob.md, from the models.

The page is generated from what the API server is given: the CRD's openAPIV3Schema
(:mod:`ddpjob_operator.crd`, itself generated from the pydantic models of
:mod:`ddpjob_operator.api`), with the models' docstrings for the objects. So every field, type,
default, range and allowed value on the page is the CRD's, and the page cannot drift from it
unnoticed: ``tests/unit/test_docs_reference.py`` fails when the committed page differs.

Usage::

    python hack/gen_reference.py           # rewrite docs/reference/ddpjob.md
    python hack/gen_reference.py --check   # exit 1 if the committed page is stale
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic

from ddpjob_operator import api, crd

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "ddpjob.md"

JSON = Mapping[str, Any]

# Fields whose model has no description yet: a line of our own, so that no row is blank. A
# description given in the model wins; a note naming a field that no longer exists is an error.
NOTES = {
    "spec.template.spec.containers[].name": (
        "The container's name (the first container is the trainer)."
    ),
    "spec.template.spec.containers[].command": (
        "The entrypoint: `ddpjob-agent ...` or `torchrun ...`; the image's entrypoint when unset."
    ),
    "spec.template.spec.containers[].args": "Arguments to the command.",
    "spec.template.spec.containers[].env": (
        "Environment variables; the operator adds its own contract to them."
    ),
    "spec.template.spec.containers[].env[].name": "The variable's name.",
    "spec.template.spec.containers[].env[].value": "The variable's value.",
    "spec.template.metadata.labels": (
        "Labels for every pod (ddpjob adds its own `ddpjob.io/*` labels)."
    ),
    "spec.template.metadata.annotations": "Annotations for every pod.",
    "status.phase": "Where the job is in its lifecycle (above).",
    "status.conditions": "Kubernetes-style conditions (below).",
    "status.observedGeneration": "The `metadata.generation` this status was decided from.",
    "status.selector": "The label selector of the job's pods, for the scale subresource and HPA.",
    "status.startTime": (
        "When the job first ran; cleared by a suspend. `activeDeadlineSeconds` counts from it."
    ),
    "status.completionTime": "When the job finished.",
    "status.belowMinSince": (
        "Since when the job, having run, has fewer than `minReplicas` running pods;"
        " `rendezvous.joinTimeoutSeconds` later it fails."
    ),
    "status.conditions[].type": "The condition's type.",
    "status.conditions[].status": "Whether the condition holds.",
    "status.conditions[].reason": "A CamelCase word for why.",
    "status.conditions[].message": "A sentence for people.",
    "status.conditions[].lastTransitionTime": "When `status` last changed.",
    "status.failures[].pod": "The pod's name.",
    "status.failures[].index": "The pod's index.",
    "status.failures[].uid": "The pod's uid.",
    "status.failures[].reason": "The classified reason.",
    "status.failures[].exitCode": "The trainer's exit code, when it has one.",
    "status.failures[].message": "The trainer's termination message, or the pod's status message.",
    "status.failures[].node": "The node the pod ran on.",
    "status.failures[].charged": "Whether it counted against `backoffLimit`.",
    "status.failures[].started": "Whether the trainer had started.",
    "status.failures[].time": "When the trainer ended.",
    "status.waiting[].pod": "The pod's name.",
    "status.waiting[].reason": (
        "Why it waits: the kubelet's or the scheduler's reason, or ddpjob's."
    ),
    "status.waiting[].message": "The message that came with the reason.",
    "status.waiting[].index": "The pod's index.",
    "status.podBackoff[].index": "The pod index.",
}

# Values the models write where the schema accepts any string (read leniently).
WRITTEN: dict[str, Sequence[str]] = {
    "status.conditions[].type": [c.value for c in api.ConditionType],
}

_PASSED_ON = re.compile(r"^core/v1 (\w+)\.\w+, passed to the pods as it is\.$")


@dataclass(frozen=True)
class Section:
    """One object of the schema: its path, its anchor, its description, its fields."""

    path: str
    node: JSON
    model: type[pydantic.BaseModel] | None


def anchor(path: str) -> str:
    """The page's anchor for an object: ``spec.rendezvous`` -> ``spec-rendezvous``."""
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def markdown(text: str) -> str:
    """A docstring's reStructuredText, the few forms the models use, as Markdown."""
    text = re.sub(r":(?:class|mod|func|data|attr|meth):`~?([^`]+)`", r"`\1`", text)
    text = re.sub(r"``([^`]+)``", r"`\1`", text)
    out: list[str] = []
    literal = False
    for line in text.splitlines():
        if literal:
            if line.strip() and not line.startswith(" "):
                _close(out)
                literal = False
            else:
                out.append(line[4:] if line.startswith("    ") else line)
                continue
        if line.rstrip().endswith("::"):
            out.append(line.rstrip()[:-1])
            out.append("")
            out.append("```text")
            literal = True
            continue
        out.append(line)
    if literal:
        _close(out)
    return re.sub(r"```text\n\n+", "```text\n", "\n".join(out)).strip()


def _close(out: list[str]) -> None:
    """End a literal block: no blank line inside the fence, one after it."""
    while out and not out[-1].strip():
        out.pop()
    out += ["```", ""]


def cell(text: str) -> str:
    """A description as one table cell: paragraphs and bullets joined by line breaks."""
    parts: list[str] = []
    for paragraph in re.split(r"\n\s*\n", markdown(text)):
        items: list[str] = []
        for line in paragraph.splitlines():
            stripped = line.strip()
            if stripped.startswith(("* ", "- ")):
                items.append("• " + stripped[2:])
            elif items:
                items[-1] += " " + stripped
            else:
                items.append(stripped)
        parts.append("<br>".join(items))
    return _escape_pipes("<br>".join(p for p in parts if p))


def _escape_pipes(text: str) -> str:
    """Escape the pipes that would end a table cell: those outside code spans (Python-Markdown
    reads a pipe inside backticks as text, and shows an escaped one as a backslash)."""
    pieces = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else p.replace("|", "\\|") for p in pieces)


def code(value: Any) -> str:
    shown = value if isinstance(value, str) and value else json.dumps(value)
    return f"`{shown}`"


def is_object(node: JSON) -> bool:
    return node.get("type") == "object" and "properties" in node


def item_of(node: JSON) -> JSON | None:
    items = node.get("items")
    return items if isinstance(items, Mapping) else None


def passed_on(node: JSON) -> str | None:
    """The core/v1 kind of a field ddpjob passes to the pods unread, else None."""
    match = _PASSED_ON.match(str(node.get("description", "")))
    return match.group(1) if match else None


def type_of(path: str, node: JSON) -> str:
    item = item_of(node)
    if node.get("x-kubernetes-int-or-string"):
        return "integer or string"
    if node.get("type") == "array" and item is not None:
        if is_object(item):
            return f"array of [objects](#{anchor(path + '[]')})"
        return f"array of {type_of(path + '[]', item)}s"
    if is_object(node):
        return f"[object](#{anchor(path)})"
    if node.get("type") == "object" and isinstance(node.get("additionalProperties"), Mapping):
        return f"map of string to {node['additionalProperties'].get('type', 'any')}"
    if node.get("format") == "date-time":
        return "string (date-time)"
    return str(node.get("type", "any"))


def default_of(name: str, node: JSON, required: Sequence[str]) -> str:
    if name in required:
        return "required"
    if "default" in node:
        return code(node["default"])
    if is_object(node):
        return "its fields'"
    return "unset"


def allowed_of(path: str, node: JSON) -> str:
    rules: list[str] = []
    if "enum" in node:
        rules.append(", ".join(code(v) for v in node["enum"]))
    if path in WRITTEN:
        rules.append("any; ddpjob writes " + ", ".join(code(v) for v in WRITTEN[path]))
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None and high is not None:
        rules.append(f"{low} to {high}")
    elif low is not None:
        rules.append(f"≥ {low}")
    elif high is not None:
        rules.append(f"≤ {high}")
    short, long = node.get("minLength"), node.get("maxLength")
    if short is not None and long is not None:
        rules.append(f"{short} to {long} characters")
    elif short is not None:
        rules.append(f"at least {short} character{'s' if short != 1 else ''}")
    elif long is not None:
        rules.append(f"at most {long} characters")
    if "minItems" in node:
        rules.append(f"at least {node['minItems']} item{'s' if node['minItems'] != 1 else ''}")
    if "pattern" in node:
        rules.append(f"pattern {code(node['pattern'])}")
    for rule in node.get("x-kubernetes-validations", []):
        if "fieldPath" not in rule:
            rules.append(cell(str(rule["message"])))
    return "; ".join(rules)


def description_of(path: str, node: JSON) -> str:
    text = str(node.get("description", "")) or NOTES.get(path, "")
    if is_object(node):  # its own section has the rest
        text = re.split(r"\n\s*\n", text, maxsplit=1)[0]
    return cell(text)


def model_of(annotation: Any) -> type[pydantic.BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = model_of(arg)
        if found is not None:
            return found
    return None


def field_model(
    model: type[pydantic.BaseModel] | None, alias: str
) -> type[pydantic.BaseModel] | None:
    if model is None:
        return None
    for name, info in model.model_fields.items():
        if (info.alias or name) == alias:
            return model_of(info.annotation)
    return None


def sections(path: str, node: JSON, model: type[pydantic.BaseModel] | None) -> Iterator[Section]:
    """Every object of the schema that ddpjob reads, parents first."""
    yield Section(path, node, model)
    for name, child in node.get("properties", {}).items():
        if passed_on(child):
            continue
        child_path = f"{path}.{name}"
        child_model = field_model(model, name)
        if is_object(child):
            yield from sections(child_path, child, child_model)
        item = item_of(child)
        if item is not None and is_object(item):
            yield from sections(child_path + "[]", item, child_model)


def every_path(path: str, node: JSON) -> Iterator[str]:
    yield path
    for name, child in node.get("properties", {}).items():
        yield from every_path(f"{path}.{name}", child)
    item = item_of(node)
    if item is not None:
        yield from every_path(path + "[]", item)


def validations(path: str, node: JSON) -> Iterator[tuple[str, str]]:
    """Every CEL rule of the schema: the field it names, and its message."""
    for rule in node.get("x-kubernetes-validations", []):
        yield path + str(rule.get("fieldPath", "")), str(rule["message"])
    for name, child in node.get("properties", {}).items():
        yield from validations(f"{path}.{name}", child)
    item = item_of(node)
    if item is not None:
        yield from validations(path + "[]", item)


def render_section(section: Section) -> list[str]:
    node = section.node
    intro = section.model.__doc__ if section.model is not None and section.model.__doc__ else ""
    intro = intro or str(node.get("description", ""))
    lines = [f"## {section.path} {{#{anchor(section.path)}}}", ""]
    if intro:
        lines += [markdown(_dedent(intro)), ""]
    required = list(node.get("required", []))
    rows = [
        "| Field | Type | Default | Allowed | Description |",
        "|---|---|---|---|---|",
    ]
    passed: dict[str, list[str]] = {}
    for name, child in node.get("properties", {}).items():
        kind = passed_on(child)
        if kind is not None:
            passed.setdefault(kind, []).append(name)
            continue
        child_path = f"{section.path}.{name}"
        rows.append(
            f"| `{name}` | {type_of(child_path, child)} | {default_of(name, child, required)}"
            f" | {allowed_of(child_path, child)} | {description_of(child_path, child)} |"
        )
    lines += [*rows, ""]
    for kind, names in passed.items():
        lines += [
            f"The other core/v1 {kind} fields are accepted and passed to the pods as they are"
            " (declared in the CRD, so that a change to them is seen): "
            + ", ".join(f"`{n}`" for n in names)
            + ".",
            "",
        ]
    return lines


def _dedent(text: str) -> str:
    first, _, rest = text.partition("\n")
    indents = [len(line) - len(line.lstrip()) for line in rest.splitlines() if line.strip()]
    cut = min(indents, default=0)
    return "\n".join([first.strip(), *(line[cut:] for line in rest.splitlines())]).strip()


def render() -> str:
    """The whole page."""
    schema = crd.openapi_schema()
    definition = crd.custom_resource_definition()["spec"]
    version = definition["versions"][0]
    names = definition["names"]
    scale = version["subresources"]["scale"]
    properties = schema["properties"]
    known = set(every_path("spec", properties["spec"])) | set(
        every_path("status", properties["status"])
    )
    unknown = sorted(set(NOTES) - known)
    if unknown:
        raise SystemExit(f"hack/gen_reference.py: NOTES name fields that do not exist: {unknown}")
    name_rule = properties["metadata"]["properties"]["name"]
    out = [
        "<!-- Generated by hack/gen_reference.py from ddpjob_operator.api and"
        " ddpjob_operator.crd; do not edit: `make docs-reference` rewrites it. -->",
        "",
        f"# DDPJob reference (`{api.API_VERSION}`)",
        "",
        "Every field of the DDPJob resource, as the CRD that `ddpjob crd` prints declares it"
        " (the CRD is generated from the models of `ddpjob_operator.api`). The rules around the"
        " fields, with examples, are in [the API guide](index.md).",
        "",
        markdown(_dedent((api.__doc__ or "").partition("\n")[2])),
        "",
        "## The resource {#the-resource}",
        "",
        "| | |",
        "|---|---|",
        f"| API version | `{definition['group']}/{version['name']}` |",
        f"| Kind | `{names['kind']}` (list: `{names['listKind']}`) |",
        f"| Plural, singular, short name | `{names['plural']}`, `{names['singular']}`,"
        f" `{', '.join(names['shortNames'])}` |",
        f"| Scope | {definition['scope']} |",
        f"| Categories | {', '.join(code(c) for c in names['categories'])} |",
        f"| Subresources | `status`; `scale` (replicas `{scale['specReplicasPath']}`, status"
        f" `{scale['statusReplicasPath']}`, selector `{scale['labelSelectorPath']}`) |",
        f"| `metadata.name` | {allowed_of('metadata.name', name_rule)} |",
        "",
        "`kubectl get ddpj` shows these columns (`-o wide` adds those of priority 1):",
        "",
        "| Column | From | Priority |",
        "|---|---|---|",
        *(
            f"| {c['name']} | `{c['jsonPath']}` | {c.get('priority', 0)} |"
            for c in version["additionalPrinterColumns"]
        ),
        "",
        "## Rules the API server checks {#rules}",
        "",
        "CEL rules of the CRD, checked on every create and update (`ddpjob validate` checks"
        " the same):",
        "",
        "| Field | Message when broken |",
        "|---|---|",
        *(
            f"| `{field}` | {cell(message)} |"
            for field, message in validations("spec", properties["spec"])
        ),
        "",
    ]
    for top, model in (("spec", api.DDPJobSpec), ("status", api.DDPJobStatus)):
        for section in sections(top, properties[top], model):
            out += render_section(section)
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page differs")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(
                f"{PAGE.relative_to(ROOT)} is stale: run `python hack/gen_reference.py`"
                " (or `make docs-reference`)",
                file=sys.stderr,
            )
            return 1
        return 0
    PAGE.parent.mkdir(parents=True, exist_ok=True)
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
