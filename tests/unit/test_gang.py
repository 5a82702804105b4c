"""``gangScheduling: Native`` in the pure parts: the spec, the PodGroup and pods the builders
make, and ``ddpjob_operator.core.gang``: the choice of group, the ``GangScheduled`` condition (through
``reconcile()``), and when the PodGroup is posted (alone and through the controller). The real
scheduler's side is in tests/cluster/test_gang.py."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

import pytest

from ddpjob_operator import api, builders
from ddpjob_operator.controller import Controller, OperatorConfig
from ddpjob_operator.core import gang
from ddpjob_operator.core.actions import CreatePod, Decision, Observed
from ddpjob_operator.core.reconcile import reconcile
from ddpjob_operator.errors import SpecError
from ddpjob_operator.kube import ApiError, Credentials, KubeApi
from ddpjob_operator.metrics import Metrics
from ddpjob_operator.observe import ObservedPod, PodPhase, observe_pod
from ddpjob_operator.parse import parse_job

from .jobs import manifest
from .test_crd import cel_violations, schema

T0 = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
GANG = {"gangScheduling": "Native", "replicas": 3, "minReplicas": 2, "maxReplicas": 4}


def make_job(**spec: Any) -> api.DDPJob:
    return parse_job(manifest(**{**GANG, **spec}))


def pod(index: int, phase: PodPhase = PodPhase.RUNNING, **kw: Any) -> ObservedPod:
    kw.setdefault("uid", f"uid-{index}")
    kw.setdefault("pod_group", "demo")
    kw.setdefault("node", f"node-{index}" if phase is PodPhase.RUNNING else None)
    return ObservedPod(name=f"demo-worker-{index}", index=index, phase=phase, **kw)


def run(job: api.DDPJob, *pods: ObservedPod, served: bool | None = True) -> Decision:
    return reconcile(job, Observed(tuple(pods), True, served), T0)


def groups(decision: Decision) -> dict[int, Any]:
    """Each created pod's schedulingGroup (None when it has none)."""
    return {
        a.index: a.pod["spec"].get("schedulingGroup")
        for a in decision.actions
        if isinstance(a, CreatePod)
    }


def gang_condition(decision: Decision) -> tuple[str, str, str] | None:
    found = [c for c in decision.status.conditions if c.type == "GangScheduled"]
    return (found[0].status, found[0].reason, found[0].message) if found else None


# ---- the spec ------------------------------------------------------------------------------------


def test_gang_scheduling_is_off_by_default_and_native_on_request() -> None:
    assert parse_job(manifest()).spec.gang_scheduling is api.GangScheduling.NONE
    assert make_job().spec.gang_scheduling is api.GangScheduling.NATIVE
    with pytest.raises(SpecError, match=r"spec\.gangScheduling"):
        make_job(gangScheduling="Volcano")


def test_a_gang_and_a_template_group_of_ones_own_are_refused_with_the_fix() -> None:
    document = manifest(**GANG)
    document["spec"]["template"]["spec"]["schedulingGroup"] = {"podGroupName": "mine"}
    with pytest.raises(SpecError) as caught:
        parse_job(document)
    assert "remove template.spec.schedulingGroup, or set gangScheduling: None" in str(caught.value)
    # The API server refuses it too (the CRD's CEL rule), before any operator sees it...
    assert cel_violations(schema(), document) == [
        "gangScheduling: Native makes the job's own PodGroup: remove "
        "template.spec.schedulingGroup, or set gangScheduling: None"
    ]
    # ...and a group of one's own without a gang is passed through as it is.
    document["spec"]["gangScheduling"] = "None"
    plain = parse_job(document)
    assert builders.build_pod(plain, 0)["spec"]["schedulingGroup"] == {"podGroupName": "mine"}


def test_gang_scheduling_cannot_change_while_the_job_runs() -> None:
    """The pods' schedulingGroup is immutable: a change waits for a suspend."""
    old, new = manifest(), manifest(gangScheduling="Native")
    assert any("spec.gangScheduling cannot change" in v for v in cel_violations(schema(), new, old))
    new["spec"]["suspend"] = True
    assert cel_violations(schema(), new, old) == []


# ---- the builders --------------------------------------------------------------------------------


