"""The pod template: the core/v1 objects of a job's pods, as far as ddpjob reads them."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Annotated, Any

import pydantic
from pydantic import ConfigDict, Field

from ddpjob_operator.api.base import Model, OpenModel

# ---- the core/v1 objects of the template ------------------------------------------------------
#
# The CRD keeps every core/v1 field of the template (x-kubernetes-preserve-unknown-fields), but
# the API server's CEL sees only the fields the schema declares: two objects that differ only
# in undeclared keys, one on each side (nodeSelector dropped, affinity added), compare equal, so
# the transition rule that keeps the template fixed while the job runs would let such a change
# through. Every core/v1 field name is therefore declared, the ones ddpjob does not model as
# opaque values (no type: compared whole), and the rule compares both ways. tests/unit/test_crd.py
# checks these lists against the newest Kubernetes schema.

POD_SPEC_FIELDS = (
    "activeDeadlineSeconds", "affinity", "automountServiceAccountToken", "containers",
    "dnsConfig", "dnsPolicy", "enableServiceLinks", "ephemeralContainers", "evictionResponders",
    "hostAliases", "hostIPC", "hostNetwork", "hostPID", "hostUsers", "hostname",
    "hostnameOverride", "imagePullSecrets", "initContainers", "nodeName", "nodeSelector", "os",
    "overhead", "preemptionPolicy", "priority", "priorityClassName", "readinessGates",
    "resourceClaims", "resources", "restartPolicy", "runtimeClassName", "schedulerName",
    "schedulingGates", "schedulingGroup", "securityContext", "serviceAccount",
    "serviceAccountName", "setHostnameAsFQDN", "shareProcessNamespace", "subdomain",
    "terminationGracePeriodSeconds", "tolerations", "topologySpreadConstraints", "volumes",
)  # fmt: skip
"""core/v1 PodSpec's fields (Kubernetes 1.37)."""

CONTAINER_FIELDS = (
    "args", "command", "env", "envFrom", "image", "imagePullPolicy", "lifecycle",
    "livenessProbe", "name", "ports", "readinessProbe", "resizePolicy", "resources",
    "restartPolicy", "restartPolicyRules", "securityContext", "startupProbe", "stdin",
    "stdinOnce", "terminationMessagePath", "terminationMessagePolicy", "tty", "volumeDevices",
    "volumeMounts", "workingDir",
)  # fmt: skip
"""core/v1 Container's fields (Kubernetes 1.37)."""

ENV_VAR_FIELDS = ("name", "value", "valueFrom")
"""core/v1 EnvVar's fields (Kubernetes 1.37)."""


def declare(
    fields: tuple[str, ...], what: str, typed: Mapping[str, Mapping[str, Any]] | None = None
) -> Any:
    """``json_schema_extra`` for an open model: declare the core/v1 fields it does not model
    (opaque, unless ``typed`` gives a field's schema)."""

    def extra(schema: dict[str, Any]) -> None:
        schema["x-kubernetes-preserve-unknown-fields"] = True
        properties = schema.setdefault("properties", {})
        for name in fields:
            properties.setdefault(
                name,
                {
                    "description": f"core/v1 {what}.{name}, passed to the pods as it is.",
                    **copy.deepcopy(dict((typed or {}).get(name) or {})),
                },
            )
            properties[name].setdefault("x-kubernetes-preserve-unknown-fields", True)

    return extra


ENV_NAME_PATTERN = r"^[ -<>-~]+$"
"""What the API server accepts as an env var name since Kubernetes 1.32 (beta, on by default;
GA in 1.34): printable ASCII except ``=``. An older cluster refuses more when it creates the
pod, and says so in an ActionFailed event."""

NUMBER = r"([0-9]+(\.[0-9]*)?|\.[0-9]+)"
QUANTITY_PATTERN = rf"^\+?{NUMBER}([KMGTPE]i|[numkMGTPE]|[eE][+-]?{NUMBER})?$"
"""A non-negative Kubernetes quantity, as the API server parses one (``resource.Quantity``):
``8Gi``, ``512Mi``, ``1e9``, ``1.5G``, ``.5Gi``."""


def env_name(value: str) -> str:
    if not re.match(ENV_NAME_PATTERN, value):
        raise ValueError(
            f"env var name {value!r} must be printable ASCII characters other than '=': rename it"
        )
    return value


class EnvVar(OpenModel):
    model_config = ConfigDict(json_schema_extra=declare(ENV_VAR_FIELDS, "EnvVar"))

    name: Annotated[
        str,
        pydantic.AfterValidator(env_name),
        Field(min_length=1, json_schema_extra={"pattern": ENV_NAME_PATTERN}),
    ]
    value: str | None = None


class Container(OpenModel):
    """A core/v1 Container. Only the fields ddpjob reads are checked; the rest is kept."""

    model_config = ConfigDict(json_schema_extra=declare(CONTAINER_FIELDS, "Container"))

    name: Annotated[
        str,
        Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"),
    ]
    image: Annotated[str, Field(min_length=1, description="The container image. Required.")]
    command: list[str] | None = None
    args: list[str] | None = None
    env: list[EnvVar] | None = None


class PodSpec(OpenModel):
    """A core/v1 PodSpec. The first container is the trainer."""

    model_config = ConfigDict(
        json_schema_extra=declare(
            POD_SPEC_FIELDS,
            "PodSpec",
            # Typed, so that the spec's CEL rule for gangScheduling can ask whether it is set
            # (the API server's CEL knows no untyped field).
            typed={
                "schedulingGroup": {
                    "type": "object",
                    "properties": {"podGroupName": {"type": "string"}},
                }
            },
        )
    )

    containers: Annotated[
        list[Container],
        Field(min_length=1, description="The first container is the trainer; others are sidecars."),
    ]


class TemplateMetadata(Model):
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class PodTemplate(Model):
    """A core/v1 PodTemplateSpec."""

    metadata: TemplateMetadata = TemplateMetadata()
    spec: PodSpec
