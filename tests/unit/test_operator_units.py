"""Operator pieces that need no API server: liveness, records, the NetworkPolicy builder."""

from __future__ import annotations

from ddpjob_operator import api, builders
from ddpjob_operator.controller import STUCK_PASS_SECONDS, Controller, OperatorConfig, pod_record
from ddpjob_operator.kube import Credentials, KubeApi
from ddpjob_operator.metrics import Metrics

from .jobs import job


def controller() -> Controller:
    kube = KubeApi(Credentials(server="http://127.0.0.1:9", token=lambda: None, ssl_context=False))
    return Controller(kube, Metrics(), OperatorConfig())


def test_liveness_names_a_pass_that_runs_too_long() -> None:
    ctl = controller()
    assert ctl.stuck_passes(now=1000.0) == []
    ctl._in_flight[("ml", "demo")] = 1000.0
    ctl._in_flight[("ml", "fresh")] = 1000.0 + STUCK_PASS_SECONDS
    assert ctl.stuck_passes(now=1000.0 + STUCK_PASS_SECONDS + 1) == ["ml/demo"]


def test_pod_record_keeps_only_what_the_operator_needs() -> None:
    pod = builders.build_pod(job(), 1)
    pod["metadata"]["uid"] = "u1"
    record = pod_record(pod)
    assert record is not None
    assert record.finalizers == (api.POD_FINALIZER,)
    assert (record.observed.name, record.observed.index, record.observed.uid) == (
        "demo-worker-1",
        1,
        "u1",
    )
    assert pod_record({"metadata": {"name": "other", "labels": {}}}) is None


def test_network_policy_never_opens_the_rendezvous_port() -> None:
    template = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "image": "x",
                    "ports": [
                        {"containerPort": 29400},
                        {"containerPort": 8080, "protocol": "TCP"},
                    ],
                },
                {"name": "metrics", "image": "y", "ports": [{"containerPort": 9100}]},
            ]
        }
    }
    policy = builders.build_network_policy(job(template=template))
    assert policy["metadata"]["name"] == "demo-ddpjob"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    directory = {"port": 29401, "protocol": "TCP"}  # the agents' answers, read by the operator
    assert policy["spec"]["ingress"][1] == {
        "ports": [directory, {"port": 8080, "protocol": "TCP"}, {"port": 9100, "protocol": "TCP"}]
    }
    assert builders.build_network_policy(job())["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {api.LABEL_JOB: "demo"}}}]},
        {"ports": [directory]},
    ]


def test_refused_actions_emit_a_bounded_number_of_events() -> None:
    """A large job whose every pod the API server refuses: ten events and one for the rest,
    not one per pod on every retry (issue 14 point 17)."""
    import asyncio  # noqa: PLC0415
    import logging  # noqa: PLC0415
    from typing import Any  # noqa: PLC0415

    import pytest  # noqa: PLC0415

    from ddpjob_operator.controller import MAX_FAILED_ACTION_EVENTS, ActionsFailedError  # noqa: PLC0415
    from ddpjob_operator.kube import ApiError  # noqa: PLC0415

    from .jobs import manifest  # noqa: PLC0415

    class RefusingKube:
        async def write_status(self, ns: str, name: str, version: str, status: Any) -> Any:
            return {**body, "status": status}

        async def create_service(self, ns: str, service: Any) -> None:
            return None

        async def create_pod(self, ns: str, pod: Any) -> None:
            raise ApiError(422, "Invalid", f"pod {pod['metadata']['name']} is invalid")

    body = manifest(replicas=30, minReplicas=1, maxReplicas=30)
    body["metadata"]["resourceVersion"] = "1"
    ctl = Controller(RefusingKube(), Metrics(), OperatorConfig())  # type: ignore[arg-type]
    events: list[tuple[str, str, str]] = []

    async def one_pass() -> None:
        await ctl.run_pass(
            ("ml", "demo"),
            body,
            logging.getLogger("test"),
            pods=list,
            service=lambda: True,
            emit=lambda kind, reason, message: events.append((kind, reason, message)),
        )

    with pytest.raises(ActionsFailedError):
        asyncio.run(one_pass())
    refused = [e for e in events if e[1] == "ActionFailed"]
    assert len(refused) == MAX_FAILED_ACTION_EVENTS + 1
    assert refused[-1][2] == "and 20 more refused actions (see the log)"