def test_the_pod_group_is_the_jobs_with_min_count_min_replicas_and_the_templates_priority() -> None:
    document = manifest(**GANG)
    document["spec"]["template"]["spec"]["priorityClassName"] = "research"
    job = parse_job(document)
    assert builders.build_pod_group(job) == {
        "apiVersion": "scheduling.k8s.io/v1beta1",
        "kind": "PodGroup",
        "metadata": {
            "name": "demo",
            "namespace": "ml",
            "labels": builders.labels(job),
            "ownerReferences": builders.owner_references(job),
        },
        "spec": {"schedulingPolicy": {"gang": {"minCount": 2}}, "priorityClassName": "research"},
    }
    assert "priorityClassName" not in builders.build_pod_group(make_job())["spec"]


def test_observe_reads_the_group_a_pod_names() -> None:
    job = make_job()
    ganged = builders.build_pod(job, 1, pod_group="demo")
    assert ganged["spec"]["schedulingGroup"] == {"podGroupName": "demo"}
    ganged["metadata"]["uid"] = "u1"
    alone = builders.build_pod(job, 1)
    alone["metadata"]["uid"] = "u2"
    assert "schedulingGroup" not in alone["spec"]
    seen = observe_pod(ganged), observe_pod(alone)
    assert [p.pod_group if p is not None else "?" for p in seen] == ["demo", ""]


# ---- the reconciler ------------------------------------------------------------------------------


def test_new_pods_of_a_gang_name_its_group_and_wait_for_it() -> None:
    decision = run(make_job())
    assert groups(decision) == {i: {"podGroupName": "demo"} for i in range(3)}
    assert gang_condition(decision) == ("False", "Waiting", "gang of 2 waits to be placed: 0 bound")
    waiting = run(make_job(), pod(0, PodPhase.PENDING), pod(1, PodPhase.PENDING))
    assert gang_condition(waiting) == ("False", "Waiting", "gang of 2 waits to be placed: 0 bound")


def test_a_gang_the_scheduler_cannot_place_says_so_with_its_message() -> None:
    message = "pod group is unschedulable, minCount (2) cannot be satisfied: 1 scheduled"
    unschedulable = {"waiting_reason": "Unschedulable", "waiting_message": message}
    decision = run(
        make_job(),
        pod(0, PodPhase.PENDING, **unschedulable),
        pod(1, PodPhase.PENDING, **unschedulable),
        pod(2, PodPhase.PENDING, **unschedulable),
    )
    assert gang_condition(decision) == (
        "False",
        "Unschedulable",
        f"gang of 2 cannot be placed: {message}",
    )
    assert [(w.pod, w.reason) for w in decision.status.waiting] == [
        (f"demo-worker-{i}", "Unschedulable") for i in range(3)
    ]


def test_a_placed_gang_stays_placed_while_extra_pods_wait_one_by_one() -> None:
    extra = pod(2, PodPhase.PENDING, waiting_reason="Unschedulable", waiting_message="no room")
    decision = run(make_job(), pod(0), pod(1), extra)
    assert gang_condition(decision) == ("True", "Placed", "gang of 2 placed: 2 of 3 pods bound")
    assert decision.status.phase is api.JobPhase.RUNNING


def test_a_suspended_gang_is_no_longer_said_to_be_placed() -> None:
    placed = run(make_job(), pod(0), pod(1), pod(2))
    assert gang_condition(placed) == ("True", "Placed", "gang of 2 placed: 3 of 3 pods bound")
    suspended = make_job(suspend=True).model_copy(update={"status": placed.status})
    decision = run(suspended, pod(0), pod(1), pod(2))
    message = "no gang to place until the job runs again"
    assert gang_condition(decision) == ("False", "Suspended", message)
    assert decision.status.phase is api.JobPhase.SUSPENDED
    # Resumed: placed again once its pods are bound.
    resumed = make_job().model_copy(update={"status": decision.status})
    again = run(resumed, pod(0), pod(1), pod(2))
    assert gang_condition(again) == ("True", "Placed", "gang of 2 placed: 3 of 3 pods bound")
    # A job that never asked for a gang gets no such condition when suspended either.
    plain = parse_job(manifest(suspend=True))
    assert gang_condition(run(plain)) is None


def then(job: api.DDPJob, decision: Decision | None, **spec: Any) -> api.DDPJob:
    """The job after the executor's status write, if any (with ``spec`` changed, if given)."""
    status = job.status if decision is None else decision.status
    job = make_job(**{**FULL, **spec}) if spec else job
    return job.model_copy(update={"status": status})


FULL = {"replicas": 3, "minReplicas": 3, "maxReplicas": 3}
SUCCEEDED = PodPhase.SUCCEEDED
ENDED = "no gang to place: the job {}"


