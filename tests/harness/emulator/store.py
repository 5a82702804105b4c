"""The state of the emulated API server: resources, objects, resourceVersions, watch history.

Everything here is synchronous and runs in the server's event loop thread only, so one write is
atomic with respect to every other request (like one etcd transaction) and no locks are needed.
The HTTP layer (:mod:`tests.harness.emulator.server`) translates requests into calls of
:class:`Emulator` and :class:`ApiError` into ``Status`` responses.

Indexes that keep requests O(matching objects), not O(all objects):

* objects by resource (group, plural), then by namespace, then by name;
* every object by uid (owner lookups, preconditions);
* dependents by owner uid (garbage collection);
* a bounded watch history per resource, and the open watches per resource.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import datetime
import functools
import gzip
import importlib.resources
import json
import random
import re
import string
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import kmock

from tests.harness.emulator.patches import (
    PatchConflictError,
    PatchError,
    apply_json_patch,
    apply_merge_patch,
    apply_strategic_merge_patch,
)
from tests.harness.emulator.selectors import (
    FieldRequirement,
    LabelRequirement,
    match_fields,
    match_labels,
)

Obj = dict[str, Any]

STANDARD_VERBS = frozenset(
    {"create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"}
)
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
_GENERATE_ALPHABET = string.ascii_lowercase + string.digits
# Fields of the object that are not "spec-like": changing only these never bumps generation.
_NON_SPEC_FIELDS = frozenset({"metadata", "status", "apiVersion", "kind"})
# Metadata only the server sets; client writes to them are ignored (restored from storage).
_SERVER_META = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
    "namespace",
    "name",
)


def now_rfc3339(offset_seconds: float = 0.0) -> str:
    moment = datetime.datetime.now(tz=datetime.UTC) + datetime.timedelta(seconds=offset_seconds)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _copy(obj: Any) -> Any:
    """A deep copy of a JSON document (faster than copy.deepcopy for plain JSON)."""
    return json.loads(json.dumps(obj))


class ApiError(Exception):
    """An error the server answers with a ``Status`` body."""

    def __init__(
        self,
        code: int,
        reason: str,
        message: str,
        details: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.reason = reason
        self.message = message
        self.details = details or {}
        self.headers = headers or {}

    def status(self) -> Obj:
        return status_body(self.code, self.reason, self.message, self.details)


def status_body(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> Obj:
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        body["details"] = details
    return body


@dataclass(eq=False)
class ResourceDef:
    """One served group/version/plural, with the facts discovery and storage need."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    verbs: frozenset[str] = STANDARD_VERBS
    shortnames: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    # For the scale subresource: dotted paths as in a CRD's subresources.scale.
    scale_spec_path: str = ".spec.replicas"
    scale_status_path: str = ".status.replicas"
    scale_selector_path: str | None = None
    custom: bool = False  # a custom resource (from a CRD): strategic merge patch is refused

    @property
    def key(self) -> tuple[str, str]:
        """The storage key: versions of one group/plural share their objects."""
        return (self.group, self.plural)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def group_resource(self) -> str:
        return f"{self.plural}.{self.group}" if self.group else self.plural


@dataclass(slots=True)
class WatchEvent:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None  # the previous state for MODIFIED (for selector transitions)


@dataclass(eq=False)
class Watcher:
    """One open watch stream: a queue the store pushes events into."""

    namespace: str | None
    labels: list[LabelRequirement]
    fields: list[FieldRequirement]
    queue: asyncio.Queue[WatchEvent | None] = field(default_factory=asyncio.Queue)
    abort: bool = False  # on a drop: reset the connection instead of ending the stream

    def matches(self, obj: Obj) -> bool:
        if self.namespace is not None and obj["metadata"].get("namespace") != self.namespace:
            return False
        return match_labels(self.labels, obj) and match_fields(self.fields, obj)

    def translate(self, event: WatchEvent) -> tuple[str, Obj] | None:
        """The event as this watch sees it, or None: objects entering/leaving the selector
        turn MODIFIED into ADDED/DELETED, like the watch cache of a real server."""
        now = self.matches(event.obj)
        if event.type != "MODIFIED" or event.old is None:
            return (event.type, event.obj) if now else None
        before = self.matches(event.old)
        if now and before:
            return ("MODIFIED", event.obj)
        if now:
            return ("ADDED", event.obj)
        if before:
            return ("DELETED", event.obj)
        return None


@dataclass(eq=False)
class ResourceStore:
    defn: ResourceDef
    history_size: int
    by_ns: dict[str, dict[str, Obj]] = field(default_factory=dict)  # "" for cluster-scoped
    history: collections.deque[WatchEvent] = field(default_factory=collections.deque)
    compacted_rv: int = 0  # events with rv <= this may be missing from the history
    watchers: set[Watcher] = field(default_factory=set)

    def get(self, ns: str, name: str) -> Obj | None:
        return self.by_ns.get(ns, {}).get(name)

    def iter_objects(self, ns: str | None) -> Iterator[Obj]:
        if ns is not None:
            yield from self.by_ns.get(ns, {}).values()
        else:
            for objs in self.by_ns.values():
                yield from objs.values()

    def count(self) -> int:
        return sum(len(v) for v in self.by_ns.values())

    def record(self, event: WatchEvent) -> None:
        if len(self.history) >= self.history_size:
            self.compacted_rv = self.history.popleft().rv
        self.history.append(event)
        for watcher in self.watchers:
            watcher.queue.put_nowait(event)

    def events_after(self, rv: int) -> list[WatchEvent]:
        out: list[WatchEvent] = []
        for event in reversed(self.history):
            if event.rv <= rv:
                break
            out.append(event)
        out.reverse()
        return out


