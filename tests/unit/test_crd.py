"""The CRD: generated from the models, structural, valid for Kubernetes, kept in sync."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import jsonschema
import kubernetes_validate
import pytest
import yaml
from celpy import celtypes
from hypothesis import given, settings

from ddpjob_operator import api, crd
from ddpjob_operator.cli import render_crd
from ddpjob_operator.errors import SpecError
from ddpjob_operator.parse import parse_job

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
        "Store",  # -o wide only (priority 1)
        "Age",
    ]
    store = next(c for c in version["additionalPrinterColumns"] if c["name"] == "Store")
    assert (store["jsonPath"], store["priority"]) == (".status.storeHost", 1)
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
        parse_job(document)
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
        ("nodeLostTolerationSeconds", 300),
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


# ---- the API server's CEL equality, which hides undeclared keys (issue 14 point 16) -----------


class _K8sObject(celtypes.MapType):
    """A CEL object value as the API server builds one from a schema node with ``properties``
    (apiserver ``cel/common/values.go``): ``==`` compares the declared keys; a key the schema
    does not declare is compared only when both sides have it (skipped when the other side
    lacks it), after a size check over every key."""

    schema: dict[str, Any]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, dict) or len(self) != len(other):
            return False
        declared = self.schema.get("properties", {})
        for key, value in self.items():
            if key in declared:
                if key not in other or not value == other[key]:
                    return False
            elif key in other and _raw(value) != _raw(other[key]):
                return False
        return True

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


class _Opaque:
    """A value under an untyped preserve-unknown-fields node: compared whole (DeepEqual)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Opaque) and self.value == other.value

    __hash__ = None  # type: ignore[assignment]


