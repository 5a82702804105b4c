"""Starting the emulator: in this event loop, in a thread, or in a child process.

* :func:`running_emulator` — ``async with``, in the caller's loop; ``handle.control`` is the
  :class:`~tests.harness.emulator.store.Emulator` itself. Only for tests that do not run kopf in the
  same loop.
* :class:`EmulatorProcess` — a child process (``python -m tests.harness.emulator``); ``with`` or
  ``async with``. ``handle.control`` is an :class:`EmulatorControl` that talks to the control
  endpoint over HTTP. This is the mode to test an operator with: nothing is shared with it.
* :class:`EmulatorThread` — the same, in a thread of this process with its own event loop.

Every mode listens on 127.0.0.1 on free ports: one for the Kubernetes API, one for control.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import yaml
from aiohttp import web

from tests.harness.emulator.server import ApiApp
from tests.harness.emulator.store import ApiError, Emulator, Obj, iter_bundled_resources

REPO_ROOT = Path(__file__).resolve().parents[3]
DDPJOB_CRD_PATH = REPO_ROOT / "deploy" / "crd.yaml"
HOST = "127.0.0.1"


@dataclasses.dataclass
class EmulatorOptions:
    """How the emulator starts. Every field is also a ``--flag`` of ``python -m tests.harness.emulator``."""

    with_ddpjob_crd: bool = True  # serve ddpjobs.ddpjob.io (from deploy/crd.yaml)
    with_peering_crds: bool = True  # serve kopf.dev kopfpeerings / clusterkopfpeerings
    namespaces: tuple[str, ...] = ("default", "kube-system")
    auto_namespaces: bool = True  # creating in an unknown namespace creates it (else 404)
    garbage_collection: bool = True  # delete dependents of deleted owners (ownerReferences)
    kubelet_alive: bool = False  # delete every pod gracefully, even unscheduled ones
    auto_kubelet: bool = False  # schedule + run new pods, confirm graceful deletions by itself
    auto_kubelet_delay: float = 0.0
    history_size: int = 100_000  # watch events kept per resource (older RVs: 410 Gone)
    bookmark_interval: float = 10.0  # seconds between BOOKMARKs (allowWatchBookmarks=true)


def ddpjob_crd() -> Obj:
    """The project's CRD manifest (deploy/crd.yaml)."""
    with DDPJOB_CRD_PATH.open() as f:
        crd: Obj = yaml.safe_load(f)
    return crd


def kopf_peering_crds() -> list[Obj]:
    """The CRDs kopf's peering uses (as in kopf's own peering.yaml)."""
    out: list[Obj] = []
    for plural, kind, scope in (
        ("kopfpeerings", "KopfPeering", "Namespaced"),
        ("clusterkopfpeerings", "ClusterKopfPeering", "Cluster"),
    ):
        out.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.kopf.dev"},
                "spec": {
                    "group": "kopf.dev",
                    "scope": scope,
                    "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {
                                        "status": {
                                            "type": "object",
                                            "x-kubernetes-preserve-unknown-fields": True,
                                        }
                                    },
                                }
                            },
                        }
                    ],
                },
            }
        )
    return out


def build_emulator(options: EmulatorOptions) -> Emulator:
    """An emulator with the built-in resources and the CRDs the options ask for.

    Must be called inside a running event loop (creating objects schedules callbacks)."""
    emu = Emulator(
        history_size=options.history_size,
        auto_namespaces=options.auto_namespaces,
        garbage_collection=options.garbage_collection,
        kubelet_alive=options.kubelet_alive,
        auto_kubelet=options.auto_kubelet,
        auto_kubelet_delay=options.auto_kubelet_delay,
        bookmark_interval=options.bookmark_interval,
    )
    for defn in iter_bundled_resources():
        emu.register(defn)
    nsdefn = emu.find_resource("v1/namespaces")
    for ns in options.namespaces:
        emu.create(nsdefn, None, {"metadata": {"name": ns}})
    crds = []
    if options.with_ddpjob_crd:
        crds.append(ddpjob_crd())
    if options.with_peering_crds:
        crds.extend(kopf_peering_crds())
    crd_defn = emu.find_resource("apiextensions.k8s.io/v1/customresourcedefinitions")
    for crd in crds:
        emu.create(crd_defn, None, crd)
    return emu


# --------------------------------------------------------------------------- control endpoint
CONTROL_METHODS = frozenset(
    {
        "add_fault",
        "clear_faults",
        "drop_watches",
        "silence_watches",
        "open_watches",
        "compact_history",
        "requests",
        "clear_requests",
        "count_requests",
        "set_kubelet_alive",
        "schedule_pod",
        "set_pod_phase",
        "kubelet_confirm",
        "set_pod_log",
        "get_object",
        "list_objects",
        "current_resource_version",
    }
)


