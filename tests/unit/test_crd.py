"""The CRD: generated from the models, structural, valid for Kubernetes, kept in sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ddpjob_operator import crd
from ddpjob_operator.cli import render_crd

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
