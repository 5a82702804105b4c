"""The DDPJob models: defaults, and bad input rejected with the field path and the fix."""

from __future__ import annotations

import datetime as dt
from typing import Any

import pytest

from ddpjob_operator import api
from ddpjob_operator.errors import SpecError
from ddpjob_operator.parse import parse_job

from .jobs import job, manifest


def problems(document: Any) -> list[str]:
    with pytest.raises(SpecError) as caught:
        parse_job(document)
    return [str(p) for p in caught.value.problems]


def test_defaults_are_applied() -> None:
    parsed = job(minReplicas=None, maxReplicas=None)
    spec = parsed.spec
    assert (spec.effective_min, spec.replicas, spec.effective_max) == (2, 2, 2)
    assert spec.restart_policy is api.RestartPolicy.ON_FAILURE
    assert spec.clean_pod_policy is api.CleanPodPolicy.RUNNING
    assert (spec.max_restarts, spec.backoff_limit, spec.suspend) == (3, 6, False)
    assert spec.rendezvous.port == 29400
    assert parsed.status.phase is api.JobPhase.PENDING


def test_models_are_frozen() -> None:
    parsed = job()
    with pytest.raises(Exception, match="frozen"):
        parsed.spec.replicas = 5  # type: ignore[misc]


def test_round_trip_keeps_unknown_pod_fields() -> None:
    document = manifest()
    document["spec"]["template"]["spec"]["nodeSelector"] = {"gpu": "a100"}
    document["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "2"}}
    dumped = parse_job(document).model_dump(by_alias=True, exclude_none=True, mode="json")
    pod_spec = dumped["spec"]["template"]["spec"]
    assert pod_spec["nodeSelector"] == {"gpu": "a100"}
    assert pod_spec["containers"][0]["resources"] == {"limits": {"cpu": "2"}}


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (
            {"replicas": 2, "minReplicas": 3},
            "spec: minReplicas (3) must be <= replicas (2): lower minReplicas or raise replicas",
        ),
        (
            {"replicas": 5, "maxReplicas": 4},
            "spec: maxReplicas (4) must be >= replicas (5): raise maxReplicas or lower replicas",
        ),
        ({"replicas": -1}, "spec.replicas: Input should be greater than or equal to 1 (got -1)"),
        (
            {"backoffLimit": -2},
            "spec.backoffLimit: Input should be greater than or equal to 0 (got -2)",
        ),
        (
            {"maxRestarts": -1},
            "spec.maxRestarts: Input should be greater than or equal to 0 (got -1)",
        ),
        ({"nprocPerNode": 0}, "spec.nprocPerNode: must be an integer >= 1 or 'auto' (got 0)"),
        (
            {"nprocPerNode": "gpu"},
            "spec.nprocPerNode: must be an integer >= 1 or 'auto' (got 'gpu')",
        ),
        (
            {"restartPolicy": "Always"},
            "spec.restartPolicy: Input should be 'OnFailure', 'ExitCode' or 'Never' (got 'Always')",
        ),
        (
            {"rendezvous": {"port": 70000}},
            "spec.rendezvous.port: Input should be less than or equal to 65535 (got 70000)",
        ),
    ],
)
def test_bad_values_name_the_field_and_what_is_valid(spec: dict[str, Any], expected: str) -> None:
    assert problems(manifest(**spec)) == [expected]


def test_unknown_field_lists_the_valid_ones() -> None:
    [problem] = problems(manifest(replica=3))
    assert problem.startswith(
        "spec.replica: unknown field; valid fields here: activeDeadlineSeconds,"
    )
    assert "replicas" in problem and "minReplicas" in problem


def test_unknown_nested_field() -> None:
    [problem] = problems(manifest(rendezvous={"prot": 1}))
    assert problem.startswith(
        "spec.rendezvous.prot: unknown field; valid fields here: closeTimeoutSeconds,"
    )


def test_template_without_containers() -> None:
    assert problems(manifest(template={"spec": {"containers": []}})) == [
        "spec.template.spec.containers: List should have at least 1 item after validation, not 0: "
        "give at least one container; the first one is the trainer"
    ]