def test_a_finished_gang_says_the_job_ended_not_where_its_last_pods_were() -> None:
    """A gang of 3 whose pods succeed one after another: while it completes nothing is placed
    any more (the condition keeps its last word), and once it has succeeded the condition says
    so, not "gang of 3 waits to be placed: 1 bound" (the last pod still running)."""
    job = make_job(**FULL)
    placed = run(job, pod(0), pod(1), pod(2))
    assert gang_condition(placed) == ("True", "Placed", "gang of 3 placed: 3 of 3 pods bound")
    job = then(job, placed)
    completing = run(job, pod(0, SUCCEEDED), pod(1, SUCCEEDED), pod(2))
    assert gang_condition(completing) == gang_condition(placed)
    job = then(job, completing)
    ended = run(job, pod(0, SUCCEEDED), pod(1, SUCCEEDED), pod(2, SUCCEEDED))
    assert ended.status.phase is api.JobPhase.SUCCEEDED
    assert gang_condition(ended) == ("False", "Succeeded", ENDED.format("succeeded"))
    # The finished job's next passes leave its status as it is (no write).
    job = then(job, ended)
    assert run(job, pod(0, SUCCEEDED), pod(1, SUCCEEDED), pod(2, SUCCEEDED)).status == job.status


def test_a_failed_gang_says_the_job_ended() -> None:
    job = make_job(**FULL, restartPolicy="Never")
    job = then(job, run(job, pod(0), pod(1), pod(2)))
    ended = run(job, pod(0), pod(1), pod(2, PodPhase.FAILED, exit_code=1))
    assert ended.status.phase is api.JobPhase.FAILED
    assert gang_condition(ended) == ("False", "Failed", ENDED.format("failed"))


def test_a_gang_suspended_while_completing_says_it_ended_once_resumed() -> None:
    job = make_job(**FULL)
    job = then(job, run(job, pod(0), pod(1), pod(2)))
    job = then(job, run(job, pod(0, SUCCEEDED), pod(1, SUCCEEDED), pod(2)))
    suspended = run(then(job, None, suspend=True), pod(0, SUCCEEDED), pod(1, SUCCEEDED), pod(2))
    assert gang_condition(suspended) == (
        "False",
        "Suspended",
        "no gang to place until the job runs again",
    )
    resumed = run(then(job, suspended, suspend=False), pod(0, SUCCEEDED), pod(1, SUCCEEDED))
    assert resumed.status.phase is api.JobPhase.SUCCEEDED
    assert gang_condition(resumed) == ("False", "Succeeded", ENDED.format("succeeded"))


def test_a_job_an_older_operator_finished_loses_its_stale_gang_condition() -> None:
    stale = api.set_condition(
        [],
        api.ConditionType.GANG_SCHEDULED,
        False,
        "Waiting",
        "gang of 3 waits to be placed: 1 bound",
        T0,
    )
    job = make_job(**FULL).model_copy(
        update={"status": api.DDPJobStatus(phase=api.JobPhase.SUCCEEDED, conditions=stale)}
    )
    decision = run(job, pod(0, SUCCEEDED))
    assert gang_condition(decision) == ("False", "Succeeded", ENDED.format("succeeded"))


def test_without_the_api_the_job_runs_without_a_gang_and_says_why() -> None:
    decision = run(make_job(), served=False)
    assert groups(decision) == {0: None, 1: None, 2: None}
    status, reason, message = gang_condition(decision) or ("", "", "")
    assert (status, reason) == ("False", "PodGroupsNotServed")
    assert message.startswith("this cluster serves no scheduling.k8s.io/v1beta1 PodGroups")


def test_pods_made_without_the_group_keep_new_pods_out_of_it() -> None:
    """A grouped newcomer among ungrouped running pods would wait for a minCount it can never
    reach alone: until the job's pods are all gone, new ones join the others without a gang."""
    job = make_job()
    decision = run(job, pod(0, pod_group=""), pod(1, pod_group=""))
    assert groups(decision) == {2: None}
    assert (gang_condition(decision) or ("", ""))[:2] == ("False", "PodsWithoutGroup")
    # An ungrouped pod on its way out, or one not seen yet (pod_group None), does not count.
    leaving = run(job, pod(0, pod_group="", deleting=True), pod(1), pod(2, pod_group=None))
    assert groups(leaving) == {}
    fresh = run(job, pod(0, pod_group="", deleting=True), pod(1))
    assert groups(fresh) == {2: {"podGroupName": "demo"}}