def make_control_app(emu: Emulator) -> web.Application:
    async def call(request: web.Request) -> web.Response:
        method = request.match_info["method"]
        if method not in CONTROL_METHODS:
            return web.json_response({"error": f"unknown control method {method!r}"}, status=404)
        raw = await request.read()
        kwargs = json.loads(raw) if raw.strip() else {}
        try:
            result = getattr(emu, method)(**kwargs)
        except ApiError as e:
            return web.json_response({"error": e.message, "code": e.code}, status=400)
        except (KeyError, TypeError, ValueError) as e:
            return web.json_response({"error": repr(e)}, status=400)
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/control/{method}", call)
    app.router.add_get("/control/health", health)
    return app


class ControlError(RuntimeError):
    """The control endpoint refused a call (e.g. a pod that does not exist)."""


class Control(Protocol):
    """What a test can do to the emulator; both :class:`Emulator` (in-process) and
    :class:`EmulatorControl` (over HTTP) provide it."""

    def add_fault(
        self,
        method: str,
        path: str,
        status: int,
        count: int = 1,
        message: str | None = None,
        retry_after: int | None = None,
        delay: float = 0.0,
    ) -> int: ...
    def clear_faults(self) -> None: ...
    def drop_watches(self, abort: bool = False) -> int: ...
    def silence_watches(self, silent: bool = True) -> None: ...
    def open_watches(self) -> int: ...
    def compact_history(self) -> int: ...
    def requests(self, since: int = 0) -> list[dict[str, Any]]: ...
    def clear_requests(self) -> None: ...
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
    ) -> int: ...
    def set_kubelet_alive(self, alive: bool = True) -> None: ...
    def schedule_pod(self, namespace: str, name: str, node_name: str = "emulated-node") -> Obj: ...
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
    ) -> Obj: ...
    def kubelet_confirm(self, namespace: str, name: str) -> bool: ...
    def set_pod_log(self, namespace: str, name: str, text: str) -> None: ...
    def get_object(self, resource: str, namespace: str | None, name: str) -> Obj | None: ...
    def list_objects(self, resource: str, namespace: str | None = None) -> list[Obj]: ...
    def current_resource_version(self) -> int: ...


class EmulatorControl:
    """The control surface over HTTP (blocking calls of ~1 ms; from async code in another
    loop they are fine, or wrap them in ``asyncio.to_thread``)."""

    def __init__(self, control_url: str) -> None:
        self.control_url = control_url.rstrip("/")

    def _call(self, op: str, /, **kwargs: Any) -> Any:
        req = urllib.request.Request(
            f"{self.control_url}/control/{op}",
            data=json.dumps(kwargs).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return json.loads(resp.read())["result"]
        except urllib.error.HTTPError as e:
            raise ControlError(e.read().decode(errors="replace")) from e

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
        return int(
            self._call(
                "add_fault",
                method=method,
                path=path,
                status=status,
                count=count,
                message=message,
                retry_after=retry_after,
                delay=delay,
            )
        )

    def clear_faults(self) -> None:
        self._call("clear_faults")

    def drop_watches(self, abort: bool = False) -> int:
        return int(self._call("drop_watches", abort=abort))

    def silence_watches(self, silent: bool = True) -> None:
        self._call("silence_watches", silent=silent)

    def open_watches(self) -> int:
        return int(self._call("open_watches"))

    def compact_history(self) -> int:
        return int(self._call("compact_history"))

    def requests(self, since: int = 0) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("requests", since=since)
        return result

    def clear_requests(self) -> None:
        self._call("clear_requests")

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
        return int(
            self._call(
                "count_requests",
                verb=verb,
                resource=resource,
                method=method,
                namespace=namespace,
                subresource=subresource,
                status=status,
                name=name,
            )
        )

    def set_kubelet_alive(self, alive: bool = True) -> None:
        self._call("set_kubelet_alive", alive=alive)

    def schedule_pod(self, namespace: str, name: str, node_name: str = "emulated-node") -> Obj:
        result: Obj = self._call(
            "schedule_pod", namespace=namespace, name=name, node_name=node_name
        )
        return result

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
        result: Obj = self._call(
            "set_pod_phase",
            namespace=namespace,
            name=name,
            phase=phase,
            container_statuses=container_statuses,
            conditions=conditions,
            exit_code=exit_code,
            reason=reason,
            message=message,
            pod_ip=pod_ip,
            restart_count=restart_count,
        )
        return result

    def kubelet_confirm(self, namespace: str, name: str) -> bool:
        return bool(self._call("kubelet_confirm", namespace=namespace, name=name))

    def set_pod_log(self, namespace: str, name: str, text: str) -> None:
        self._call("set_pod_log", namespace=namespace, name=name, text=text)

    def get_object(self, resource: str, namespace: str | None, name: str) -> Obj | None:
        result: Obj | None = self._call(
            "get_object", resource=resource, namespace=namespace, name=name
        )
        return result

    def list_objects(self, resource: str, namespace: str | None = None) -> list[Obj]:
        result: list[Obj] = self._call("list_objects", resource=resource, namespace=namespace)
        return result

    def current_resource_version(self) -> int:
        return int(self._call("current_resource_version"))


# --------------------------------------------------------------------------- handles
def kubeconfig_dict(url: str, namespace: str = "default") -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "emulator", "cluster": {"server": url}}],
        "users": [{"name": "emulator", "user": {"token": "emulator-token"}}],
        "contexts": [
            {
                "name": "emulator",
                "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace},
            }
        ],
        "current-context": "emulator",
    }