@dataclass
class Fault:
    id: int
    method: str  # "*" for any
    path: re.Pattern[str]
    status: int
    count: int
    message: str
    retry_after: int | None
    delay: float

    def matches(self, method: str, path: str) -> bool:
        return (self.method in ("*", method.upper())) and bool(self.path.search(path))


@dataclass(slots=True)
class LogEntry:
    seq: int
    ts: float
    method: str
    path: str
    query: dict[str, str]
    verb: str | None = None
    group: str | None = None
    resource: str | None = None
    subresource: str | None = None
    namespace: str | None = None
    name: str | None = None
    status: int | None = None  # None while a watch is still streaming
    duration: float | None = None
    fault: bool = False
    agent: str | None = None  # the client's User-Agent: who made the request

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__slots__}


def get_path(obj: Obj, dotted: str) -> Any:
    cur: Any = obj
    for part in dotted.strip(".").split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def set_path(obj: Obj, dotted: str, value: Any) -> None:
    parts = dotted.strip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[parts[-1]] = value


def _not_found(defn: ResourceDef, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{defn.group_resource} "{name}" not found',
        {"name": name, "group": defn.group, "kind": defn.plural},
    )


def _conflict(defn: ResourceDef, name: str, why: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {defn.group_resource} "{name}": {why}',
        {"name": name, "group": defn.group, "kind": defn.plural},
    )


def _invalid(defn: ResourceDef, name: str, message: str) -> ApiError:
    return ApiError(
        422,
        "Invalid",
        f'{defn.kind} "{name}" is invalid: {message}',
        {"name": name, "group": defn.group, "kind": defn.kind},
    )


@dataclass
class DeleteOptions:
    grace_period_seconds: int | None = None
    propagation_policy: str | None = None  # Background (default), Foreground, Orphan
    precondition_uid: str | None = None
    precondition_rv: str | None = None

    @classmethod
    def parse(cls, body: Any, query: dict[str, str]) -> DeleteOptions:
        opts = cls()
        body = body if isinstance(body, dict) else {}
        grace = body.get("gracePeriodSeconds", query.get("gracePeriodSeconds"))
        if grace is not None:
            try:
                opts.grace_period_seconds = max(0, int(grace))
            except (TypeError, ValueError) as e:
                raise ApiError(400, "BadRequest", f"invalid gracePeriodSeconds {grace!r}") from e
        opts.propagation_policy = body.get("propagationPolicy", query.get("propagationPolicy"))
        if body.get("orphanDependents") is True or query.get("orphanDependents") == "true":
            opts.propagation_policy = opts.propagation_policy or "Orphan"
        pre = body.get("preconditions") or {}
        opts.precondition_uid = pre.get("uid")
        opts.precondition_rv = pre.get("resourceVersion")
        return opts


