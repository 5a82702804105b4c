"""The only module that calls the Kubernetes API: the operator's executor.

Credentials come from the official ``kubernetes`` client's loaders (in-cluster service account
first, else ``KUBECONFIG`` / ``~/.kube/config``, including exec plugins and token refresh), and
requests go out on one aiohttp session, so the operator never blocks its event loop on I/O.

Every call is retried on 429, 5xx and connection errors with capped exponential backoff
(``Retry-After`` is honoured), and every error is counted by code. The calls are idempotent
where it matters: creating an object that exists (409 AlreadyExists) is success when it has
the same controller (anything else under the name is an :class:`OwnershipError`), deleting one
that is gone (404) is success, and deletes carry a uid precondition, so a replacement pod of the
same name is never deleted by mistake. A stale status write raises :class:`ConflictError`: the
caller reads the job again and decides again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import aiohttp
import kubernetes

from ddpjob_operator import api
from ddpjob_operator.core import workload
from ddpjob_operator.errors import DDPJobError

JSON = dict[str, Any]
T = TypeVar("T")
logger = logging.getLogger("ddpjob_operator.kube")

RETRY_DELAYS = (0.1, 0.2, 0.5, 1.0, 2.0, 4.0)
"""Backoff between attempts on 429, 5xx and connection errors (then the error is raised)."""
REQUEST_TIMEOUT = 30.0
USER_AGENT = "ddpjob-operator"
JOBS = f"/apis/{api.GROUP}/{api.VERSION}"


class ApiError(DDPJobError):
    """The API server answered with an error (after retries, for the retryable ones)."""

    def __init__(self, status: int, reason: str, message: str) -> None:
        self.status = status
        self.reason = reason
        super().__init__(f"{status} {reason}: {message}")


class ConflictError(ApiError):
    """409: a stale resourceVersion (or a failed precondition)."""


class OwnershipError(ApiError):
    """An object we create exists already under its name, and is not ours."""


class CrdMissingError(DDPJobError):
    """The DDPJob CRD is not installed in the cluster."""


@dataclasses.dataclass(frozen=True)
class Credentials:
    server: str
    token: Callable[[], str | None]
    ssl_context: ssl.SSLContext | bool


def load_credentials(kubeconfig: str | None = None) -> Credentials:
    """In-cluster config if there is one, else the kubeconfig (``KUBECONFIG``)."""
    config = kubernetes.client.Configuration()
    try:
        kubernetes.config.load_incluster_config(client_configuration=config)  # type: ignore[no-untyped-call]
    except kubernetes.config.ConfigException:
        try:
            kubernetes.config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=config
            )
        except (kubernetes.config.ConfigException, OSError) as exc:
            raise DDPJobError(
                "no Kubernetes credentials: not in a cluster, and no usable kubeconfig "
                f"({exc}); set KUBECONFIG or run in a pod with a service account"
            ) from exc
    return _credentials(config)


def _credentials(config: kubernetes.client.Configuration) -> Credentials:
    context: ssl.SSLContext | bool = False
    if config.host.startswith("https"):
        context = ssl.create_default_context(cafile=config.ssl_ca_cert)
        if config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file)
        if not config.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE

    def token() -> str | None:
        # The lookup runs the refresh hook first (in-cluster token rotation, exec plugins).
        # kubernetes >= 36 keeps the token under "BearerToken"; older clients under
        # "authorization". Asking for only the old key sent no token at all with a new client.
        value: str | None = config.get_api_key_with_prefix("BearerToken", alias="authorization")
        if value is None and config.username:
            value = config.get_basic_auth_token()
        return value

    return Credentials(server=config.host.rstrip("/"), token=token, ssl_context=context)


ErrorHook = Callable[[int], None]


class KubeApi:
    """A small async client: JSON in, JSON out, retries and error metrics built in."""

    def __init__(self, credentials: Credentials, on_error: ErrorHook | None = None) -> None:
        self.credentials = credentials
        self.on_error = on_error or (lambda _: None)
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
                connector=aiohttp.TCPConnector(ssl=self.credentials.ssl_context, limit=64),
            )
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> JSON:
        headers = {
            "Accept": "application/json",
            "Content-Type": content_type,
            "User-Agent": USER_AGENT,
        }
        data = None if body is None else json.dumps(body)
        for attempt, delay in enumerate((*RETRY_DELAYS, None)):
            token = self.credentials.token()
            if token:
                headers["Authorization"] = token
            try:
                async with self._client().request(
                    method,
                    self.credentials.server + path,
                    data=data,
                    headers=headers,
                    params=params,
                ) as response:
                    text = await response.text()
                    if response.status < 400:
                        result: JSON = json.loads(text) if text else {}
                        return result
                    error = _api_error(response.status, text)
                    retry_after = response.headers.get("Retry-After")
            except (aiohttp.ClientError, TimeoutError) as exc:
                error = ApiError(0, "ConnectionError", str(exc) or type(exc).__name__)
                retry_after = None
            self.on_error(error.status)
            if delay is None or not _retryable(error.status):
                raise error
            wait = delay
            if retry_after and retry_after.isdigit():
                wait = max(delay, min(float(retry_after), 10.0))
            logger.debug("%s %s: %s; retry %d in %.1fs", method, path, error, attempt + 1, wait)
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- the calls the operator makes ----------------------------------------------------

    async def served_resources(self, group_version_path: str) -> set[str] | None:
        """The resources an API group version serves (discovery: no RBAC needed), or None when
        the server does not serve that group version at all (404)."""
        try:
            resources = await self.request("GET", group_version_path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        return {str(r.get("name")) for r in resources.get("resources") or []}

    async def check_crd(self) -> None:
        """Refuse to start without the DDPJob CRD."""
        names = await self.served_resources(JOBS)
        if names is None:
            raise CrdMissingError(
                f"the DDPJob CRD ({api.PLURAL}.{api.GROUP}, {api.VERSION}) is not installed in "
                "this cluster: kubectl apply -f deploy/crd.yaml (or install the Helm chart), "
                "then start the operator again"
            )
        if api.PLURAL not in names:
            raise CrdMissingError(
                f"{JOBS} does not serve {api.PLURAL}: the CRD is not the one this operator needs; "
                "kubectl apply -f deploy/crd.yaml"
            )

    async def get_job(self, namespace: str, name: str) -> JSON:
        return await self.request("GET", f"{JOBS}/namespaces/{namespace}/{api.PLURAL}/{name}")

    async def write_status(
        self, namespace: str, name: str, resource_version: str, status: JSON
    ) -> JSON:
        """Replace ``.status`` whole, only if the job is still at ``resource_version``.

        A merge patch replaces lists wholesale, so sending the full status keeps every list
        exactly as decided; the resourceVersion makes a stale write fail with 409.
        """
        body = {"metadata": {"resourceVersion": resource_version}, "status": status}
        return await self.request(
            "PATCH",
            f"{JOBS}/namespaces/{namespace}/{api.PLURAL}/{name}/status",
            body,
            content_type="application/merge-patch+json",
        )

    async def delete_job(self, namespace: str, name: str, uid: str) -> None:
        await self._delete(
            f"{JOBS}/namespaces/{namespace}/{api.PLURAL}/{name}",
            {"preconditions": {"uid": uid}, "propagationPolicy": "Background"},
        )

    async def create(self, path: str, body: JSON) -> bool:
        """Create; an object of that name that exists already is fine (idempotent) if it has
        the same controller (the owner reference with ``controller: true``) as ``body``.
        True when this call made it, False when it was there.

        Anything else under that name (a user's object, or one of an earlier job of the same
        name that is still being deleted) raises :class:`OwnershipError`, naming it.
        """
        try:
            await self.request("POST", path, body)
            return True
        except ApiError as exc:
            if exc.status != 409:
                raise
        name = str(body["metadata"]["name"])
        try:
            existing = await self.request("GET", f"{path}/{name}")
        except ApiError as exc:
            if exc.status == 404:  # gone in between: the next pass creates it
                raise ApiError(409, "Conflict", f"{path}/{name} was being deleted") from exc
            raise
        wanted, found = controller_uid(body), controller_uid(existing)
        if found == wanted:
            return False
        kind = str(body.get("kind", "object"))
        namespace = str(body["metadata"].get("namespace", ""))
        owners: list[JSON] = body["metadata"].get("ownerReferences") or []
        owner: JSON = next((o for o in owners if o.get("controller")), {})
        whose = f"{owner.get('kind', '')} {namespace}/{owner.get('name', '')}".strip()
        if found is None:
            fix = (
                f"it has no controller: delete or rename that {kind}, or give the job another name"
            )
        else:
            fix = (
                f"its controller is another object (uid {found}), most likely an earlier job of "
                "the same name that is still being deleted: it is retried until that one is gone"
            )
        raise OwnershipError(
            409, "AlreadyExists", f"{kind} {namespace}/{name} exists and is not {whose}'s: {fix}"
        )

    async def create_pod(self, namespace: str, pod: JSON) -> None:
        await self.create(f"/api/v1/namespaces/{namespace}/pods", pod)

    async def create_service(self, namespace: str, service: JSON) -> None:
        await self.create(f"/api/v1/namespaces/{namespace}/services", service)

    async def create_network_policy(self, namespace: str, policy: JSON) -> None:
        await self._create_or_say(
            namespace,
            f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies",
            policy,
            "NetworkPolicy",
            ", which the job asks for (spec.networkPolicy, or the operator's --network-policy)",
            "grant the operator get, create and delete on networking.k8s.io networkpolicies (the "
            "Helm chart does), or set spec.networkPolicy: false. The job's pods are not created "
            "until the policy exists",
        )

    async def create_secret(self, namespace: str, secret: JSON) -> None:
        """The job's store-key Secret. Its data never reaches a log or an error message."""
        await self._create_or_say(
            namespace,
            f"/api/v1/namespaces/{namespace}/secrets",
            secret,
            "Secret",
            ", the job's rendezvous store key",
            "grant the operator create and get on secrets (core) in this namespace (the Helm "
            "chart does, with rbac.create: true; with rbac.create: false add them to your own "
            "Role). The job's pods are not created until the Secret exists",
        )

    async def pod_groups_served(self) -> bool:
        """The cluster serves native PodGroups."""
        return "podgroups" in (await self.served_resources(f"/apis/{api.POD_GROUP_API}") or ())

    async def ensure_pod_group(self, namespace: str, group: JSON) -> None:
        """Create the job's PodGroup; if it is there already, set its ``minCount`` (the only
        field of it that may change: a suspended job's ``minReplicas`` may have)."""
        path = f"/apis/{api.POD_GROUP_API}/namespaces/{namespace}/podgroups"
        made = await self._create_or_say(
            namespace,
            path,
            group,
            "PodGroup",
            ", which the job asks for (spec.gangScheduling: Native)",
            "grant the operator create, get and patch on scheduling.k8s.io podgroups (the Helm "
            "chart does), or set spec.gangScheduling: None. The job's pods are not created "
            "until the group exists",
        )
        if not made:
            policy = {"spec": {"schedulingPolicy": group["spec"]["schedulingPolicy"]}}
            await self.request(
                "PATCH",
                f"{path}/{group['metadata']['name']}",
                policy,
                content_type="application/merge-patch+json",
            )

    async def workloads_served(self) -> bool:
        """The cluster serves Kueue's Workloads (Kueue is installed)."""
        return "workloads" in (await self.served_resources(f"/apis/{api.KUEUE_API}") or ())

    async def list_workloads(self, namespace: str, job_uid: str) -> list[JSON]:
        """The Workloads Kueue's job-uid label ties to the job (its slices, old and new)."""
        result = await self.request(
            "GET",
            f"/apis/{api.KUEUE_API}/namespaces/{namespace}/workloads",
            params={"labelSelector": f"{workload.JOB_UID_LABEL}={job_uid}"},
        )
        return list(result.get("items") or [])

    async def get_workload(self, namespace: str, name: str) -> JSON | None:
        return await self._get_or_none(
            f"/apis/{api.KUEUE_API}/namespaces/{namespace}/workloads/{name}"
        )

    async def create_workload(self, namespace: str, body: JSON) -> None:
        await self._create_or_say(
            namespace,
            f"/apis/{api.KUEUE_API}/namespaces/{namespace}/workloads",
            body,
            "Workload",
            f", which the job's {workload.QUEUE_LABEL} label asks Kueue for",
            "install the chart with kueue.enabled: true (it grants the operator Kueue's "
            "workloads, workloads/status and the flavors and priority classes it reads), or "
            "remove the label to run the job without Kueue. No pod is created until Kueue "
            "admits the Workload",
        )

    async def patch_workload(
        self, namespace: str, name: str, patch: JSON, *, status: bool = False
    ) -> None:
        """A merge patch of a Workload (or of its status); a 409 (the patch carries the
        resourceVersion it was decided on) or a 404 is left to the next pass."""
        merge = "application/merge-patch+json"
        path = f"/apis/{api.KUEUE_API}/namespaces/{namespace}/workloads/{name}"
        try:
            if status:
                await self.request("PATCH", f"{path}/status", patch, content_type=merge)
            else:
                await self.request("PATCH", path, patch, content_type=merge)
        except ApiError as exc:
            if exc.status not in (404, 409):
                raise

    async def release_workload(
        self, namespace: str, name: str, uid: str, finalizers: Sequence[str]
    ) -> None:
        """Remove Kueue's resource-in-use finalizer from a Workload that holds no quota."""
        await self._remove_finalizer(
            f"/apis/{api.KUEUE_API}/namespaces/{namespace}/workloads/{name}",
            uid,
            finalizers,
            workload.FINALIZER,
        )

    async def get_resource_flavor(self, name: str) -> JSON | None:
        """A ResourceFlavor (cluster-scoped), or None if there is none of that name."""
        return await self._get_or_none(f"/apis/{api.KUEUE_API}/resourceflavors/{name}")

    async def priority_value(self, kueue_class: bool, name: str) -> int | None:
        """The value of a Kueue WorkloadPriorityClass, or of a PriorityClass; None if absent."""
        if kueue_class:
            found = await self._get_or_none(f"/apis/{api.KUEUE_API}/workloadpriorityclasses/{name}")
        else:
            found = await self._get_or_none(f"/apis/scheduling.k8s.io/v1/priorityclasses/{name}")
        return None if found is None else int(found.get("value") or 0)

    async def _get_or_none(self, path: str) -> JSON | None:
        """The object at ``path``, or None if there is none."""
        try:
            return await self.request("GET", path)
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def _create_or_say(
        self, namespace: str, path: str, body: JSON, kind: str, what: str, fix: str
    ) -> bool:
        """:meth:`create`; a 403 says which object the job needs, and how to grant it."""
        try:
            return await self.create(path, body)
        except ApiError as exc:
            if exc.status != 403:
                raise
            name = f"{namespace}/{body['metadata']['name']}"
            raise ApiError(
                403, exc.reason, f"cannot create {kind} {name}{what}: {exc}; {fix}"
            ) from exc

    async def delete_pod(self, namespace: str, name: str, uid: str, force: bool = False) -> None:
        options: JSON = {"preconditions": {"uid": uid}}
        if force:
            options["gracePeriodSeconds"] = 0
        await self._delete(f"/api/v1/namespaces/{namespace}/pods/{name}", options)

    async def _delete(self, path: str, options: JSON) -> None:
        try:
            await self.request("DELETE", path, options)
        except ApiError as exc:
            # Gone already, or the name now belongs to another incarnation: nothing to do.
            if exc.status not in (404, 409):
                raise

    async def remove_finalizer(
        self, namespace: str, name: str, uid: str, finalizers: Sequence[str], finalizer: str
    ) -> None:
        """Remove one finalizer of a pod."""
        await self._remove_finalizer(
            f"/api/v1/namespaces/{namespace}/pods/{name}", uid, finalizers, finalizer
        )

    async def _remove_finalizer(
        self, path: str, uid: str, finalizers: Sequence[str], finalizer: str
    ) -> None:
        """Remove one finalizer, guarded by the object's uid and its current finalizer list."""
        current = list(finalizers)
        for _ in range(3):
            if finalizer not in current:
                return
            patch = [
                {"op": "test", "path": "/metadata/uid", "value": uid},
                {"op": "test", "path": "/metadata/finalizers", "value": current},
                {
                    "op": "replace",
                    "path": "/metadata/finalizers",
                    "value": [f for f in current if f != finalizer],
                },
            ]
            try:
                await self.request("PATCH", path, patch, content_type="application/json-patch+json")
                return
            except ApiError as exc:
                if exc.status == 404:
                    return
                if exc.status not in (409, 422):
                    raise
            # Someone changed the object (or its finalizers) since we looked: look again.
            try:
                found = await self.request("GET", path)
            except ApiError as exc:
                if exc.status == 404:
                    return
                raise
            if found.get("metadata", {}).get("uid") != uid:
                return
            current = list(found.get("metadata", {}).get("finalizers") or [])

    async def list_pods(self, namespace: str, selector: str) -> list[JSON]:
        result = await self.request(
            "GET", f"/api/v1/namespaces/{namespace}/pods", params={"labelSelector": selector}
        )
        return list(result.get("items") or [])


def controller_uid(obj: JSON) -> str | None:
    """The uid of the object's controller (its owner reference with ``controller: true``)."""
    for owner in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if owner.get("controller"):
            return str(owner.get("uid"))
    return None


def _retryable(status: int) -> bool:
    return status in (0, 429) or status >= 500


def _api_error(status: int, text: str) -> ApiError:
    reason, message = "", text[:500]
    with contextlib.suppress(ValueError, AttributeError):
        body = json.loads(text)
        reason = str(body.get("reason") or "")
        message = str(body.get("message") or message)
    kind = ConflictError if status == 409 else ApiError
    return kind(status, reason or "Error", message)


class Kept(Generic[T]):
    """Answers kept for a while, by key (discovery, ResourceFlavors: what changes seldom)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._kept: dict[str, tuple[T, float]] = {}

    async def get(self, key: str, fetch: Callable[[], Awaitable[T]]) -> T:
        now = time.monotonic()
        known = self._kept.get(key)
        if known is None or now - known[1] > self.seconds:
            known = (await fetch(), now)
            self._kept[key] = known
        return known[0]