def test_a_job_without_a_gang_gets_no_group_and_no_condition() -> None:
    job = parse_job(manifest(replicas=2))
    decision = run(job, served=True)
    assert groups(decision) == {0: None, 1: None}
    assert gang_condition(decision) is None
    # The local runner asks nothing (None): no condition either.
    assert gang_condition(run(make_job(), pod(0), served=None)) is None


# ---- the controller ------------------------------------------------------------------------------


class GangKube:
    """Records a pass's calls; answers discovery with ``served``."""

    def __init__(self, body: dict[str, Any], served: bool) -> None:
        self.body = body
        self.served = served
        self.calls: list[tuple[str, Any]] = []

    async def pod_groups_served(self) -> bool:
        self.calls.append(("discovery", None))
        return self.served

    async def write_status(self, ns: str, name: str, version: str, status: Any) -> Any:
        return {**self.body, "status": status}

    async def workloads_served(self) -> bool:  # no Kueue here
        return False

    async def create_service(self, ns: str, service: Any) -> None:
        self.calls.append(("service", None))

    async def create_secret(self, ns: str, secret: Any) -> None:
        self.calls.append(("secret", None))

    async def ensure_pod_group(self, ns: str, group: Any) -> None:
        await asyncio.sleep(0.01)  # pods must still wait for it
        self.calls.append(("podgroup", group["spec"]["schedulingPolicy"]["gang"]["minCount"]))

    async def create_pod(self, ns: str, pod: Any) -> None:
        self.calls.append(("pod", pod["spec"].get("schedulingGroup")))


def one_pass(ctl: Controller, body: dict[str, Any], pods: list[Any] | None = None) -> None:
    asyncio.run(
        ctl.run_pass(
            ("ml", "demo"),
            body,
            logging.getLogger("test"),
            pods=lambda: pods or [],
            service=lambda: True,
            emit=lambda *event: None,
        )
    )


def test_the_pod_group_comes_before_the_pods_and_is_posted_once() -> None:
    body = manifest(**GANG)
    body["metadata"]["resourceVersion"] = "1"
    kube = GangKube(body, served=True)
    ctl = Controller(kube, Metrics(), OperatorConfig())  # type: ignore[arg-type]
    one_pass(ctl, body)
    group = {"podGroupName": "demo"}
    assert [c for c in kube.calls if c[0] != "secret"] == [
        ("discovery", None),
        ("podgroup", 2),
        ("pod", group),
        ("pod", group),
        ("pod", group),
    ]
    kube.calls.clear()
    one_pass(ctl, body)
    assert kube.calls == []  # discovery is kept, the group is made


WAITING = ObservedPod("demo-worker-0", 0, "u0", PodPhase.PENDING, pod_group="demo")
BOUND = ObservedPod("demo-worker-0", 0, "u0", PodPhase.RUNNING, pod_group="demo", node="n")
RECENT = gang.Posted(2, 1000.0)
LONG_AGO = gang.Posted(2, 1000.0 - gang.RECHECK_SECONDS - 1)
FINISHED = api.DDPJobStatus(phase=api.JobPhase.SUCCEEDED)


@pytest.mark.parametrize(
    ("spec", "status", "served", "posted", "pods", "posts"),
    [
        ({}, None, True, None, [], True),  # never made by this operator (or it restarted)
        ({}, None, True, RECENT, [BOUND], False),
        ({}, None, True, RECENT, [WAITING], False),  # posted just now
        # A PodGroup someone deleted would leave the gang's pods unscheduled for ever.
        ({}, None, True, LONG_AGO, [WAITING], True),
        ({}, None, True, LONG_AGO, [BOUND], False),  # nothing waits: nothing to repair
        # A suspended job's minReplicas changed: the group is posted (its minCount set) again.
        ({"minReplicas": 3}, None, True, RECENT, [BOUND], True),
        ({}, None, False, None, [WAITING], False),  # not served: never
        ({}, None, None, None, [WAITING], False),  # no gang asked for
        ({}, FINISHED, True, None, [], False),
    ],
    ids=[
        "new",
        "made",
        "waiting-recently-posted",
        "waiting-long-ago",
        "bound",
        "resized",
        "not-served",
        "no-gang",
        "finished",
    ],
)
def test_the_pod_group_is_posted_when_new_resized_or_waited_on_long(
    spec: dict[str, Any],
    status: api.DDPJobStatus | None,
    served: bool | None,
    posted: gang.Posted | None,
    pods: list[ObservedPod],
    posts: bool,
) -> None:
    job = make_job(**spec)
    if status is not None:
        job = job.model_copy(update={"status": status})
    wanted = builders.build_pod_group(job) if posts else None
    assert gang.to_post(job, served, posted, pods, 1000.0) == wanted