class Emulator:
    """The in-memory API server state and its server-side behaviour.

    The public methods below the "control" marker are the test's control surface; the same
    methods are reachable over the control HTTP endpoint (see :mod:`tests.harness.emulator.control`).
    """

    def __init__(
        self,
        *,
        history_size: int = 100_000,
        auto_namespaces: bool = True,
        garbage_collection: bool = True,
        kubelet_alive: bool = False,
        auto_kubelet: bool = False,
        auto_kubelet_delay: float = 0.0,
        bookmark_interval: float = 10.0,
    ) -> None:
        self.history_size = history_size
        self.auto_namespaces = auto_namespaces
        self.garbage_collection = garbage_collection
        self.kubelet_alive = kubelet_alive
        self.auto_kubelet = auto_kubelet
        self.auto_kubelet_delay = auto_kubelet_delay
        self.bookmark_interval = bookmark_interval
        self.rv = 0
        self.resources: dict[tuple[str, str, str], ResourceDef] = {}  # (group, version, plural)
        self.stores: dict[tuple[str, str], ResourceStore] = {}
        self.by_uid: dict[str, tuple[ResourceStore, str, str]] = {}
        self.dependents: dict[str, set[str]] = collections.defaultdict(set)  # owner → dep uids
        self.awaiting_kubelet: set[str] = set()  # uids of pods deleted gracefully, unconfirmed
        self.pod_logs: dict[tuple[str, str], str] = {}
        self.faults: list[Fault] = []
        self._fault_seq = 0
        self.log: list[LogEntry] = []
        self._log_seq = 0
        self.watches_silent = False
        self.on_crd_change: list[Callable[[], None]] = []

    # ------------------------------------------------------------------ resources
    def register(self, defn: ResourceDef) -> None:
        self.resources[(defn.group, defn.version, defn.plural)] = defn
        if defn.key not in self.stores:
            self.stores[defn.key] = ResourceStore(defn, self.history_size)

    def unregister(self, group: str, plural: str) -> None:
        for key in [k for k in self.resources if k[0] == group and k[2] == plural]:
            del self.resources[key]
        store = self.stores.pop((group, plural), None)
        if store is not None:
            for obj in list(store.iter_objects(None)):
                self.by_uid.pop(obj["metadata"]["uid"], None)
            for watcher in store.watchers:
                watcher.queue.put_nowait(None)

    def find_resource(self, spec: str) -> ResourceDef:
        """A resource by "plural", "plural.group", "group/version/plural" or "v1/plural"."""
        parts = spec.split("/")
        if len(parts) == 3:
            return self.resources[(parts[0], parts[1], parts[2])]
        if len(parts) == 2:
            return self.resources[("", parts[0], parts[1])]
        plural, _, group = spec.partition(".")
        matches = [
            d
            for d in self.resources.values()
            if d.plural == plural and (d.group == group or (not group and d.group == ""))
        ]
        if not matches and not group:
            matches = [d for d in self.resources.values() if d.plural == plural]
        if not matches:
            raise KeyError(spec)
        return matches[0]

    def register_crd_object(self, crd: Obj) -> None:
        """Serve the resources a CRD declares (called on create, or at start-up)."""
        spec = crd.get("spec") or {}
        names = spec.get("names") or {}
        for version in spec.get("versions") or []:
            if not version.get("served", True):
                continue
            subs = version.get("subresources") or spec.get("subresources") or {}
            scale = subs.get("scale") or {}
            self.register(
                ResourceDef(
                    group=spec["group"],
                    version=version["name"],
                    plural=names["plural"],
                    kind=names["kind"],
                    namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                    singular=names.get("singular", names["kind"].lower()),
                    shortnames=tuple(names.get("shortNames") or ()),
                    categories=tuple(names.get("categories") or ()),
                    subresources=frozenset(subs),
                    scale_spec_path=scale.get("specReplicasPath", ".spec.replicas"),
                    scale_status_path=scale.get("statusReplicasPath", ".status.replicas"),
                    scale_selector_path=scale.get("labelSelectorPath"),
                    custom=True,
                )
            )
        for callback in self.on_crd_change:
            callback()

    @staticmethod
    def crd_accepted_status(crd: Obj) -> Obj:
        names = (crd.get("spec") or {}).get("names") or {}
        now = now_rfc3339()
        return {
            "acceptedNames": names,
            "storedVersions": [
                v["name"] for v in (crd.get("spec") or {}).get("versions") or [] if v.get("storage")
            ],
            "conditions": [
                {"type": t, "status": "True", "reason": r, "lastTransitionTime": now, "message": ""}
                for t, r in (
                    ("NamesAccepted", "NoConflicts"),
                    ("Established", "InitialNamesAccepted"),
                )
            ],
        }

    # ------------------------------------------------------------------ helpers
    def _next_rv(self) -> int:
        self.rv += 1
        return self.rv

    def _store(self, defn: ResourceDef) -> ResourceStore:
        return self.stores[defn.key]

    def _get_or_404(self, defn: ResourceDef, ns: str | None, name: str) -> Obj:
        obj = self._store(defn).get(ns or "", name)
        if obj is None:
            raise _not_found(defn, name)
        return obj

    def _emit(self, store: ResourceStore, etype: str, obj: Obj, old: Obj | None = None) -> None:
        store.record(WatchEvent(self.rv, etype, obj, old))

    def _namespace_defn(self) -> ResourceDef:
        return self.resources[("", "v1", "namespaces")]

    def _ensure_namespace(self, ns: str) -> None:
        nsdefn = self._namespace_defn()
        existing = self._store(nsdefn).get("", ns)
        if existing is not None:
            if existing["metadata"].get("deletionTimestamp"):
                raise ApiError(
                    403,
                    "Forbidden",
                    f"unable to create new content in namespace {ns} because it is being terminated",
                )
            return
        if not self.auto_namespaces:
            raise ApiError(
                404, "NotFound", f'namespaces "{ns}" not found', {"name": ns, "kind": "namespaces"}
            )
        self.create(nsdefn, None, {"metadata": {"name": ns}})

    def _index_owners(self, obj: Obj, old: Obj | None) -> None:
        uid = obj["metadata"]["uid"]
        if old is not None:
            for ref in old["metadata"].get("ownerReferences") or []:
                self.dependents.get(ref.get("uid"), set()).discard(uid)
        for ref in obj["metadata"].get("ownerReferences") or []:
            if ref.get("uid"):
                self.dependents[ref["uid"]].add(uid)

    def _call_soon(self, delay: float, fn: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        if delay > 0:
            loop.call_later(delay, fn)
        else:
            loop.call_soon(fn)

    # ------------------------------------------------------------------ read
    def get(self, defn: ResourceDef, ns: str | None, name: str) -> Obj:
        return self._get_or_404(defn, ns, name)

    def list_collection(
        self,
        defn: ResourceDef,
        ns: str | None,
        labels: list[LabelRequirement],
        fields: list[FieldRequirement],
        limit: int | None = None,
        continue_token: str | None = None,
    ) -> Obj:
        store = self._store(defn)
        items = [
            o
            for o in store.iter_objects(ns if defn.namespaced else None)
            if match_labels(labels, o) and match_fields(fields, o)
        ]
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        meta: Obj = {"resourceVersion": str(self.rv)}
        if continue_token:
            try:
                after = json.loads(base64.urlsafe_b64decode(continue_token.encode()))
                start = tuple(after["start"])
            except (ValueError, KeyError, TypeError) as e:
                raise ApiError(400, "BadRequest", "invalid continue token") from e
            items = [
                o
                for o in items
                if (o["metadata"].get("namespace", ""), o["metadata"]["name"]) > start
            ]
        if limit and len(items) > limit:
            last = items[limit - 1]["metadata"]
            token = {"start": [last.get("namespace", ""), last["name"]]}
            meta["continue"] = base64.urlsafe_b64encode(json.dumps(token).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return {
            "kind": f"{defn.kind}List",
            "apiVersion": defn.api_version,
            "metadata": meta,
            "items": items,
        }

    # ------------------------------------------------------------------ create
    def create(self, defn: ResourceDef, ns: str | None, body: Any) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        obj: Obj = _copy(body)
        meta = obj.get("metadata")
        if not isinstance(meta, dict):
            meta = obj["metadata"] = {}
        if defn.namespaced:
            body_ns = meta.get("namespace")
            if ns is None:
                ns = body_ns or "default"
            elif body_ns and body_ns != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match the namespace sent on the request",
                )
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        store = self._store(defn)
        name = meta.get("name")
        if not name:
            prefix = meta.get("generateName")
            if not prefix:
                raise _invalid(
                    defn, "", "metadata.name: Required value: name or generateName is required"
                )
            for _ in range(100):
                name = prefix + "".join(random.choices(_GENERATE_ALPHABET, k=5))
                if store.get(meta.get("namespace", ""), name) is None:
                    break
            meta["name"] = name
        if not isinstance(name, str) or len(name) > 253 or not _NAME_RE.match(name):
            raise _invalid(
                defn,
                str(name),
                f"metadata.name: Invalid value: {name!r}: must be a lowercase RFC 1123 subdomain",
            )
        if store.get(meta.get("namespace", ""), name) is not None:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{defn.group_resource} "{name}" already exists',
                {"name": name, "group": defn.group, "kind": defn.plural},
            )
        if defn.namespaced:
            self._ensure_namespace(meta["namespace"])
        obj["apiVersion"] = defn.api_version
        obj["kind"] = defn.kind
        for key in ("deletionTimestamp", "deletionGracePeriodSeconds", "resourceVersion"):
            meta.pop(key, None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        meta["generation"] = 1
        if "status" in defn.subresources:
            obj.pop("status", None)  # the status of a new object is the server's (and /status's)
        if defn.plural == "pods" and defn.group == "":
            obj["status"] = {"phase": "Pending", "qosClass": "BestEffort"}
        if defn.plural == "namespaces" and defn.group == "":
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj["status"] = {"phase": "Active"}
        if defn.plural == "customresourcedefinitions":
            obj["status"] = self.crd_accepted_status(obj)
        meta["resourceVersion"] = str(self._next_rv())
        store.by_ns.setdefault(meta.get("namespace", ""), {})[name] = obj
        self.by_uid[meta["uid"]] = (store, meta.get("namespace", ""), name)
        self._index_owners(obj, None)
        self._emit(store, "ADDED", obj)
        if defn.plural == "customresourcedefinitions":
            self.register_crd_object(obj)
        if self.auto_kubelet and defn.plural == "pods" and defn.group == "":
            self._call_soon(
                self.auto_kubelet_delay, lambda: self._auto_start(obj["metadata"]["uid"])
            )
        return obj

    # ------------------------------------------------------------------ update / patch
    def update(
        self, defn: ResourceDef, ns: str | None, name: str, body: Any, subresource: str | None
    ) -> Obj:
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequest", "the request body must be a JSON object")
        old = self._get_or_404(defn, ns, name)
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise ApiError(
                400,
                "BadRequest",
                f"the name of the object ({body_name}) does not match the name on the URL ({name})",
            )
        return self._commit(defn, old, _copy(body), subresource)

    def patch(
        self,
        defn: ResourceDef,
        ns: str | None,
        name: str,
        content_type: str,
        patch: Any,
        subresource: str | None,
    ) -> Obj:
        old = self._get_or_404(defn, ns, name)
        try:
            if content_type == "application/json-patch+json":
                new = apply_json_patch(old, patch)
            elif content_type == "application/merge-patch+json":
                new = apply_merge_patch(old, patch)
            elif content_type == "application/strategic-merge-patch+json":
                if defn.custom:
                    raise ApiError(
                        415,
                        "UnsupportedMediaType",
                        "strategic merge patch is not supported for custom resources",
                    )
                new = apply_strategic_merge_patch(old, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format: {content_type}",
                )
        except PatchConflictError as e:
            raise ApiError(422, "Invalid", str(e)) from e
        except PatchError as e:
            raise ApiError(422, "Invalid", str(e)) from e
        if not isinstance(new, dict):
            raise ApiError(422, "Invalid", "the patch did not produce an object")
        return self._commit(defn, old, new, subresource)

    def _commit(self, defn: ResourceDef, old: Obj, new: Obj, subresource: str | None) -> Obj:
        """Store ``new`` as the next state of ``old``: the checks and rules of a real server."""
        old_meta = old["metadata"]
        name = old_meta["name"]
        new_meta = new.get("metadata")
        if not isinstance(new_meta, dict):
            new_meta = new["metadata"] = {}
        wanted_rv = new_meta.get("resourceVersion")
        if wanted_rv not in (None, "") and str(wanted_rv) != old_meta["resourceVersion"]:
            raise _conflict(
                defn,
                name,
                "the object has been modified; please apply your changes to the latest version and try again",
            )
        if subresource == "status":
            # Only .status changes; everything else (metadata too) is kept from storage.
            result = {k: v for k, v in old.items() if k != "status"}
            if "status" in new:
                result["status"] = new["status"]
            new = _copy(result)
            new_meta = new["metadata"]
        else:
            if "status" in defn.subresources:
                if "status" in old:
                    new["status"] = _copy(old["status"])
                else:
                    new.pop("status", None)
            for key in _SERVER_META:
                if key in old_meta:
                    new_meta[key] = old_meta[key]
                else:
                    new_meta.pop(key, None)
            new["apiVersion"] = old.get("apiVersion", defn.api_version)
            new["kind"] = old.get("kind", defn.kind)
            if old_meta.get("deletionTimestamp"):
                added = set(new_meta.get("finalizers") or []) - set(
                    old_meta.get("finalizers") or []
                )
                if added:
                    raise _invalid(
                        defn,
                        name,
                        "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted, "
                        f"found new finalizers {sorted(added)!r}",
                    )
            if not new_meta.get("finalizers"):
                new_meta.pop("finalizers", None)
            if not new_meta.get("ownerReferences"):
                new_meta.pop("ownerReferences", None)
        new_meta["resourceVersion"] = old_meta["resourceVersion"]
        if new == old:
            return old  # a no-op write: no new resourceVersion, no event (as on a real server)
        spec_old = {k: v for k, v in old.items() if k not in _NON_SPEC_FIELDS}
        spec_new = {k: v for k, v in new.items() if k not in _NON_SPEC_FIELDS}
        if spec_old != spec_new:
            new_meta["generation"] = int(old_meta.get("generation", 1)) + 1
        return self._replace(defn, old, new)

    def _replace(self, defn: ResourceDef, old: Obj, new: Obj) -> Obj:
        store = self._store(defn)
        meta = new["metadata"]
        meta["resourceVersion"] = str(self._next_rv())
        store.by_ns[meta.get("namespace", "")][meta["name"]] = new
        self._index_owners(new, old)
        if self._should_remove(new):
            self._remove(store, new, bump=False)
        else:
            self._emit(store, "MODIFIED", new, old)
        return new

    def _should_remove(self, obj: Obj) -> bool:
        meta = obj["metadata"]
        return bool(
            meta.get("deletionTimestamp")
            and not meta.get("finalizers")
            and meta["uid"] not in self.awaiting_kubelet
        )

    def _remove(self, store: ResourceStore, obj: Obj, *, bump: bool = True) -> None:
        meta = obj["metadata"]
        if bump:
            obj = {**obj, "metadata": {**meta, "resourceVersion": str(self._next_rv())}}
            meta = obj["metadata"]
        ns = meta.get("namespace", "")
        store.by_ns.get(ns, {}).pop(meta["name"], None)
        uid = meta["uid"]
        self.by_uid.pop(uid, None)
        self.awaiting_kubelet.discard(uid)
        self._index_owners({"metadata": {"uid": uid}}, obj)
        self._emit(store, "DELETED", obj)
        defn = store.defn
        if defn.plural == "customresourcedefinitions":
            names = (obj.get("spec") or {}).get("names") or {}
            self.unregister((obj.get("spec") or {}).get("group", ""), names.get("plural", ""))
            for callback in self.on_crd_change:
                callback()
        if defn.plural == "namespaces" and defn.group == "":
            self._call_soon(0, lambda: self._purge_namespace(meta["name"]))
        if self.garbage_collection and self.dependents.get(uid):
            self._call_soon(0, lambda: self._collect_dependents(uid))
        for ref in meta.get("ownerReferences") or []:
            owner = self.by_uid.get(ref.get("uid", ""))
            if owner is not None:
                self._call_soon(0, functools.partial(self._finish_foreground, ref["uid"]))

    # ------------------------------------------------------------------ delete
    def delete(self, defn: ResourceDef, ns: str | None, name: str, opts: DeleteOptions) -> Obj:
        store = self._store(defn)
        obj = self._get_or_404(defn, ns, name)
        meta = obj["metadata"]
        if opts.precondition_uid is not None and opts.precondition_uid != meta["uid"]:
            raise _conflict(
                defn,
                name,
                f"Precondition failed: UID in precondition: {opts.precondition_uid}, UID in object meta: {meta['uid']}",
            )
        if opts.precondition_rv is not None and opts.precondition_rv != meta["resourceVersion"]:
            raise _conflict(
                defn,
                name,
                "Precondition failed: ResourceVersion in precondition: "
                f"{opts.precondition_rv}, ResourceVersion in object meta: {meta['resourceVersion']}",
            )
        is_pod = defn.plural == "pods" and defn.group == ""
        grace = opts.grace_period_seconds
        if is_pod:
            spec = obj.get("spec") or {}
            phase = (obj.get("status") or {}).get("phase")
            if grace is None:
                tgps = spec.get("terminationGracePeriodSeconds")
                grace = 30 if tgps is None else int(tgps)
            if (not spec.get("nodeName") and not self.kubelet_alive) or phase in (
                "Succeeded",
                "Failed",
            ):
                grace = 0
        else:
            grace = 0

        if meta.get("deletionTimestamp"):
            # Already being deleted: only a shorter grace period (a kubelet's or a force delete) counts.
            current = int(meta.get("deletionGracePeriodSeconds") or 0)
            if not is_pod or grace >= current:
                return obj
            new = _copy(obj)
            new["metadata"]["deletionGracePeriodSeconds"] = grace
            new["metadata"]["deletionTimestamp"] = now_rfc3339(grace)
            if grace == 0:
                self.awaiting_kubelet.discard(meta["uid"])
            return self._replace(defn, obj, new)

        policy = opts.propagation_policy or "Background"
        if policy == "Orphan":
            self._orphan_dependents(meta["uid"])
        foreground = policy == "Foreground" and bool(self.dependents.get(meta["uid"]))
        if grace == 0 and not meta.get("finalizers") and not foreground:
            self._remove(store, obj)
            return obj
        new = _copy(obj)
        new_meta = new["metadata"]
        new_meta["deletionTimestamp"] = now_rfc3339(grace)
        new_meta["deletionGracePeriodSeconds"] = grace
        new_meta["generation"] = int(meta.get("generation", 1)) + 1
        if foreground:
            new_meta["finalizers"] = [*(new_meta.get("finalizers") or []), "foregroundDeletion"]
            self._call_soon(0, lambda: self._collect_dependents(meta["uid"], "Background"))
        if grace > 0:
            self.awaiting_kubelet.add(meta["uid"])
            if self.auto_kubelet:
                delay = min(float(grace), self.auto_kubelet_delay)
                self._call_soon(delay, lambda: self._confirm_uid(meta["uid"]))
        if defn.plural == "namespaces" and defn.group == "":
            new["status"] = {"phase": "Terminating"}
        return self._replace(defn, obj, new)

    def delete_collection(
        self,
        defn: ResourceDef,
        ns: str | None,
        labels: list[LabelRequirement],
        fields: list[FieldRequirement],
        opts: DeleteOptions,
    ) -> Obj:
        listing = self.list_collection(defn, ns, labels, fields)
        items = []
        for obj in listing["items"]:
            meta = obj["metadata"]
            try:
                items.append(self.delete(defn, meta.get("namespace"), meta["name"], opts))
            except ApiError:
                continue
        return {**listing, "items": items}

    # ------------------------------------------------------------------ garbage collection
    def _live(self, uid: str) -> tuple[ResourceStore, Obj] | None:
        where = self.by_uid.get(uid)
        if where is None:
            return None
        store, ns, name = where
        obj = store.get(ns, name)
        return None if obj is None else (store, obj)

    def _orphan_dependents(self, owner_uid: str) -> None:
        for dep_uid in list(self.dependents.get(owner_uid, ())):
            live = self._live(dep_uid)
            if live is None:
                continue
            store, dep = live
            new = _copy(dep)
            refs = [
                r for r in new["metadata"].get("ownerReferences") or [] if r.get("uid") != owner_uid
            ]
            if refs:
                new["metadata"]["ownerReferences"] = refs
            else:
                new["metadata"].pop("ownerReferences", None)
            self._replace(store.defn, dep, new)
        self.dependents.pop(owner_uid, None)

    def _collect_dependents(self, owner_uid: str, policy: str = "Background") -> None:
        for dep_uid in list(self.dependents.get(owner_uid, ())):
            live = self._live(dep_uid)
            if live is None:
                continue
            store, dep = live
            refs = dep["metadata"].get("ownerReferences") or []
            others_alive = any(
                r.get("uid") != owner_uid and self._live(r.get("uid", "")) is not None for r in refs
            )
            if others_alive and policy == "Background" and self._live(owner_uid) is None:
                new = _copy(dep)
                new["metadata"]["ownerReferences"] = [r for r in refs if r.get("uid") != owner_uid]
                self._replace(store.defn, dep, new)
                continue
            meta = dep["metadata"]
            try:
                self.delete(
                    store.defn,
                    meta.get("namespace"),
                    meta["name"],
                    DeleteOptions(propagation_policy=policy),
                )
            except ApiError:
                continue

    def _finish_foreground(self, owner_uid: str) -> None:
        live = self._live(owner_uid)
        if live is None:
            return
        store, owner = live
        finalizers = owner["metadata"].get("finalizers") or []
        if "foregroundDeletion" not in finalizers:
            return
        if any(self._live(d) is not None for d in self.dependents.get(owner_uid, ())):
            # As the real collector's processDeletingDependentsItem: each time the owner is
            # looked at again (a dependent went away), every dependent still there is deleted,
            # one created after the deletion began too.
            self._collect_dependents(owner_uid)
            return
        new = _copy(owner)
        new["metadata"]["finalizers"] = [f for f in finalizers if f != "foregroundDeletion"]
        self._replace(store.defn, owner, new)

    def _purge_namespace(self, ns: str) -> None:
        for store in list(self.stores.values()):
            if not store.defn.namespaced:
                continue
            for obj in list(store.iter_objects(ns)):
                try:
                    self.delete(
                        store.defn,
                        ns,
                        obj["metadata"]["name"],
                        DeleteOptions(grace_period_seconds=0),
                    )
                except ApiError:
                    continue

    # ------------------------------------------------------------------ kubelet
    def _pod(self, namespace: str, name: str) -> tuple[ResourceDef, Obj]:
        defn = self.resources[("", "v1", "pods")]
        return defn, self._get_or_404(defn, namespace, name)

    def _confirm_uid(self, uid: str) -> None:
        live = self._live(uid)
        if live is not None and uid in self.awaiting_kubelet:
            meta = live[1]["metadata"]
            self.kubelet_confirm(meta["namespace"], meta["name"])

    def _auto_start(self, uid: str) -> None:
        live = self._live(uid)
        if live is None or live[1]["metadata"].get("deletionTimestamp"):
            return
        meta = live[1]["metadata"]
        if not (live[1].get("spec") or {}).get("nodeName"):
            self.schedule_pod(meta["namespace"], meta["name"])
        self.set_pod_phase(meta["namespace"], meta["name"], "Running")

    # ================================================================== control surface
    def current_resource_version(self) -> int:
        return self.rv

    def set_kubelet_alive(self, alive: bool = True) -> None:
        """With a live kubelet, every pod (scheduled or not) is deleted gracefully."""
        self.kubelet_alive = alive

    def schedule_pod(self, namespace: str, name: str, node_name: str = "emulated-node") -> Obj:
        """Play the scheduler: set spec.nodeName (as a pods/binding would)."""
        defn, pod = self._pod(namespace, name)
        new = _copy(pod)
        new.setdefault("spec", {})["nodeName"] = node_name
        self._set_condition(new, "PodScheduled", "True")
        return self._replace(defn, pod, new)

    @staticmethod
    def _set_condition(pod: Obj, ctype: str, status: str) -> None:
        conditions = pod.setdefault("status", {}).setdefault("conditions", [])
        for cond in conditions:
            if cond.get("type") == ctype:
                if cond.get("status") != status:
                    cond["status"] = status
                    cond["lastTransitionTime"] = now_rfc3339()
                return
        conditions.append({"type": ctype, "status": status, "lastTransitionTime": now_rfc3339()})

    def set_pod_phase(
        self,
        namespace: str,
        name: str,
        phase: str,
        container_statuses: list[Obj] | None = None,
        conditions: list[Obj] | None = None,
        *,
        exit_code: int | None = None,
        reason: str | None = None,
        message: str | None = None,
        pod_ip: str | None = None,
        restart_count: int = 0,
    ) -> Obj:
        """Play the kubelet: write the pod's status (phase, container statuses, conditions).

        Without ``container_statuses``, one status per spec container is made to fit the phase
        (Pending: waiting/ContainerCreating; Running: running and ready; Succeeded/Failed:
        terminated with ``exit_code``, default 0/1). Without ``conditions``, Ready and
        ContainersReady follow the phase. The write goes through the status subresource rules
        (new resourceVersion, MODIFIED event, generation unchanged)."""
        defn, pod = self._pod(namespace, name)
        status: Obj = _copy(pod.get("status") or {})
        status["phase"] = phase
        now = now_rfc3339()
        if reason is not None:
            status["reason"] = reason
        if message is not None:
            status["message"] = message
        if phase != "Pending":
            status.setdefault("startTime", now)
            status["podIP"] = (
                pod_ip
                or status.get("podIP")
                or f"10.0.{random.randint(0, 255)}.{random.randint(1, 254)}"
            )
            status["podIPs"] = [{"ip": status["podIP"]}]
            status.setdefault("hostIP", "10.1.0.1")
        if container_statuses is None:
            container_statuses = list[Obj]()
            for c in (pod.get("spec") or {}).get("containers") or []:
                cs: Obj = {
                    "name": c.get("name"),
                    "image": c.get("image", ""),
                    "imageID": "",
                    "restartCount": restart_count,
                    "started": phase == "Running",
                    "ready": phase == "Running",
                }
                if phase == "Running":
                    cs["state"] = {"running": {"startedAt": now}}
                elif phase in ("Succeeded", "Failed"):
                    code = (
                        exit_code if exit_code is not None else (0 if phase == "Succeeded" else 1)
                    )
                    cs["state"] = {
                        "terminated": {
                            "exitCode": code,
                            "reason": "Completed" if code == 0 else "Error",
                            "startedAt": status.get("startTime", now),
                            "finishedAt": now,
                        }
                    }
                else:
                    cs["state"] = {"waiting": {"reason": "ContainerCreating"}}
                container_statuses.append(cs)
        status["containerStatuses"] = container_statuses
        if conditions is not None:
            status["conditions"] = conditions
            new = {**_copy(pod), "status": status}
        else:
            new = {**_copy(pod), "status": status}
            ready = "True" if phase == "Running" else "False"
            self._set_condition(new, "Initialized", "True")
            self._set_condition(new, "Ready", ready)
            self._set_condition(new, "ContainersReady", ready)
        return self._commit(defn, pod, new, "status")

    def kubelet_confirm(self, namespace: str, name: str) -> bool:
        """Play the kubelet after a graceful delete: the containers are gone (like a DELETE
        with gracePeriodSeconds=0). Returns True if the pod was removed (no finalizers left)."""
        defn, pod = self._pod(namespace, name)
        if not pod["metadata"].get("deletionTimestamp"):
            raise ApiError(409, "Conflict", f'pod "{name}" is not being deleted')
        self.delete(defn, namespace, name, DeleteOptions(grace_period_seconds=0))
        return self._store(defn).get(namespace, name) is None

    def set_pod_log(self, namespace: str, name: str, text: str) -> None:
        self.pod_logs[(namespace, name)] = text

    def add_fault(
        self,
        method: str,
        path: str,
        status: int,
        count: int = 1,
        message: str | None = None,
        retry_after: int | None = None,
        delay: float = 0.0,
    ) -> int:
        """The next ``count`` requests with ``method`` ("*" for any) whose path matches the regex
        ``path`` (searched, not anchored; the path has no query) answer ``status`` with a Status
        body (409 Conflict, 429 TooManyRequests with Retry-After, 500 InternalError, ...)."""
        self._fault_seq += 1
        self.faults.append(
            Fault(
                self._fault_seq,
                method.upper(),
                re.compile(path),
                status,
                count,
                message or f"injected fault {status}",
                retry_after,
                delay,
            )
        )
        return self._fault_seq

    def clear_faults(self) -> None:
        self.faults.clear()

    def take_fault(self, method: str, path: str) -> Fault | None:
        for fault in self.faults:
            if fault.count > 0 and fault.matches(method, path):
                fault.count -= 1
                if fault.count <= 0:
                    self.faults.remove(fault)
                return fault
        return None

    def open_watches(self) -> int:
        return sum(len(s.watchers) for s in self.stores.values())

    def drop_watches(self, abort: bool = False) -> int:
        """End every open watch stream now (``abort``: reset the TCP connection instead)."""
        n = 0
        for store in self.stores.values():
            for watcher in store.watchers:
                watcher.abort = abort
                watcher.queue.put_nowait(None)
                n += 1
        return n

    def silence_watches(self, silent: bool = True) -> None:
        """Silent watches keep their connections open but send nothing: no events (they are
        lost, not delayed), no bookmarks, and they ignore timeoutSeconds until un-silenced."""
        self.watches_silent = silent

    def compact_history(self) -> int:
        """Forget the watch history (like an etcd compaction): watches from any older
        resourceVersion now get 410 Gone. Returns the current resourceVersion."""
        for store in self.stores.values():
            store.history.clear()
            store.compacted_rv = self.rv
        return self.rv

    def requests(self, since: int = 0) -> list[dict[str, Any]]:
        """The request log (entries with ``seq > since``) as dicts."""
        return [e.as_dict() for e in self.log if e.seq > since]

    def clear_requests(self) -> None:
        self.log.clear()

    def count_requests(
        self,
        verb: str | None = None,
        resource: str | None = None,
        *,
        method: str | None = None,
        namespace: str | None = None,
        subresource: str | None = None,
        status: int | None = None,
        name: str | None = None,
    ) -> int:
        """Count logged requests; ``verb`` is the API verb (get, list, watch, create, update,
        patch, delete, deletecollection), ``resource`` the plural name."""
        n = 0
        for e in self.log:
            if verb is not None and e.verb != verb:
                continue
            if resource is not None and e.resource != resource:
                continue
            if method is not None and e.method != method.upper():
                continue
            if namespace is not None and e.namespace != namespace:
                continue
            if subresource is not None and e.subresource != subresource:
                continue
            if status is not None and e.status != status:
                continue
            if name is not None and e.name != name:
                continue
            n += 1
        return n

    def get_object(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        """The stored object (``resource`` as in :meth:`find_resource`), or None."""
        defn = self.find_resource(resource)
        return self._store(defn).get(namespace or "", name)

    def list_objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        defn = self.find_resource(resource)
        return list(self._store(defn).iter_objects(namespace))

    def new_log_entry(self, ts: float, method: str, path: str, query: dict[str, str]) -> LogEntry:
        self._log_seq += 1
        entry = LogEntry(self._log_seq, ts, method, path, query)
        self.log.append(entry)
        return entry


def iter_bundled_resources() -> Iterable[ResourceDef]:
    """The built-in resources of kmock's bundled discovery (a k3s cluster's)."""
    array = kmock.ResourcesArray()
    # The same as array.load_bundled(), without its deprecated importlib call.
    bundled = importlib.resources.files("kmock._internal").joinpath("resources.json.gz")
    array.load_data(gzip.decompress(bundled.read_bytes()))
    for res in array:
        info = array[res]
        plural: str = res.plural or ""
        yield ResourceDef(
            group=res.group or "",
            version=res.version or "v1",
            plural=plural,
            kind=info.kind or plural.capitalize(),
            namespaced=bool(info.namespaced),
            singular=info.singular or (info.kind or plural).lower(),
            verbs=frozenset(info.verbs) or STANDARD_VERBS,
            shortnames=tuple(sorted(info.shortnames)),
            categories=tuple(sorted(info.categories)),
            subresources=frozenset(info.subresources),
        )