def _raw(value: Any) -> Any:
    if isinstance(value, _Opaque):
        return value.value
    if isinstance(value, dict):
        return {k: _raw(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_raw(v) for v in value]
    return value


def _to_cel(value: Any, node: dict[str, Any]) -> Any:
    """JSON as the API server hands it to CEL for this schema node (objects with properties as
    _K8sObject, untyped preserved values as _Opaque, the rest as cel-python builds it)."""
    from celpy.adapter import json_to_cel  # noqa: PLC0415

    if "type" not in node and node.get("x-kubernetes-preserve-unknown-fields"):
        return _Opaque(value)
    if isinstance(value, dict) and "properties" in node:
        out = _K8sObject()
        out.schema = node
        for key, item in value.items():
            child = node["properties"].get(key)
            converted = _to_cel(item, child) if child is not None else _Opaque(item)
            out[celtypes.StringType(key)] = converted  # type: ignore[assignment]
        return out
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return celtypes.ListType([_to_cel(item, node["items"]) for item in value])
    return json_to_cel(value)


def api_server_allows(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """The spec's transition rules, evaluated on values shaped as the API server shapes them."""
    import celpy  # noqa: PLC0415

    spec_schema = schema()["properties"]["spec"]
    env = celpy.Environment()
    activation = {
        "self": _to_cel(new["spec"], spec_schema),
        "oldSelf": _to_cel(old["spec"], spec_schema),
    }
    for rule in spec_schema["x-kubernetes-validations"]:
        if "oldSelf" in rule["rule"]:
            program = env.program(env.compile(rule["rule"]))
            if not program.evaluate(activation):
                return False
    return True


def _template(**pod: Any) -> dict[str, Any]:
    trainer = {"name": "trainer", "image": "example/train:1", **pod.pop("trainer", {})}
    return {"spec": {"containers": [trainer], **pod}}


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # One undeclared key dropped, another added: the sizes match.
        (_template(nodeSelector={"gpu": "a100"}), _template(affinity={"nodeAffinity": {}})),
        (_template(nodeSelector={"gpu": "a100"}), _template(tolerations=[{"operator": "Exists"}])),
        (
            _template(trainer={"resources": {"limits": {"cpu": "2"}}}),
            _template(trainer={"workingDir": "/w"}),
        ),
        # A field swapped for junk the pod API would drop: the pods lose nodeSelector.
        (_template(nodeSelector={"gpu": "a100"}), _template(nodeSelectr={"gpu": "a100"})),
        # Inside a declared but unmodelled field.
        (
            _template(trainer={"resources": {"limits": {"cpu": "2"}}}),
            _template(trainer={"resources": {"requests": {"cpu": "2"}}}),
        ),
        (
            _template(
                trainer={"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]}
            ),
            _template(trainer={"env": [{"name": "A", "value": "1"}]}),
        ),
    ],
)
def test_no_template_change_slips_past_the_api_servers_equality(
    old: dict[str, Any], new: dict[str, Any]
) -> None:
    assert not api_server_allows(manifest(template=old), manifest(template=new))
    assert not api_server_allows(manifest(template=new), manifest(template=old))
    # Suspended, the same change is fine.
    assert api_server_allows(
        manifest(template=old, suspend=True), manifest(template=new, suspend=True)
    )


def test_an_unchanged_template_passes_the_api_servers_equality() -> None:
    template = _template(
        nodeSelector={"gpu": "a100"}, trainer={"resources": {"limits": {"cpu": "2"}}}
    )
    assert api_server_allows(manifest(template=template), manifest(template=template, replicas=3))


def _kubernetes_fields(definition: str) -> set[str]:
    import json  # noqa: PLC0415

    version = kubernetes_validate.latest_version()
    root = (
        Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / f"v{version}-local"
    )
    definitions = json.loads((root / "_definitions.json").read_text())["$defs"]
    return set(definitions[f"io.k8s.api.core.v1.{definition}"]["properties"])


@pytest.mark.parametrize(
    ("definition", "declared"),
    [
        ("PodSpec", api.POD_SPEC_FIELDS),
        ("Container", api.CONTAINER_FIELDS),
        ("EnvVar", api.ENV_VAR_FIELDS),
    ],
)
def test_every_core_v1_field_of_the_template_is_declared(
    definition: str, declared: tuple[str, ...]
) -> None:
    """An undeclared field is invisible to the immutability rule (see api.POD_SPEC_FIELDS)."""
    assert set(declared) == _kubernetes_fields(definition), "update the list in api.py"


def test_kubectl_delete_all_does_not_delete_jobs() -> None:
    categories = crd.custom_resource_definition()["spec"]["names"]["categories"]
    assert "all" not in categories


@pytest.mark.parametrize(
    ("value", "valid"),
    [
        ("16Gi", True), ("512Mi", True), ("1e9", True), ("1.5G", True), (".5Gi", True),
        ("+1Gi", True), ("2Pi", True), ("1E3", True), (1073741824, True),
        ("1 Gi", False), ("1gb", False), ("-1Gi", False), ("1KiB", False), ("", False),
    ],
)  # fmt: skip
def test_shm_size_is_any_quantity_the_api_accepts(value: Any, valid: bool) -> None:
    document = manifest(shmSize=value)
    assert jsonschema.Draft4Validator(schema()).is_valid(document) is valid
    try:
        parse_job(document)
        accepted = True
    except SpecError:
        accepted = False
    assert accepted is valid


@pytest.mark.parametrize(
    ("name", "valid"),
    [
        ("MY_VAR", True), ("my.env-name", True), ("1LEADING_DIGIT", True), ("with space", True),
        ("a:b", True), ("A=B", False), ("ünicode", False), ("tab\t", False), ("", False),
    ],
)  # fmt: skip
def test_env_names_are_what_the_api_accepts(name: str, valid: bool) -> None:
    """Since Kubernetes 1.32 (RelaxedEnvironmentVariableValidation): printable ASCII but '='."""
    container = {"name": "trainer", "image": "x", "env": [{"name": name, "value": "1"}]}
    document = manifest(template={"spec": {"containers": [container]}})
    assert jsonschema.Draft4Validator(schema()).is_valid(document) is valid
    try:
        parse_job(document)
        accepted = True
    except SpecError:
        accepted = False
    assert accepted is valid
