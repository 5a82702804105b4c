"""The HTTP face of the emulator: Kubernetes API paths, discovery, watch streams, faults, log.

Why this is written on aiohttp and not as a subclass of ``kmock.KubernetesEmulator``
(kmock 0.8), although kmock was the preferred base:

* kmock's emulator changes its state inside ``_handle`` before its reactions run, keeps every
  object as a growing version history, and finds objects by scanning all of them on every
  request (``__get_objs``): O(n) per request, O(n²) for a benchmark of 1600 pods.
* Its watch replays everything as ADDED from an unversioned bus: resourceVersion-based
  resumption, 410 Gone, timeoutSeconds, bookmarks and selector transitions would need a new
  event store anyway; so would status isolation, graceful deletion, SMP, PUT and
  deletecollection, none of which kmock has (see /work/shared/EMULATOR-NOTES.md).
* Overriding ``_handle`` that far would leave nothing of kmock's emulator but its routing,
  which is private API (``_internal``) and would break on its next release.

What *is* taken from kmock: its bundled discovery of a real k3s cluster
(``kmock.ResourcesArray().load_bundled()``), so that the built-in resources, their kinds,
short names, verbs and subresources are those of a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from tests.harness.emulator import patches
from tests.harness.emulator.selectors import (
    SelectorError,
    parse_field_selector,
    parse_label_selector,
)
from tests.harness.emulator.store import (
    ApiError,
    DeleteOptions,
    Emulator,
    LogEntry,
    Obj,
    ResourceDef,
    Watcher,
    _copy,
    get_path,
    set_path,
    status_body,
)

_LOG_KEY = web.RequestKey("log_entry", LogEntry)
_EMULATOR_KEY = web.AppKey("emulator", Emulator)
_WATCH_TRUE = ("true", "1")
_API_VERBS = frozenset(
    {"list", "watch", "create", "deletecollection", "get", "update", "patch", "delete"}
)


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=json.dumps(payload, separators=(",", ":")).encode(),
        status=status,
        content_type="application/json",
        headers=headers,
    )


class _Route:
    __slots__ = ("defn", "name", "namespace", "subresource")

    def __init__(
        self, defn: ResourceDef, namespace: str | None, name: str | None, sub: str | None
    ) -> None:
        self.defn = defn
        self.namespace = namespace
        self.name = name
        self.subresource = sub


class ApiApp:
    """Builds the aiohttp application that serves one :class:`Emulator`."""

    def __init__(self, emulator: Emulator) -> None:
        self.emu = emulator
        self._discovery_cache: dict[str, Obj] = {}
        emulator.on_crd_change.append(self._discovery_cache.clear)

    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024 * 1024)
        app[_EMULATOR_KEY] = self.emu
        app.router.add_route("*", "/{tail:.*}", self._handle)
        return app

    # ------------------------------------------------------------------ middleware: log + faults
    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        started = time.monotonic()
        entry = self.emu.new_log_entry(
            time.time(), request.method, request.path, dict(request.query)
        )
        entry.agent = request.headers.get("User-Agent")
        request[_LOG_KEY] = entry
        try:
            self._route_into(entry, request)
            fault = self.emu.take_fault(request.method, request.path)
            if fault is not None and fault.status == 0:
                # A slow API server, not an error: hold the request, then serve it.
                entry.fault = True
                await asyncio.sleep(fault.delay)
                fault = None
            if fault is not None:
                entry.fault = True
                if fault.delay:
                    await asyncio.sleep(fault.delay)
                raise ApiError(
                    fault.status,
                    _REASONS.get(fault.status, "InternalError"),
                    fault.message,
                    headers={"Retry-After": str(fault.retry_after)}
                    if fault.retry_after is not None
                    else None,
                )
            response = await handler(request)
        except ApiError as e:
            response = _json(e.status(), e.code, e.headers)
        except web.HTTPException:
            raise
        except Exception as e:  # an emulator bug: answer like a real server's internal error
            response = _json(status_body(500, "InternalError", f"emulator error: {e!r}"), 500)
        if entry.status is None:
            entry.status = response.status
        entry.duration = time.monotonic() - started
        return response

    def _route_into(self, entry: LogEntry, request: web.Request) -> None:
        try:
            route = self._parse(request.path)
        except ApiError:
            return
        if route is None:
            return
        entry.group = route.defn.group
        entry.resource = route.defn.plural
        entry.namespace = route.namespace
        entry.name = route.name
        entry.subresource = route.subresource
        entry.verb = _verb(request.method, route, request.query.get("watch", "") in _WATCH_TRUE)

    # ------------------------------------------------------------------ routing
    def _parse(self, path: str) -> _Route | None:
        """A resource route, None for non-resource paths (discovery), 404 for unknown ones."""
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return None
        if not rest:
            return None
        ns: str | None = None
        if rest[0] == "namespaces" and len(rest) >= 3:
            candidate = self.emu.resources.get((group, version, rest[2]))
            if candidate is not None and candidate.namespaced:
                ns, rest = rest[1], rest[2:]
        defn = self.emu.resources.get((group, version, rest[0]))
        if defn is None or len(rest) > 3:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) >= 2 else None
        sub = rest[2] if len(rest) == 3 else None
        if sub is not None and sub not in defn.subresources:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        return _Route(defn, ns, name, sub)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        route = self._parse(request.path)
        if route is None:
            return self._discovery(request.path)
        defn, ns, name, sub = route.defn, route.namespace, route.name, route.subresource
        q = request.query
        method = request.method
        verb = request[_LOG_KEY].verb
        if verb in _API_VERBS and defn.verbs and verb not in defn.verbs and sub is None:
            raise ApiError(
                405,
                "MethodNotAllowed",
                f"the server does not allow this method on {defn.plural}",
            )
        if defn.namespaced is False:
            ns = None
        try:
            labels = parse_label_selector(q.get("labelSelector"))
            fields = parse_field_selector(q.get("fieldSelector"))
        except SelectorError as e:
            raise ApiError(400, "BadRequest", f"unable to parse requirement: {e}") from e

        if name is None:
            if method == "GET" and q.get("watch", "") in _WATCH_TRUE:
                return await self._watch(request, defn, ns, labels, fields)
            if method == "GET":
                limit = int(q["limit"]) if q.get("limit") else None
                return _json(
                    self.emu.list_collection(defn, ns, labels, fields, limit, q.get("continue"))
                )
            if method == "POST":
                body = await _body(request)
                created = self.emu.create(defn, ns, body)
                request[_LOG_KEY].name = created["metadata"]["name"]  # for counting by object
                return _json(created, 201)
            if method == "DELETE":
                opts = DeleteOptions.parse(await _body(request, optional=True), dict(q))
                return _json(self.emu.delete_collection(defn, ns, labels, fields, opts))
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")

        if sub == "scale":
            return await self._scale(request, defn, ns, name)
        if sub == "log":
            self.emu.get(defn, ns, name)
            return web.Response(
                text=self.emu.pod_logs.get((ns or "", name), ""), content_type="text/plain"
            )
        if sub not in (None, "status"):
            raise ApiError(
                405, "MethodNotAllowed", f"the emulator does not serve {defn.plural}/{sub}"
            )
        if method == "GET":
            return _json(self.emu.get(defn, ns, name))
        if method == "PUT":
            return _json(self.emu.update(defn, ns, name, await _body(request), sub))
        if method == "PATCH":
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            return _json(self.emu.patch(defn, ns, name, ctype, await _body(request), sub))
        if method == "DELETE" and sub is None:
            opts = DeleteOptions.parse(await _body(request, optional=True), dict(q))
            return _json(self.emu.delete(defn, ns, name, opts))
        raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")

    # ------------------------------------------------------------------ scale
    async def _scale(
        self, request: web.Request, defn: ResourceDef, ns: str | None, name: str
    ) -> web.Response:
        obj = self.emu.get(defn, ns, name)
        if request.method == "GET":
            return _json(self._scale_of(defn, obj))
        if request.method not in ("PUT", "PATCH"):
            raise ApiError(405, "MethodNotAllowed", f"{request.method} is not allowed on scale")
        body = await _body(request)
        scale = self._scale_of(defn, obj)
        if request.method == "PUT":
            new_scale = body
        else:
            ctype = request.headers.get("Content-Type", "").split(";")[0].strip()
            try:
                if ctype == "application/json-patch+json":
                    new_scale = patches.apply_json_patch(scale, body)
                elif ctype == "application/strategic-merge-patch+json":
                    new_scale = patches.apply_strategic_merge_patch(scale, body)
                else:
                    new_scale = patches.apply_merge_patch(scale, body)
            except patches.PatchError as e:
                raise ApiError(422, "Invalid", str(e)) from e
        if not isinstance(new_scale, dict):
            raise ApiError(400, "BadRequest", "a Scale object is required")
        replicas = (new_scale.get("spec") or {}).get("replicas")
        if not isinstance(replicas, int) or replicas < 0:
            raise ApiError(422, "Invalid", f"Scale.spec.replicas: Invalid value: {replicas!r}")
        new = _copy(obj)
        new["metadata"]["resourceVersion"] = (new_scale.get("metadata") or {}).get(
            "resourceVersion"
        )
        set_path(new, defn.scale_spec_path, replicas)
        updated = self.emu._commit(defn, obj, new, None)
        return _json(self._scale_of(defn, updated))

    @staticmethod
    def _scale_of(defn: ResourceDef, obj: Obj) -> Obj:
        meta = obj["metadata"]
        status: Obj = {"replicas": get_path(obj, defn.scale_status_path) or 0}
        if defn.scale_selector_path:
            selector = get_path(obj, defn.scale_selector_path)
            if selector:
                status["selector"] = selector
        return {
            "kind": "Scale",
            "apiVersion": "autoscaling/v1",
            "metadata": {
                k: meta[k]
                for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                if k in meta
            },
            "spec": {"replicas": get_path(obj, defn.scale_spec_path) or 0},
            "status": status,
        }

    # ------------------------------------------------------------------ watch
    async def _watch(
        self,
        request: web.Request,
        defn: ResourceDef,
        ns: str | None,
        labels: Any,
        fields: Any,
    ) -> web.StreamResponse:
        emu = self.emu
        q = request.query
        store = emu.stores[defn.key]
        rv_text = q.get("resourceVersion", "")
        timeout = float(q["timeoutSeconds"]) if q.get("timeoutSeconds") else None
        bookmarks = q.get("allowWatchBookmarks", "") in _WATCH_TRUE
        watcher = Watcher(ns, labels, fields)

        initial: list[tuple[str, Obj]] = []
        gone: Obj | None = None
        if rv_text in ("", "0"):
            initial = [("ADDED", o) for o in store.iter_objects(ns) if watcher.matches(o)]
        else:
            try:
                since = int(rv_text)
            except ValueError as e:
                raise ApiError(400, "BadRequest", f"invalid resourceVersion {rv_text!r}") from e
            if since < store.compacted_rv:
                gone = status_body(
                    410, "Expired", f"too old resource version: {since} ({store.compacted_rv})"
                )
            else:
                for past in store.events_after(since):
                    replayed = watcher.translate(past)
                    if replayed is not None:
                        initial.append(replayed)
        if gone is None:
            store.watchers.add(watcher)  # in the same step as the replay: no event is missed

        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        entry: LogEntry = request[_LOG_KEY]
        entry.status = 200
        loop = asyncio.get_running_loop()
        try:
            await response.prepare(request)
            if gone is not None:
                await response.write(_line({"type": "ERROR", "object": gone}))
                return response
            if not emu.watches_silent:
                for etype, obj in initial:
                    await response.write(_line({"type": etype, "object": obj}))
            deadline = loop.time() + timeout if timeout is not None else None
            next_bookmark = loop.time() + emu.bookmark_interval if bookmarks else None
            while True:
                now = loop.time()
                if deadline is not None and now >= deadline and not emu.watches_silent:
                    break
                if next_bookmark is not None and now >= next_bookmark:
                    next_bookmark = now + emu.bookmark_interval
                    if not emu.watches_silent:
                        bookmark = {
                            "kind": defn.kind,
                            "apiVersion": defn.api_version,
                            "metadata": {"resourceVersion": str(emu.rv)},
                        }
                        await response.write(_line({"type": "BOOKMARK", "object": bookmark}))
                waits = [t - now for t in (deadline, next_bookmark) if t is not None]
                wait = max(0.0, min(waits)) if waits else None
                if emu.watches_silent:
                    wait = 0.2 if wait is None else min(max(wait, 0.0), 0.2)
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    continue
                if event is None:  # dropped by the test
                    if watcher.abort and request.transport is not None:
                        request.transport.abort()
                    break
                if emu.watches_silent:
                    continue
                seen = watcher.translate(event)
                if seen is not None:
                    await response.write(_line({"type": seen[0], "object": seen[1]}))
        except (ConnectionResetError, asyncio.CancelledError):
            store.watchers.discard(watcher)
            raise
        finally:
            store.watchers.discard(watcher)
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    # ------------------------------------------------------------------ discovery
    def _discovery(self, path: str) -> web.Response:
        path = "/" + path.strip("/")
        if path in ("/healthz", "/readyz", "/livez"):
            return web.Response(text="ok")
        if path == "/version":
            return _json(
                {
                    "major": "1",
                    "minor": "30",
                    "gitVersion": "v1.30.0-ddpjob-emulator",
                    "platform": "linux/amd64",
                }
            )
        cached = self._discovery_cache.get(path)
        if cached is None:
            cached = self._build_discovery(path)
            self._discovery_cache[path] = cached
        return _json(cached)

    def _build_discovery(self, path: str) -> Obj:
        defs = list(self.emu.resources.values())
        if path == "/":
            paths = {"/api", "/api/v1", "/apis", "/version", "/healthz"}
            for d in defs:
                if d.group:
                    paths |= {f"/apis/{d.group}", f"/apis/{d.group}/{d.version}"}
            return {"paths": sorted(paths)}
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1"}
                ],
            }
        if path == "/apis":
            groups: dict[str, list[str]] = {}
            for d in defs:
                if d.group and d.version not in groups.setdefault(d.group, []):
                    groups[d.group].append(d.version)
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [_group_doc(g, vs) for g, vs in sorted(groups.items())],
            }
        parts = path.strip("/").split("/")
        if parts == ["api", "v1"]:
            return _resource_list("v1", [d for d in defs if d.group == ""])
        if len(parts) == 2 and parts[0] == "apis":
            versions = [d.version for d in defs if d.group == parts[1]]
            if not versions:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return {
                "kind": "APIGroup",
                "apiVersion": "v1",
                **_group_doc(parts[1], list(dict.fromkeys(versions))),
            }
        if len(parts) == 3 and parts[0] == "apis":
            found = [d for d in defs if d.group == parts[1] and d.version == parts[2]]
            if not found:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return _resource_list(f"{parts[1]}/{parts[2]}", found)
        raise ApiError(404, "NotFound", "the server could not find the requested resource")


_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    409: "Conflict",
    410: "Expired",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def _verb(method: str, route: _Route, watch: bool) -> str:
    if route.name is None:
        return {
            "GET": "watch" if watch else "list",
            "POST": "create",
            "DELETE": "deletecollection",
        }.get(method, method.lower())
    return {
        "GET": "get",
        "PUT": "update",
        "PATCH": "patch",
        "DELETE": "delete",
        "POST": "create",
    }.get(method, method.lower())


async def _body(request: web.Request, optional: bool = False) -> Any:
    raw = await request.read()
    if not raw.strip():
        if optional:
            return None
        raise ApiError(400, "BadRequest", "the request body is empty")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(400, "BadRequest", f"the request body is not valid JSON: {e}") from e


def _line(event: Obj) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _group_doc(group: str, versions: list[str]) -> Obj:
    return {
        "name": group,
        "versions": [{"groupVersion": f"{group}/{v}", "version": v} for v in versions],
        "preferredVersion": {"groupVersion": f"{group}/{versions[0]}", "version": versions[0]},
    }


def _resource_list(group_version: str, defs: list[ResourceDef]) -> Obj:
    resources: list[Obj] = []
    for d in sorted(defs, key=lambda d: d.plural):
        resources.append(
            {
                "name": d.plural,
                "singularName": d.singular,
                "namespaced": d.namespaced,
                "kind": d.kind,
                "verbs": sorted(d.verbs),
                "shortNames": list(d.shortnames),
                "categories": list(d.categories),
            }
        )
        for sub in sorted(d.subresources):
            kind = "Scale" if sub == "scale" else d.kind
            verbs = ["get", "patch", "update"] if sub in ("status", "scale") else ["get"]
            resources.append(
                {
                    "name": f"{d.plural}/{sub}",
                    "singularName": "",
                    "namespaced": d.namespaced,
                    "kind": kind,
                    "verbs": verbs,
                }
            )
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": resources,
    }
