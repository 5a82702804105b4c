"""The CRD: generated from the models, structural, valid for Kubernetes, kept in sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jsonschema
import kubernetes_validate
import pytest
import yaml
from hypothesis import given, settings

from ddpjob_operator import api, crd
from ddpjob_operator.cli import render_crd
from ddpjob_operator.errors import SpecError

from .jobs import manifest

ROOT = Path(__file__).resolve().parents[2]
COPIES = [
    ROOT / "deploy" / "crd.yaml",
    ROOT / "charts" / "ddpjob" / "crds" / "ddpjob.io_ddpjobs.yaml",
]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def schema() -> dict[str, Any]:
    version = crd.custom_resource_definition()["spec"]["versions"][0]
    return dict(version["schema"]["openAPIV3Schema"])


@pytest.mark.parametrize("copy", COPIES, ids=lambda p: str(p.relative_to(ROOT)))
def test_checked_in_copies_match_the_generated_crd(copy: Path) -> None:
    assert copy.read_text() == render_crd(), f"{copy} is stale: run `make crd`"


def test_schema_is_structural() -> None:
    assert crd.structural_problems(schema()) == []


@pytest.mark.parametrize(
    ("bad", "problem"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}}, ".a: uses $ref"),
        (
            {
                "type": "object",
                "properties": {"a": {"anyOf": [{"type": "integer"}, {"type": "null"}]}},
            },
            ".a: uses anyOf",
        ),
        ({"type": "object", "properties": {"a": {"description": "untyped"}}}, ".a: has no type"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}},
                "additionalProperties": False,
            },
            ".: has both properties and additionalProperties",
        ),
    ],
)
def test_structural_check_catches_what_an_api_server_rejects(
    bad: dict[str, Any], problem: str
) -> None:
    assert problem in crd.structural_problems(bad)


def test_pydantic_style_nullables_are_translated() -> None:
    translated = crd.structural(
        {
            "type": "object",
            "properties": {
                "a": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}
            },
        }
    )
    assert translated == {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("version", ["1.30.0", "1.33.0", kubernetes_validate.latest_version()])
def test_crd_passes_strict_kubernetes_validation(version: str) -> None:
    kubernetes_validate.validate(crd.custom_resource_definition(), version, strict=True)


def test_subresources_columns_and_names() -> None:
    spec = crd.custom_resource_definition()["spec"]
    version = spec["versions"][0]
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Replicas",
        "Ready",
        "World",
        "Restarts",
        "Age",
    ]
    assert spec["names"]["shortNames"] == ["ddpj"]
    assert (spec["group"], version["name"], spec["names"]["plural"]) == (
        "ddpjob.io",
        "v1alpha1",
        "ddpjobs",
    )


def test_cel_rule_guards_replica_bounds() -> None:
    rules = schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert rules[0]["rule"] == (
        "(has(self.minReplicas) ? self.minReplicas : self.replicas) <= self.replicas"
        " && self.replicas <= (has(self.maxReplicas) ? self.maxReplicas : self.replicas)"
    )


def test_pod_template_keeps_unknown_fields_but_checks_containers() -> None:
    template = schema()["properties"]["spec"]["properties"]["template"]
    pod_spec = template["properties"]["spec"]
    assert pod_spec["x-kubernetes-preserve-unknown-fields"] is True
    container = pod_spec["properties"]["containers"]["items"]
    assert sorted(container["required"]) == ["image", "name"]
    assert pod_spec["properties"]["containers"]["minItems"] == 1


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(example: Path) -> None:
    document = yaml.safe_load(example.read_text())
    jsonschema.validate(document, schema())


def test_schema_rejects_a_container_without_image() -> None:
    document = yaml.safe_load(EXAMPLES[0].read_text())
    del document["spec"]["template"]["spec"]["containers"][0]["image"]
    with pytest.raises(jsonschema.ValidationError, match="'image' is a required property"):
        jsonschema.validate(document, schema())


# ---- CEL rules, evaluated with cel-python (no API server here) ---------------------------------


_MISSING = object()


def cel_violations(node_schema: dict[str, Any], value: Any, old: Any = _MISSING) -> list[str]:
    """Evaluate every x-kubernetes-validations rule in the schema against the document.

    As the API server does, transition rules (those that use ``oldSelf``) run only on an update
    (``old`` given) and only where the old object has the same node.
    """
    import celpy  # noqa: PLC0415 - test-only dependency
    from celpy.adapter import json_to_cel  # noqa: PLC0415

    found: list[str] = []
    env = celpy.Environment()
    for rule in node_schema.get("x-kubernetes-validations", []):
        activation = {"self": json_to_cel(value)}
        if "oldSelf" in rule["rule"]:
            if old is _MISSING:
                continue
            activation["oldSelf"] = json_to_cel(old)
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate(activation):
            found.append(rule["message"])
    if isinstance(value, dict):
        for name, child in node_schema.get("properties", {}).items():
            if name in value:
                old_child = old.get(name, _MISSING) if isinstance(old, dict) else _MISSING
                found += cel_violations(child, value[name], old_child)
    if isinstance(value, list) and isinstance(node_schema.get("items"), dict):
        for item in value:
            found += cel_violations(node_schema["items"], item)
    return found


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_pass_the_cel_rules(example: Path) -> None:
    assert cel_violations(schema(), yaml.safe_load(example.read_text())) == []


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.one_of(st.none(), st.integers(1, 6)),
    st.one_of(st.none(), st.integers(1, 6)),
    st.one_of(st.integers(-1, 3), st.sampled_from(["auto", "gpu"])),
)
def test_cel_rules_agree_with_the_models(
    replicas: int, low: int | None, high: int | None, nproc: int | str
) -> None:
    spec: dict[str, Any] = {"replicas": replicas, "nprocPerNode": nproc}
    if low is not None:
        spec["minReplicas"] = low
    if high is not None:
        spec["maxReplicas"] = high
    document = manifest(**spec)
    document["spec"] = {k: v for k, v in document["spec"].items() if k in spec or k == "template"}
    try:
        api.parse_job(document)
        accepted = True
    except SpecError:
        accepted = False
    rules_pass = cel_violations(schema(), document) == []
    schema_pass = jsonschema.Draft4Validator(schema()).is_valid(document)
    assert accepted == (rules_pass and schema_pass)


# ---- fields baked into pods are immutable while the job runs -----------------------------------


def _update(old_spec: dict[str, Any], **changes: Any) -> list[str]:
    old = manifest(**old_spec)
    new = manifest(**{**old_spec, **changes})
    return cel_violations(schema(), new, old)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("minReplicas", 2),
        ("maxReplicas", 5),
        ("nprocPerNode", 2),
        ("rendezvous", {"port": 29500}),
        ("maxRestarts", 9),
        ("template", {"spec": {"containers": [{"name": "trainer", "image": "other:2"}]}}),
    ],
)
def test_fields_baked_into_pods_cannot_change_while_running(field: str, value: Any) -> None:
    assert _update({}, **{field: value}) == [
        f"spec.{field} cannot change while the job runs (its pods are built from it): "
        "set spec.suspend: true first, change it, then resume; or delete and re-create the job"
    ]
    # While suspended, or in the update that suspends, or the one that resumes: allowed.
    assert _update({"suspend": True}, **{field: value}) == []
    assert _update({}, suspend=True, **{field: value}) == []
    assert _update({"suspend": True}, suspend=False, **{field: value}) == []


def test_replicas_stays_mutable_within_the_bounds() -> None:
    assert _update({}, replicas=4) == []
    assert _update({}, replicas=5) == ["replicas must lie within minReplicas..maxReplicas"]


def test_adding_an_optional_field_counts_as_a_change() -> None:
    old = manifest()
    del old["spec"]["maxReplicas"]
    old["spec"]["replicas"] = 1
    old["spec"]["minReplicas"] = 1
    new = manifest(replicas=1, minReplicas=1, maxReplicas=3)
    assert len(cel_violations(schema(), new, old)) == 1