def test_the_controller_remembers_the_group_it_posted() -> None:
    body = manifest(**GANG)
    body["metadata"]["resourceVersion"] = "1"
    ctl = Controller(GangKube(body, served=True), Metrics(), OperatorConfig())  # type: ignore[arg-type]
    one_pass(ctl, body)
    posted = ctl._jobs[("ml", "demo")].remembered.pod_group
    assert posted is not None
    assert posted.min_count == 2


def test_without_the_api_no_group_is_posted_and_pods_have_none() -> None:
    body = manifest(**GANG)
    body["metadata"]["resourceVersion"] = "1"
    kube = GangKube(body, served=False)
    ctl = Controller(kube, Metrics(), OperatorConfig())  # type: ignore[arg-type]
    one_pass(ctl, body)
    assert [c for c in kube.calls if c[0] not in ("secret", "service")] == [
        ("discovery", None),
        ("pod", None),
        ("pod", None),
        ("pod", None),
    ]


class Recording(KubeApi):
    """A KubeApi whose requests go to ``answer`` (method, path, body) -> JSON or ApiError."""

    def __init__(self, answer: Any) -> None:
        super().__init__(
            Credentials(server="http://127.0.0.1:9", token=lambda: None, ssl_context=False)
        )
        self.answer = answer
        self.sent: list[tuple[str, str, Any]] = []

    async def request(self, method: str, path: str, body: object = None, **_: Any) -> Any:
        self.sent.append((method, path, body))
        result = self.answer(method, path, body)
        if isinstance(result, ApiError):
            raise result
        return result


def test_an_existing_group_of_the_job_gets_the_min_count_and_a_foreign_one_is_refused() -> None:
    job = make_job(minReplicas=3)
    group = builders.build_pod_group(job)
    path = "/apis/scheduling.k8s.io/v1beta1/namespaces/ml/podgroups"

    def ours(method: str, path_: str, body: Any) -> Any:
        if method == "POST":
            return ApiError(409, "AlreadyExists", "podgroups demo exists")
        return {
            "metadata": {"name": "demo", "ownerReferences": group["metadata"]["ownerReferences"]}
        }

    kube = Recording(ours)
    asyncio.run(kube.ensure_pod_group("ml", group))
    assert [(m, p) for m, p, _ in kube.sent] == [
        ("POST", path),
        ("GET", f"{path}/demo"),
        ("PATCH", f"{path}/demo"),
    ]
    assert kube.sent[-1][2] == {"spec": {"schedulingPolicy": {"gang": {"minCount": 3}}}}

    def foreign(method: str, path_: str, body: Any) -> Any:
        if method == "POST":
            return ApiError(409, "AlreadyExists", "podgroups demo exists")
        return {"metadata": {"name": "demo"}}

    kube = Recording(foreign)
    with pytest.raises(ApiError, match="PodGroup ml/demo exists and is not"):
        asyncio.run(kube.ensure_pod_group("ml", group))
    assert [m for m, _, _ in kube.sent] == ["POST", "GET"]  # never patched

    forbidden = Recording(lambda *_: ApiError(403, "Forbidden", "podgroups is forbidden"))
    with pytest.raises(ApiError) as caught:
        asyncio.run(forbidden.ensure_pod_group("ml", group))
    assert "grant the operator create, get and patch on scheduling.k8s.io podgroups" in str(
        caught.value
    )


@pytest.mark.parametrize(
    ("answer", "served"),
    [
        ({"resources": [{"name": "podgroups"}, {"name": "workloads"}]}, True),
        ({"resources": [{"name": "workloads"}]}, False),
        (ApiError(404, "NotFound", "the server could not find the requested resource"), False),
    ],
    ids=["served", "no-podgroups", "no-api-version"],
)
def test_discovery_tells_whether_pod_groups_are_served(answer: Any, served: bool) -> None:
    kube = Recording(lambda *_: answer)
    assert asyncio.run(kube.pod_groups_served()) is served
    assert kube.sent == [("GET", "/apis/scheduling.k8s.io/v1beta1", None)]
