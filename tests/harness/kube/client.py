"""A small synchronous JSON client for the test control plane's own components.

The process kubelet and the cluster DNS talk to the API server with it: plain dicts in and out
(the official client's models would be converted back and forth on every pod), one
``requests.Session`` per client (one client per thread), a bearer token and the cluster's CA
from a kubeconfig, and watches that resume from the last resourceVersion, ask for bookmarks and
start over with a fresh list after ``410 Gone``, as client-go's reflector does.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import requests
import yaml

JSON = dict[str, Any]


class ApiError(RuntimeError):
    def __init__(self, status: int, body: str) -> None:
        self.status = status
        try:
            self.reason = str(json.loads(body).get("reason") or "")
        except (ValueError, AttributeError):
            self.reason = ""
        super().__init__(f"{status} {self.reason}: {body[:300]}")


@dataclasses.dataclass(frozen=True)
class Endpoint:
    server: str
    token: str
    ca_cert: str

    @classmethod
    def from_kubeconfig(cls, path: Path) -> Endpoint:
        config = yaml.safe_load(path.read_text())
        cluster = config["clusters"][0]["cluster"]
        user = config["users"][0]["user"]
        return cls(cluster["server"], user["token"], cluster["certificate-authority"])


class Client:
    def __init__(self, endpoint: Endpoint, agent: str) -> None:
        self.endpoint = endpoint
        self.session = requests.Session()
        self.session.trust_env = False  # REQUESTS_CA_BUNDLE would replace our CA
        self.session.verify = endpoint.ca_cert
        self.session.headers.update(
            {"Authorization": f"Bearer {endpoint.token}", "User-Agent": agent}
        )

    def request(
        self,
        method: str,
        path: str,
        body: object = None,
        *,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
        timeout: float = 30,
    ) -> JSON:
        response = self.session.request(
            method,
            self.endpoint.server + path,
            data=None if body is None else json.dumps(body),
            params=params,
            headers={"Content-Type": content_type},
            timeout=timeout,
        )
        if response.status_code >= 400:
            raise ApiError(response.status_code, response.text)
        return dict(response.json()) if response.content else {}

    def get(self, path: str, **params: str) -> JSON:
        return self.request("GET", path, params=params or None)

    def create(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body)

    def patch(self, path: str, body: object, kind: str = "strategic-merge-patch") -> JSON:
        return self.request("PATCH", path, body, content_type=f"application/{kind}+json")

    def delete(self, path: str, options: JSON | None = None) -> JSON:
        return self.request("DELETE", path, options)

    def watch(
        self,
        path: str,
        on_list: Callable[[list[JSON]], None],
        on_event: Callable[[str, JSON], None],
        stop: threading.Event,
        **params: str,
    ) -> None:
        """List, then watch from the list's resourceVersion until ``stop``; on ``410 Gone`` or a
        broken stream, resume (or list again). ``on_list`` gets every object of each (re)list;
        ``on_event`` each ADDED, MODIFIED or DELETED after it."""
        version = ""
        while not stop.is_set():
            try:
                if not version:
                    listed = self.get(path, **params)
                    version = listed["metadata"]["resourceVersion"]
                    on_list(list(listed.get("items") or []))
                for kind, obj in self._stream(path, version, params):
                    if stop.is_set():
                        return
                    if kind == "ERROR":
                        version = ""  # 410 Gone (too old): list again
                        break
                    version = obj.get("metadata", {}).get("resourceVersion") or version
                    if kind != "BOOKMARK":
                        on_event(kind, obj)
            except (requests.RequestException, ApiError, ValueError, KeyError):
                if stop.wait(0.5):
                    return

    def _stream(
        self, path: str, version: str, params: Mapping[str, str]
    ) -> Iterator[tuple[str, JSON]]:
        query = {
            **params,
            "watch": "1",
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "60",
        }
        with self.session.get(
            self.endpoint.server + path, params=query, stream=True, timeout=(10, 90)
        ) as response:
            if response.status_code >= 400:
                raise ApiError(response.status_code, response.text)
            for line in response.iter_lines():
                if line:
                    event = json.loads(line)
                    yield str(event["type"]), dict(event["object"])