def test_missing_image() -> None:
    assert problems(manifest(template={"spec": {"containers": [{"name": "trainer"}]}})) == [
        "spec.template.spec.containers[0].image: required field is missing"
    ]


def test_missing_spec_and_wrong_kind() -> None:
    document = manifest()
    del document["spec"]
    document["kind"] = "PyTorchJob"
    assert problems(document) == [
        "kind: Input should be 'DDPJob' (got 'PyTorchJob'): use kind: DDPJob",
        "spec: required field is missing",
    ]


def test_job_name_too_long_for_pod_names() -> None:
    document = manifest()
    document["metadata"]["name"] = "x" * 41
    [problem] = problems(document)
    assert problem.startswith("metadata.name: String should have at most 40 characters")
    assert "lowercase DNS label" in problem


def test_not_a_mapping() -> None:
    assert problems(["a", "list"]) == ["<document>: expected a DDPJob mapping, got list"]


def test_every_problem_is_reported_at_once() -> None:
    found = problems(manifest(replicas=0, backoffLimit=-1, bogus=True))
    assert [p.split(":")[0] for p in found] == ["spec.replicas", "spec.backoffLimit", "spec.bogus"]


T0 = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


def failure(
    reason: str, exit_code: int | None, charged: bool = True, started: bool = True
) -> api.PodFailure:
    return api.PodFailure(
        pod="demo-worker-1",
        index=1,
        reason=reason,
        exit_code=exit_code,
        charged=charged,
        started=started,
        time=T0,
    )


@pytest.mark.parametrize(
    ("policy", "disruption", "charged"),
    [
        (api.RestartPolicy.ON_FAILURE, False, True),
        (api.RestartPolicy.ON_FAILURE, True, False),
        (api.RestartPolicy.EXIT_CODE, True, False),
        (api.RestartPolicy.NEVER, True, True),
    ],
)
def test_a_restart_policy_charges_every_failure_but_a_disruption_unless_never(
    policy: api.RestartPolicy, disruption: bool, charged: bool
) -> None:
    assert policy.charges(disruption) is charged


@pytest.mark.parametrize(
    ("policy", "reason", "exit_code", "fails"),
    [
        (api.RestartPolicy.ON_FAILURE, "ExitCode(1)", 1, False),
        (api.RestartPolicy.EXIT_CODE, "ExitCode(1)", 1, True),
        (api.RestartPolicy.EXIT_CODE, "ExitCode(127)", 127, True),
        (api.RestartPolicy.EXIT_CODE, "ExitCode(137)", 137, False),
        (api.RestartPolicy.EXIT_CODE, "OOMKilled", 137, False),
        (api.RestartPolicy.EXIT_CODE, "Preempted", None, False),
        (api.RestartPolicy.NEVER, "Preempted", None, True),
    ],
)
def test_a_restart_policy_says_which_failure_alone_fails_the_job(
    policy: api.RestartPolicy, reason: str, exit_code: int | None, fails: bool
) -> None:
    assert policy.fails_job(failure(reason, exit_code)) is fails


@pytest.mark.parametrize(
    ("charged", "started", "delays"),
    [(True, True, True), (True, False, True), (False, False, True), (False, True, False)],
    ids=["charged", "charged-never-started", "rejected-at-admission", "disruption"],
)
def test_a_failure_delays_its_index_unless_it_was_a_disruption_of_a_pod_that_ran(
    charged: bool, started: bool, delays: bool
) -> None:
    assert failure("Deleted", None, charged, started).delays_next_pod is delays


def test_a_condition_moves_its_transition_time_only_when_its_status_flips() -> None:
    later = T0 + dt.timedelta(minutes=1)
    first = api.set_condition([], api.ConditionType.RUNNING, True, "A", "a", T0)
    same = api.set_condition(first, api.ConditionType.RUNNING, True, "B", "b", later)
    flipped = api.set_condition(same, api.ConditionType.RUNNING, False, "C", "c", later)
    assert [(c.reason, c.last_transition_time) for c in (*first, *same, *flipped)] == [
        ("A", T0),
        ("B", T0),
        ("C", later),
    ]
    assert api.condition_true(same, api.ConditionType.RUNNING)
    assert not api.condition_true(flipped, api.ConditionType.RUNNING)