@dataclasses.dataclass
class EmulatorHandle:
    """A running emulator: its API ``url``, its ``control``, and a kubeconfig writer."""

    url: str
    control_url: str
    control: Control

    def write_kubeconfig(self, path: str | os.PathLike[str], namespace: str = "default") -> Path:
        """A kubeconfig (JSON, which is YAML) whose current context points at the emulator."""
        out = Path(path)
        out.write_text(json.dumps(kubeconfig_dict(self.url, namespace), indent=2))
        return out


async def start_servers(
    emu: Emulator, port: int = 0, control_port: int = 0
) -> tuple[list[web.AppRunner], str, str]:
    runners: list[web.AppRunner] = []
    urls: list[str] = []
    for app, want in ((ApiApp(emu).make_app(), port), (make_control_app(emu), control_port)):
        runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, HOST, want)
        await site.start()
        server = site._server
        assert server is not None
        sockets = getattr(server, "sockets", None) or []
        real_port = sockets[0].getsockname()[1]
        runners.append(runner)
        urls.append(f"http://{HOST}:{real_port}")
    return runners, urls[0], urls[1]


async def stop_servers(emu: Emulator, runners: list[web.AppRunner]) -> None:
    emu.drop_watches()
    await asyncio.sleep(0)
    for runner in runners:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def running_emulator(**options: Any) -> AsyncIterator[EmulatorHandle]:
    """The emulator in the current event loop (``handle.control`` is the Emulator itself)."""
    emu = build_emulator(EmulatorOptions(**options))
    runners, url, control_url = await start_servers(emu)
    try:
        yield EmulatorHandle(url, control_url, emu)
    finally:
        await stop_servers(emu, runners)


class EmulatorThread:
    """The emulator in a daemon thread with its own event loop (``with``)."""

    def __init__(self, **options: Any) -> None:
        self.options = EmulatorOptions(**options)
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="k8s-emulator", daemon=True)
        self.handle: EmulatorHandle | None = None

    def _run(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            emu = build_emulator(self.options)
            runners, url, control_url = await start_servers(emu)
            self.handle = EmulatorHandle(url, control_url, EmulatorControl(control_url))
            self._ready.set()
            await self._stop.wait()
            await stop_servers(emu, runners)

        try:
            asyncio.run(main())
        except BaseException as e:
            self._error = e
            self._ready.set()

    def start(self) -> EmulatorHandle:
        self._thread.start()
        self._ready.wait(30)
        if self.handle is None:
            raise RuntimeError(f"the emulator thread did not start: {self._error!r}")
        return self.handle

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self) -> EmulatorHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class EmulatorProcess:
    """The emulator in a child process (``with`` or ``async with``); recommended for kopf."""

    def __init__(self, **options: Any) -> None:
        self.options = EmulatorOptions(**options)
        self.proc: subprocess.Popen[str] | None = None
        self.handle: EmulatorHandle | None = None

    def start(self, timeout: float = 30.0) -> EmulatorHandle:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.harness.emulator",
                "--options",
                json.dumps(dataclasses.asdict(self.options)),
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop()
            raise RuntimeError("the emulator process did not start (see its stderr)")
        info = json.loads(line)
        self.handle = EmulatorHandle(
            info["url"], info["control_url"], EmulatorControl(info["control_url"])
        )
        return self.handle

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> EmulatorHandle:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> EmulatorHandle:
        return await asyncio.to_thread(self.start)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await asyncio.to_thread(self.stop)


async def serve_forever(options: EmulatorOptions) -> None:
    """The child process's main: print one JSON line with the URLs, serve until SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    emu = build_emulator(options)
    runners, url, control_url = await start_servers(emu)
    print(json.dumps({"url": url, "control_url": control_url, "pid": os.getpid()}), flush=True)
    await stop.wait()
    await stop_servers(emu, runners)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.emulator", description=__doc__)
    parser.add_argument("--options", default="{}", help="EmulatorOptions as JSON")
    for f in dataclasses.fields(EmulatorOptions):
        if f.type in ("bool", bool):
            parser.add_argument(
                f"--{f.name.replace('_', '-')}", dest=f.name, action=argparse.BooleanOptionalAction
            )
    args = parser.parse_args(argv)
    opts: dict[str, Any] = json.loads(args.options)
    for f in dataclasses.fields(EmulatorOptions):
        value = getattr(args, f.name, None)
        if value is not None:
            opts[f.name] = value
    if "namespaces" in opts:
        opts["namespaces"] = tuple(opts["namespaces"])
    asyncio.run(serve_forever(EmulatorOptions(**opts)))
