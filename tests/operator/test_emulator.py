"""The Kubernetes API emulator (tests/harness/emulator) behaves like a real API server, over real HTTP.

One test per numbered requirement of the emulator (see tests/harness/emulator/README.md). Most tests
share one emulator process; each works in its own namespace.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException

from tests.harness.emulator import (
    EmulatorHandle,
    EmulatorProcess,
    EmulatorThread,
    ddpjob_crd,
    running_emulator,
)

Obj = dict[str, Any]
JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
SMP = "application/strategic-merge-patch+json"
DDPJOB = ("ddpjob.io", "v1alpha1")


@pytest.fixture(scope="module")
def emulator() -> Iterator[EmulatorHandle]:
    with EmulatorProcess() as handle:
        yield handle


@pytest.fixture(scope="module")
def api(emulator: EmulatorHandle, tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = emulator.write_kubeconfig(tmp_path_factory.mktemp("kube") / "config")
    return _client_from(path)


def _client_from(kubeconfig: Path) -> Any:
    """An ApiClient from a kubeconfig file, like kopf's or kubectl's."""
    return config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]


# The kubernetes client's models are typed but the tests pass plain dicts (as the client
# accepts); the API classes are used through Any.
def Core(api: Any) -> Any:
    return client.CoreV1Api(api)


def Custom(api: Any) -> Any:
    return client.CustomObjectsApi(api)


@pytest.fixture
def ns(emulator: EmulatorHandle) -> str:
    name = f"t-{uuid.uuid4().hex[:8]}"
    requests.post(f"{emulator.url}/api/v1/namespaces", json={"metadata": {"name": name}}, timeout=5)
    return name


def _any(value: object) -> Any:
    return value


def _status(exc: ApiException) -> Obj:
    body: Obj = json.loads(exc.body or "{}")
    return body


def _job(name: str, replicas: int = 2, **meta: Any) -> Obj:
    return {
        "apiVersion": "ddpjob.io/v1alpha1",
        "kind": "DDPJob",
        "metadata": {"name": name, **meta},
        "spec": {
            "replicas": replicas,
            "template": {"spec": {"containers": [{"name": "trainer", "image": "x"}]}},
        },
    }


def _pod(name: str, node: str | None = None, **spec: Any) -> Obj:
    pod_spec: Obj = {"containers": [{"name": "main", "image": "busybox"}], **spec}
    if node:
        pod_spec["nodeName"] = node
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": pod_spec}


def _watch_lines(url: str, params: dict[str, str], timeout: float = 10) -> list[Obj]:
    with requests.get(
        url, params={"watch": "true", **params}, stream=True, timeout=timeout
    ) as resp:
        assert resp.status_code == 200
        return [json.loads(line) for line in resp.iter_lines() if line]


# --------------------------------------------------------------------------- 1
def test_1_server_side_metadata(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    cm = core.create_namespaced_config_map(ns, {"metadata": {"name": "one"}, "data": {"a": "1"}})
    assert cm is not None  # a 201 with a body: the client returns the object
    meta = cm.metadata
    assert uuid.UUID(meta.uid).version == 4
    assert meta.namespace == ns
    assert meta.generation == 1
    assert re.fullmatch(r"\d+", meta.resource_version)
    raw = requests.get(f"{emulator.url}/api/v1/namespaces/{ns}/configmaps/one", timeout=5).json()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", raw["metadata"]["creationTimestamp"])

    resp = requests.post(
        f"{emulator.url}/api/v1/namespaces/{ns}/configmaps",
        json={"metadata": {"generateName": "gen-"}},
        timeout=5,
    )
    assert resp.status_code == 201
    assert re.fullmatch(r"gen-[a-z0-9]{5}", resp.json()["metadata"]["name"])

    with pytest.raises(ApiException) as exc:
        core.create_namespaced_config_map(ns, {"metadata": {"name": "one"}})
    assert exc.value.status == 409
    assert _status(exc.value)["reason"] == "AlreadyExists"

    # resourceVersion: global, increasing; generation follows spec only.
    co = Custom(api)
    job = co.create_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", _job("j1"))
    rv0 = int(job["metadata"]["resourceVersion"])
    assert rv0 > int(meta.resource_version)
    assert job["metadata"]["generation"] == 1
    job = co.patch_namespaced_custom_object(
        *DDPJOB,
        ns,
        "ddpjobs",
        "j1",
        {"metadata": {"labels": {"x": "y"}}},
        _content_type=MERGE_PATCH,
    )
    assert job["metadata"]["generation"] == 1
    assert int(job["metadata"]["resourceVersion"]) > rv0
    job = co.patch_namespaced_custom_object_status(
        *DDPJOB, ns, "ddpjobs", "j1", {"status": {"phase": "Running"}}, _content_type=MERGE_PATCH
    )
    assert job["metadata"]["generation"] == 1
    job = co.patch_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", "j1", {"spec": {"replicas": 3}}, _content_type=MERGE_PATCH
    )
    assert job["metadata"]["generation"] == 2
    # A no-op write changes nothing, not even the resourceVersion (as on a real server).
    again = co.patch_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", "j1", {"spec": {"replicas": 3}}, _content_type=MERGE_PATCH
    )
    assert again["metadata"]["resourceVersion"] == job["metadata"]["resourceVersion"]


# --------------------------------------------------------------------------- 2
def test_2_optimistic_concurrency(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    cm = core.create_namespaced_config_map(ns, {"metadata": {"name": "c"}, "data": {"v": "1"}})
    stale = cm.metadata.resource_version
    core.patch_namespaced_config_map("c", ns, {"data": {"v": "2"}}, _content_type=MERGE_PATCH)

    cm.data = {"v": "3"}
    with pytest.raises(ApiException) as exc:
        core.replace_namespaced_config_map("c", ns, cm)  # PUT with the stale resourceVersion
    assert exc.value.status == 409
    status = _status(exc.value)
    assert (status["kind"], status["reason"], status["code"]) == ("Status", "Conflict", 409)

    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_config_map(
            "c",
            ns,
            {"metadata": {"resourceVersion": stale}, "data": {"v": "4"}},
            _content_type=MERGE_PATCH,
        )
    assert exc.value.status == 409

    url = f"{emulator.url}/api/v1/namespaces/{ns}/configmaps/c"
    bad = [
        {"op": "test", "path": "/data/v", "value": "1"},
        {"op": "replace", "path": "/data/v", "value": "5"},
    ]
    resp = requests.patch(
        url, data=json.dumps(bad), headers={"Content-Type": JSON_PATCH}, timeout=5
    )
    assert resp.status_code == 422  # what a real server answers for a failed test op
    good = [
        {"op": "test", "path": "/data/v", "value": "2"},
        {"op": "replace", "path": "/data/v", "value": "5"},
    ]
    resp = requests.patch(
        url, data=json.dumps(good), headers={"Content-Type": JSON_PATCH}, timeout=5
    )
    assert resp.status_code == 200
    assert resp.json()["data"] == {"v": "5"}
    # The current resourceVersion is accepted.
    fresh = core.read_namespaced_config_map("c", ns)
    fresh.data = {"v": "6"}
    assert core.replace_namespaced_config_map("c", ns, fresh).data == {"v": "6"}


# --------------------------------------------------------------------------- 3
def test_3_label_and_field_selectors(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    labels = {
        "a": {"app": "x", "tier": "web"},
        "b": {"app": "y", "tier": "db"},
        "c": {"app": "x"},
        "d": {},
    }
    for name, lab in labels.items():
        core.create_namespaced_config_map(ns, {"metadata": {"name": name, "labels": lab}})

    def names(**kw: str) -> list[str]:
        return sorted(i.metadata.name for i in core.list_namespaced_config_map(ns, **kw).items)

    assert names(label_selector="app=x") == ["a", "c"]
    assert names(label_selector="app==x") == ["a", "c"]
    assert names(label_selector="app!=x") == ["b", "d"]
    assert names(label_selector="tier") == ["a", "b"]
    assert names(label_selector="!tier") == ["c", "d"]
    assert names(label_selector="app in (x,y)") == ["a", "b", "c"]
    assert names(label_selector="tier notin (web)") == ["b", "c", "d"]
    assert names(label_selector="app=x,tier") == ["a"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.name!=b") == ["a", "c", "d"]
    assert names(field_selector=f"metadata.namespace={ns}", label_selector="app=y") == ["b"]
    with pytest.raises(ApiException) as exc:
        names(label_selector="app in (x")
    assert exc.value.status == 400

    # Watches filter too: a relabelled object leaves the selection as DELETED.
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    core.patch_namespaced_config_map(
        "a", ns, {"metadata": {"labels": {"app": "z"}}}, _content_type=MERGE_PATCH
    )
    core.patch_namespaced_config_map(
        "d", ns, {"metadata": {"labels": {"app": "x"}}}, _content_type=MERGE_PATCH
    )
    events = _watch_lines(
        f"{emulator.url}/api/v1/namespaces/{ns}/configmaps",
        {"resourceVersion": rv, "labelSelector": "app=x", "timeoutSeconds": "1"},
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("DELETED", "a"),
        ("ADDED", "d"),
    ]


# --------------------------------------------------------------------------- 4
def test_4_watch_semantics(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "before"}})
    listing = core.list_namespaced_config_map(ns)
    rv = listing.metadata.resource_version
    assert int(rv) >= int(listing.items[0].metadata.resource_version)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "w"}})
    patched = core.patch_namespaced_config_map(
        "w", ns, {"data": {"k": "v"}}, _content_type=MERGE_PATCH
    )
    core.delete_namespaced_config_map("w", ns)

    started = time.monotonic()
    w: Any = watch.Watch()  # type: ignore[no-untyped-call]
    seen = [
        (e["type"], e["object"].metadata.name, e["object"].metadata.resource_version)
        for e in w.stream(
            core.list_namespaced_config_map,
            ns,
            resource_version=rv,
            timeout_seconds=1,
            allow_watch_bookmarks=True,
        )
    ]
    assert time.monotonic() - started < 5  # timeoutSeconds closed the stream
    assert [s[:2] for s in seen] == [("ADDED", "w"), ("MODIFIED", "w"), ("DELETED", "w")]
    assert seen[1][2] == patched.metadata.resource_version
    rvs = [int(s[2]) for s in seen]
    assert rvs == sorted(rvs)
    assert rvs[0] > int(rv)

    # Without a resourceVersion: the current objects as ADDED, like a real server.
    events = _watch_lines(
        f"{emulator.url}/api/v1/namespaces/{ns}/configmaps", {"timeoutSeconds": "1"}
    )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "before")]

    # Too old after a compaction: an ERROR event with a 410 Status.
    emulator.control.compact_history()
    events = _watch_lines(
        f"{emulator.url}/api/v1/namespaces/{ns}/configmaps",
        {"resourceVersion": rv, "timeoutSeconds": "5"},
    )
    assert len(events) == 1
    assert events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410
    assert events[0]["object"]["reason"] == "Expired"


def test_4_watch_bookmarks() -> None:
    with EmulatorThread(bookmark_interval=0.3, with_ddpjob_crd=False) as em:
        events = _watch_lines(
            f"{em.url}/api/v1/namespaces/default/configmaps",
            {"resourceVersion": "1", "allowWatchBookmarks": "true", "timeoutSeconds": "1"},
        )
        kinds = {e["type"] for e in events}
        assert kinds == {"BOOKMARK"}
        assert all(int(e["object"]["metadata"]["resourceVersion"]) >= 1 for e in events)


# --------------------------------------------------------------------------- 5
def test_5_status_and_scale_subresources(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    co = Custom(api)
    job = co.create_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", {**_job("s"), "status": {"phase": "Fake"}}
    )
    assert "status" not in job  # a create does not set the status of a kind with /status
    job = co.patch_namespaced_custom_object(
        *DDPJOB,
        ns,
        "ddpjobs",
        "s",
        {"status": {"phase": "Bogus"}, "spec": {"replicas": 4}},
        _content_type=MERGE_PATCH,
    )
    assert "status" not in job
    assert job["spec"]["replicas"] == 4
    job = co.patch_namespaced_custom_object_status(
        *DDPJOB,
        ns,
        "ddpjobs",
        "s",
        {
            "status": {"phase": "Running", "replicas": 3, "selector": "job=s"},
            "spec": {"replicas": 9},
        },
        _content_type=MERGE_PATCH,
    )
    assert job["status"]["phase"] == "Running"
    assert job["spec"]["replicas"] == 4
    job["spec"]["replicas"] = 5
    job["status"]["phase"] = "Ignored"
    job = co.replace_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", "s", job
    )  # PUT keeps the status
    assert (job["spec"]["replicas"], job["status"]["phase"]) == (5, "Running")

    scale = co.get_namespaced_custom_object_scale(*DDPJOB, ns, "ddpjobs", "s")
    assert scale["kind"] == "Scale"
    assert scale["apiVersion"] == "autoscaling/v1"
    assert scale["spec"] == {"replicas": 5}
    assert scale["status"] == {"replicas": 3, "selector": "job=s"}
    scale = co.patch_namespaced_custom_object_scale(
        *DDPJOB, ns, "ddpjobs", "s", {"spec": {"replicas": 7}}, _content_type=MERGE_PATCH
    )
    assert scale["spec"]["replicas"] == 7
    job = co.get_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", "s")
    assert job["spec"]["replicas"] == 7
    assert job["metadata"]["generation"] == 4
    scale["spec"]["replicas"] = 2
    co.replace_namespaced_custom_object_scale(*DDPJOB, ns, "ddpjobs", "s", scale)
    assert co.get_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", "s")["spec"]["replicas"] == 2

    # Pods: /status is isolated too.
    core = Core(api)
    core.create_namespaced_pod(ns, _pod("p"))
    pod = core.patch_namespaced_pod(
        "p", ns, {"status": {"phase": "Running"}}, _content_type=MERGE_PATCH
    )
    assert pod.status.phase == "Pending"
    pod = core.patch_namespaced_pod_status(
        "p",
        ns,
        {"status": {"phase": "Running"}, "metadata": {"labels": {"no": "no"}}},
        _content_type=MERGE_PATCH,
    )
    assert pod.status.phase == "Running"
    assert not pod.metadata.labels


# --------------------------------------------------------------------------- 6
def test_6_graceful_pod_deletion(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    core.create_namespaced_pod(ns, _pod("g", node="n1", terminationGracePeriodSeconds=12))
    pod = core.delete_namespaced_pod("g", ns)
    assert pod.metadata.deletion_grace_period_seconds == 12
    assert pod.metadata.deletion_timestamp is not None
    assert core.read_namespaced_pod("g", ns).metadata.deletion_timestamp is not None
    assert emulator.control.kubelet_confirm(ns, "g") is True
    with pytest.raises(ApiException) as exc:
        core.read_namespaced_pod("g", ns)
    assert exc.value.status == 404

    # Grace from the request; the kubelet's second DELETE with grace 0 removes it.
    core.create_namespaced_pod(ns, _pod("h", node="n1"))
    pod = core.delete_namespaced_pod("h", ns, grace_period_seconds=5)
    assert pod.metadata.deletion_grace_period_seconds == 5
    core.delete_namespaced_pod("h", ns, body={"gracePeriodSeconds": 0})
    assert not emulator.control.list_objects("v1/pods", ns)

    # The default is 30 s; a force delete (grace 0) is immediate.
    core.create_namespaced_pod(ns, _pod("d", node="n1"))
    assert core.delete_namespaced_pod("d", ns).metadata.deletion_grace_period_seconds == 30
    core.create_namespaced_pod(ns, _pod("f", node="n1"))
    core.delete_namespaced_pod("f", ns, grace_period_seconds=0)
    assert emulator.control.get_object("v1/pods", ns, "f") is None

    # Unscheduled pods go at once; unless the kubelet is "alive".
    core.create_namespaced_pod(ns, _pod("u"))
    core.delete_namespaced_pod("u", ns)
    assert emulator.control.get_object("v1/pods", ns, "u") is None
    emulator.control.set_kubelet_alive(True)
    try:
        core.create_namespaced_pod(ns, _pod("ua"))
        core.delete_namespaced_pod("ua", ns)
        assert emulator.control.get_object("v1/pods", ns, "ua") is not None
        emulator.control.kubelet_confirm(ns, "ua")
        assert emulator.control.get_object("v1/pods", ns, "ua") is None
    finally:
        emulator.control.set_kubelet_alive(False)

    # Preconditions.
    pod = core.create_namespaced_pod(ns, _pod("pre"))
    for pre in ({"uid": str(uuid.uuid4())}, {"resourceVersion": "1"}):
        with pytest.raises(ApiException) as exc:
            core.delete_namespaced_pod("pre", ns, body={"preconditions": pre})
        assert exc.value.status == 409
        assert _status(exc.value)["reason"] == "Conflict"
    core.delete_namespaced_pod("pre", ns, body={"preconditions": {"uid": pod.metadata.uid}})
    assert emulator.control.get_object("v1/pods", ns, "pre") is None


# --------------------------------------------------------------------------- 7
def test_7_finalizers(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "fin", "finalizers": ["x.io/a"]}})
    rv = core.list_namespaced_config_map(ns).metadata.resource_version
    core.delete_namespaced_config_map("fin", ns)
    cm = core.read_namespaced_config_map("fin", ns)
    assert cm.metadata.deletion_timestamp is not None
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_config_map(
            "fin", ns, {"metadata": {"finalizers": ["x.io/a", "x.io/b"]}}, _content_type=MERGE_PATCH
        )
    assert exc.value.status == 422
    core.patch_namespaced_config_map(
        "fin", ns, [{"op": "remove", "path": "/metadata/finalizers"}], _content_type=JSON_PATCH
    )
    with pytest.raises(ApiException):
        core.read_namespaced_config_map("fin", ns)
    events = _watch_lines(
        f"{emulator.url}/api/v1/namespaces/{ns}/configmaps",
        {"resourceVersion": rv, "timeoutSeconds": "1"},
    )
    assert [e["type"] for e in events] == ["MODIFIED", "DELETED"]

    # A pod: gone only when the kubelet confirmed AND the finalizers are empty (either order).
    for order in ("kubelet-first", "finalizers-first"):
        name = f"pf-{order}"
        body = _pod(name, node="n1")
        body["metadata"]["finalizers"] = ["x.io/keep"]
        core.create_namespaced_pod(ns, body)
        core.delete_namespaced_pod(name, ns)

        def confirm(n: str = name) -> None:
            emulator.control.kubelet_confirm(ns, n)

        def unfinalize(n: str = name) -> None:
            core.patch_namespaced_pod(
                n, ns, {"metadata": {"finalizers": None}}, _content_type=MERGE_PATCH
            )

        first, second = (confirm, unfinalize) if order == "kubelet-first" else (unfinalize, confirm)
        first()
        assert emulator.control.get_object("v1/pods", ns, name) is not None
        second()
        assert emulator.control.get_object("v1/pods", ns, name) is None


# --------------------------------------------------------------------------- 8
def test_8_patch_types(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    pod = _pod("sm")
    pod["spec"]["containers"] = [
        {
            "name": "a",
            "image": "a:1",
            "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}],
        },
        {"name": "b", "image": "b:1"},
    ]
    pod["metadata"]["finalizers"] = ["f/one"]
    pod["metadata"]["ownerReferences"] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "name": "o1", "uid": "u1"}
    ]
    core.create_namespaced_pod(ns, pod)

    smp = {
        "metadata": {
            "finalizers": ["f/two"],
            "ownerReferences": [
                {"apiVersion": "v1", "kind": "ConfigMap", "name": "o2", "uid": "u2"}
            ],
        },
        "spec": {
            "containers": [
                {
                    "name": "a",
                    "image": "a:2",
                    "env": [{"name": "Y", "value": "3"}, {"name": "Z", "value": "4"}],
                }
            ]
        },
    }
    got = core.patch_namespaced_pod("sm", ns, smp, _content_type=SMP)
    containers = {c.name: c for c in got.spec.containers}
    assert set(containers) == {"a", "b"}  # merged by name, not replaced
    assert containers["a"].image == "a:2"
    assert [(e.name, e.value) for e in containers["a"].env] == [("X", "1"), ("Y", "3"), ("Z", "4")]
    assert got.metadata.finalizers == ["f/one", "f/two"]
    assert [r.uid for r in got.metadata.owner_references] == ["u1", "u2"]

    delete = {
        "spec": {"containers": [{"name": "b", "$patch": "delete"}]},
        "$deleteFromPrimitiveList/finalizers": ["f/one"],
    }
    delete["metadata"] = {"$deleteFromPrimitiveList/finalizers": ["f/one"]}
    del delete["$deleteFromPrimitiveList/finalizers"]
    got = core.patch_namespaced_pod("sm", ns, delete, _content_type=SMP)
    assert [c.name for c in got.spec.containers] == ["a"]
    assert got.metadata.finalizers == ["f/two"]

    # A merge patch replaces lists.
    got = core.patch_namespaced_pod(
        "sm", ns, {"metadata": {"finalizers": ["only"]}}, _content_type=MERGE_PATCH
    )
    assert got.metadata.finalizers == ["only"]
    # A JSON patch.
    ops = [
        {"op": "add", "path": "/metadata/labels", "value": {"k": "v"}},
        {"op": "add", "path": "/metadata/finalizers/-", "value": "more"},
    ]
    got = core.patch_namespaced_pod("sm", ns, ops, _content_type=JSON_PATCH)
    assert got.metadata.labels == {"k": "v"}
    assert got.metadata.finalizers == ["only", "more"]
    # Custom resources refuse SMP with 415, like a real server.
    co = Custom(api)
    co.create_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", _job("nosmp"))
    resp = requests.patch(
        f"{emulator.url}/apis/ddpjob.io/v1alpha1/namespaces/{ns}/ddpjobs/nosmp",
        data=json.dumps({"spec": {"replicas": 1}}),
        headers={"Content-Type": SMP},
        timeout=5,
    )
    assert resp.status_code == 415


# --------------------------------------------------------------------------- 9
def test_9_fault_injection(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "f"}})
    url = f"{emulator.url}/api/v1/namespaces/{ns}/configmaps/f"
    emulator.control.add_fault("GET", rf"/namespaces/{ns}/configmaps/f$", 500, count=2)
    assert [requests.get(url, timeout=5).status_code for _ in range(3)] == [500, 500, 200]
    emulator.control.add_fault("PATCH", rf"/namespaces/{ns}/configmaps/", 409)
    with pytest.raises(ApiException) as exc:
        core.patch_namespaced_config_map("f", ns, {"data": {"a": "b"}}, _content_type=MERGE_PATCH)
    assert (exc.value.status, _status(exc.value)["reason"]) == (409, "Conflict")
    emulator.control.add_fault("*", rf"/namespaces/{ns}/", 429, retry_after=1)
    resp = requests.get(url, timeout=5)
    assert resp.status_code == 429
    assert resp.headers["Retry-After"] == "1"
    assert resp.json()["reason"] == "TooManyRequests"
    assert requests.get(url, timeout=5).status_code == 200

    # Dropping open watches mid-stream: the stream ends.
    watch_url = f"{emulator.url}/api/v1/namespaces/{ns}/configmaps"
    got: list[Obj] = []
    ended = threading.Event()

    def reader() -> None:
        for e in _watch_lines(
            watch_url,
            {"resourceVersion": str(emulator.control.current_resource_version())},
            timeout=30,
        ):
            got.append(e)
        ended.set()

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    deadline = time.monotonic() + 5
    while emulator.control.open_watches() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "seen"}})
    time.sleep(0.2)
    assert emulator.control.drop_watches() >= 1
    assert ended.wait(5)
    assert [e["object"]["metadata"]["name"] for e in got] == ["seen"]

    # Silent watches: the connection stays open, nothing arrives, timeoutSeconds is ignored.
    emulator.control.silence_watches(True)
    try:
        with requests.get(
            watch_url, params={"watch": "true", "timeoutSeconds": "1"}, stream=True, timeout=2.5
        ) as resp:
            core.create_namespaced_config_map(ns, {"metadata": {"name": "unseen"}})
            with pytest.raises(
                requests.exceptions.ConnectionError
            ):  # the read timeout, nothing came
                next(resp.iter_lines())
    finally:
        emulator.control.silence_watches(False)


# --------------------------------------------------------------------------- 10
def test_10_request_log(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    since = emulator.control.requests()[-1]["seq"]
    before = emulator.control.count_requests("create", "configmaps", namespace=ns)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "l1"}})
    core.create_namespaced_config_map(ns, {"metadata": {"name": "l2"}})
    core.read_namespaced_config_map("l1", ns)
    core.list_namespaced_config_map(ns, label_selector="a=b")
    with pytest.raises(ApiException):
        core.read_namespaced_config_map("nope", ns)
    assert emulator.control.count_requests("create", "configmaps", namespace=ns) == before + 2
    assert emulator.control.count_requests("get", "configmaps", namespace=ns, status=404) == 1
    assert emulator.control.count_requests(method="GET", resource="configmaps", namespace=ns) == 3
    log = emulator.control.requests(since=since)
    assert [(e["method"], e["verb"], e["status"]) for e in log] == [
        ("POST", "create", 201),
        ("POST", "create", 201),
        ("GET", "get", 200),
        ("GET", "list", 200),
        ("GET", "get", 404),
    ]
    assert log[3]["query"] == {"labelSelector": "a=b"}
    assert log[3]["path"] == f"/api/v1/namespaces/{ns}/configmaps"
    assert all(isinstance(e["ts"], float) for e in log)


# --------------------------------------------------------------------------- 11
@pytest.mark.asyncio
async def test_11_namespaces() -> None:
    # In-process mode (this loop): the handle's control is the Emulator itself, and the
    # client must be async (a blocking client would block the loop that serves it).
    async with (
        running_emulator(with_ddpjob_crd=False, auto_namespaces=False) as em,
        aiohttp.ClientSession(em.url) as http,
    ):

        async def get(path: str) -> tuple[int, Obj]:
            async with http.get(path) as resp:
                return resp.status, await resp.json()

        async def post(path: str, body: Obj) -> int:
            async with http.post(path, json=body) as resp:
                return resp.status

        _, listing = await get("/api/v1/namespaces")
        assert [n["metadata"]["name"] for n in listing["items"]] == ["default", "kube-system"]
        for ns in ("ns-a", "ns-b"):
            assert await post("/api/v1/namespaces", {"metadata": {"name": ns}}) == 201
            assert (
                await post(
                    f"/api/v1/namespaces/{ns}/configmaps", {"metadata": {"name": f"in-{ns}"}}
                )
                == 201
            )
        _, only_a = await get("/api/v1/namespaces/ns-a/configmaps")
        assert [i["metadata"]["name"] for i in only_a["items"]] == ["in-ns-a"]
        _, everywhere = await get("/api/v1/configmaps")
        assert sorted(i["metadata"]["name"] for i in everywhere["items"]) == ["in-ns-a", "in-ns-b"]
        assert (await get("/api/v1/namespaces/ns-b/configmaps/in-ns-a"))[0] == 404
        # auto_namespaces=False: an unknown namespace is a 404, like a real server.
        assert await post("/api/v1/namespaces/ghost/configmaps", {"metadata": {"name": "x"}}) == 404
        assert (await get("/api/v1/namespaces/ns-a"))[1]["status"]["phase"] == "Active"
        # Deleting a namespace deletes its content.
        async with http.delete("/api/v1/namespaces/ns-b") as resp:
            assert resp.status == 200
        await asyncio.sleep(0.05)
        assert em.control.list_objects("v1/configmaps", "ns-b") == []


# --------------------------------------------------------------------------- 12
def test_12_events_leases_peerings_crds(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    core.create_namespaced_event(
        ns,
        {
            "metadata": {"generateName": "job."},
            "involvedObject": {"kind": "DDPJob", "name": "j", "namespace": ns},
            "reason": "Scaled",
            "message": "m",
            "type": "Normal",
        },
    )
    assert [e.reason for e in core.list_namespaced_event(ns).items] == ["Scaled"]
    ev = _any(client.EventsV1Api(api))
    ev.create_namespaced_event(
        ns,
        {
            "metadata": {"name": "e2"},
            "eventTime": "2024-01-01T00:00:00.000000Z",
            "reason": "R",
            "action": "A",
            "reportingController": "c",
            "reportingInstance": "i",
            "type": "Normal",
        },
    )
    assert [e.metadata.name for e in ev.list_namespaced_event(ns).items] == ["e2"]
    coord = _any(client.CoordinationV1Api(api))
    coord.create_namespaced_lease(
        ns,
        {
            "metadata": {"name": "leader"},
            "spec": {"holderIdentity": "me", "leaseDurationSeconds": 15},
        },
    )
    lease = coord.read_namespaced_lease("leader", ns)
    lease.spec.holder_identity = "you"
    assert coord.replace_namespaced_lease("leader", ns, lease).spec.holder_identity == "you"

    co = Custom(api)
    co.create_namespaced_custom_object(
        "kopf.dev",
        "v1",
        ns,
        "kopfpeerings",
        {"metadata": {"name": "default"}, "status": {"op-1": {"priority": 0}}},
    )
    co.patch_namespaced_custom_object(
        "kopf.dev",
        "v1",
        ns,
        "kopfpeerings",
        "default",
        {"status": {"op-2": {"priority": 1}}},
        _content_type=MERGE_PATCH,
    )
    peering = co.get_namespaced_custom_object("kopf.dev", "v1", ns, "kopfpeerings", "default")
    assert set(peering["status"]) == {"op-1", "op-2"}  # no status subresource for peerings
    co.create_cluster_custom_object(
        "kopf.dev", "v1", "clusterkopfpeerings", {"metadata": {"name": "default"}}
    )

    ext = _any(client.ApiextensionsV1Api(api))
    crds = {c.metadata.name for c in ext.list_custom_resource_definition().items}
    assert {"ddpjobs.ddpjob.io", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"} <= crds
    ddpjobs = ext.read_custom_resource_definition("ddpjobs.ddpjob.io")
    assert {c.type: c.status for c in ddpjobs.status.conditions}["Established"] == "True"
    disc = requests.get(f"{emulator.url}/apis/ddpjob.io/v1alpha1", timeout=5).json()
    assert {r["name"] for r in disc["resources"]} == {"ddpjobs", "ddpjobs/status", "ddpjobs/scale"}
    assert disc["resources"][0]["shortNames"] == ["ddpj"]

    with EmulatorThread(with_ddpjob_crd=False) as bare:
        assert (
            requests.get(f"{bare.url}/apis/ddpjob.io/v1alpha1/ddpjobs", timeout=5).status_code
            == 404
        )
        names = {
            c["metadata"]["name"]
            for c in requests.get(
                f"{bare.url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions", timeout=5
            ).json()["items"]
        }
        assert "ddpjobs.ddpjob.io" not in names
        # Creating the CRD through the API starts serving it.
        resp = requests.post(
            f"{bare.url}/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
            json=ddpjob_crd(),
            timeout=5,
        )
        assert resp.status_code == 201
        assert (
            requests.get(f"{bare.url}/apis/ddpjob.io/v1alpha1/ddpjobs", timeout=5).status_code
            == 200
        )


# --------------------------------------------------------------------------- 13
def test_13_owner_reference_garbage_collection(emulator: EmulatorHandle, api: Any, ns: str) -> None:
    core = Core(api)
    co = Custom(api)

    def owned(owner: Obj) -> Obj:
        ref = {
            "apiVersion": "ddpjob.io/v1alpha1",
            "kind": "DDPJob",
            "name": owner["metadata"]["name"],
            "uid": owner["metadata"]["uid"],
            "controller": True,
        }
        return {"ownerReferences": [ref]}

    job = co.create_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", _job("owner"))
    core.create_namespaced_config_map(ns, {"metadata": {"name": "dep-cm", **owned(job)}})
    pod = _pod("dep-pod", node="n1")
    pod["metadata"].update(owned(job))
    core.create_namespaced_pod(ns, pod)
    core.create_namespaced_config_map(ns, {"metadata": {"name": "unrelated"}})
    fin = {"metadata": {"name": "dep-fin", "finalizers": ["x.io/hold"], **owned(job)}}
    core.create_namespaced_config_map(ns, fin)

    co.delete_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", "owner")  # background propagation
    deadline = time.monotonic() + 5
    while (
        emulator.control.get_object("v1/configmaps", ns, "dep-cm") is not None
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert emulator.control.get_object("v1/configmaps", ns, "dep-cm") is None
    assert emulator.control.get_object("v1/configmaps", ns, "unrelated") is not None
    held = emulator.control.get_object("v1/configmaps", ns, "dep-fin")
    assert held is not None
    assert held["metadata"]["deletionTimestamp"]  # finalizers respected
    dep_pod = emulator.control.get_object("v1/pods", ns, "dep-pod")
    assert dep_pod is not None
    assert dep_pod["metadata"]["deletionGracePeriodSeconds"] == 30  # graceful pod deletion
    emulator.control.kubelet_confirm(ns, "dep-pod")
    assert emulator.control.get_object("v1/pods", ns, "dep-pod") is None

    # Orphan propagation keeps the dependents and strips the reference.
    job2 = co.create_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", _job("owner2"))
    core.create_namespaced_config_map(ns, {"metadata": {"name": "orphan", **owned(job2)}})
    co.delete_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", "owner2", propagation_policy="Orphan"
    )
    time.sleep(0.1)
    orphan = emulator.control.get_object("v1/configmaps", ns, "orphan")
    assert orphan is not None
    assert "ownerReferences" not in orphan["metadata"]

    # Foreground: the owner waits (deletionTimestamp, foregroundDeletion) until its dependents are gone.
    job3 = co.create_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", _job("owner3"))
    pod3 = _pod("fg-pod", node="n1")
    pod3["metadata"].update(owned(job3))
    core.create_namespaced_pod(ns, pod3)
    co.delete_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", "owner3", propagation_policy="Foreground"
    )
    time.sleep(0.1)
    owner3 = emulator.control.get_object("ddpjob.io/v1alpha1/ddpjobs", ns, "owner3")
    assert owner3 is not None
    assert owner3["metadata"]["finalizers"] == ["foregroundDeletion"]
    emulator.control.kubelet_confirm(ns, "fg-pod")
    deadline = time.monotonic() + 5
    while (
        emulator.control.get_object("ddpjob.io/v1alpha1/ddpjobs", ns, "owner3") is not None
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert emulator.control.get_object("ddpjob.io/v1alpha1/ddpjobs", ns, "owner3") is None

    # Foreground, and a dependent created while the owner waits: as the real collector, the
    # emulator deletes it the next time it looks at the owner, when another dependent goes.
    job4 = co.create_namespaced_custom_object(*DDPJOB, ns, "ddpjobs", _job("owner4"))
    early = _pod("fg-early", node="n1")
    early["metadata"].update(owned(job4))
    core.create_namespaced_pod(ns, early)
    co.delete_namespaced_custom_object(
        *DDPJOB, ns, "ddpjobs", "owner4", propagation_policy="Foreground"
    )
    time.sleep(0.1)
    late = _pod("fg-late", node="n1")
    late["metadata"].update(owned(job4))
    core.create_namespaced_pod(ns, late)
    time.sleep(0.2)
    assert not (emulator.control.get_object("v1/pods", ns, "fg-late") or {})["metadata"].get(
        "deletionTimestamp"
    )
    emulator.control.kubelet_confirm(ns, "fg-early")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        found = emulator.control.get_object("v1/pods", ns, "fg-late")
        if found is not None and found["metadata"].get("deletionTimestamp"):
            break
        time.sleep(0.02)
    assert (emulator.control.get_object("v1/pods", ns, "fg-late") or {})["metadata"].get(
        "deletionTimestamp"
    ), "a dependent created during a foreground deletion is deleted too"
    emulator.control.kubelet_confirm(ns, "fg-late")
    deadline = time.monotonic() + 5
    while (
        emulator.control.get_object("ddpjob.io/v1alpha1/ddpjobs", ns, "owner4") is not None
        and time.monotonic() < deadline
    ):
        time.sleep(0.02)
    assert emulator.control.get_object("ddpjob.io/v1alpha1/ddpjobs", ns, "owner4") is None


def test_kubelet_helpers_and_auto_kubelet(
    emulator: EmulatorHandle, api: Any, ns: str, tmp_path: Path
) -> None:
    core = Core(api)
    core.create_namespaced_pod(ns, _pod("k"))
    scheduled = emulator.control.schedule_pod(ns, "k", "node-7")
    pod = emulator.control.set_pod_phase(ns, "k", "Running")
    assert pod["spec"]["nodeName"] == "node-7"
    assert pod["status"]["containerStatuses"][0]["state"]["running"]
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "True"
    assert pod["metadata"]["generation"] == scheduled["metadata"]["generation"]  # a status write
    pod = emulator.control.set_pod_phase(ns, "k", "Failed", exit_code=137, reason="OOMKilled")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137
    emulator.control.set_pod_log(ns, "k", "hello\n")
    assert core.read_namespaced_pod_log("k", ns) == "hello\n"

    with EmulatorThread(auto_kubelet=True, with_ddpjob_crd=False) as em:
        auto = Core(_client_from(em.write_kubeconfig(tmp_path / "kc")))
        auto.create_namespaced_pod("default", _pod("auto", terminationGracePeriodSeconds=1))
        deadline = time.monotonic() + 5
        while (
            auto.read_namespaced_pod("auto", "default").status.phase != "Running"
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert auto.read_namespaced_pod("auto", "default").spec.node_name
        auto.delete_namespaced_pod("auto", "default")
        while (
            em.control.get_object("v1/pods", "default", "auto") is not None
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        assert em.control.get_object("v1/pods", "default", "auto") is None
