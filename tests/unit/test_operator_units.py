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
    assert policy["spec"]["ingress"][1] == {
        "ports": [{"port": 8080, "protocol": "TCP"}, {"port": 9100, "protocol": "TCP"}]
    }
    assert builders.build_network_policy(job())["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {api.LABEL_JOB: "demo"}}}]}
    ]
