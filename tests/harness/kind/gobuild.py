"""Build every binary a kind cluster needs, from Go modules, with no container registry.

The pins live in Go modules, each with its ``go.sum``:

- ``hack/kube``: ``k8s.io/kubernetes`` (kubelet, kubeadm, kubectl, kube-proxy), the same pin the
  control plane of :mod:`tests.harness.kube.build` is built from;
- ``hack/kind/tools``: the ``kind`` CLI and the node's runtime at the versions kind v0.33.0's
  ``kindest/base`` is built with (containerd, runc, crictl, the CNI plugins);
- ``hack/kind/coredns``: CoreDNS with only the plugins kubeadm's Corefile uses (its own module,
  because CoreDNS pins an older client-go);

and ``pause`` is compiled with gcc from ``build/pause/linux/pause.c`` of the ``k8s.io/kubernetes``
module, as upstream's Makefile does. Everything comes from the Go module proxy; nothing else is
downloaded. The binaries land in ``.cache/kind/go-<versions>-<hash>/bin`` (ignored by git); the
hash covers every go.mod and go.sum, the CoreDNS main, pause.c, the build flags and the versions
of Go and gcc, so a change of any input builds into a new directory and an unchanged one is never
rebuilt. The binaries are built one step at a time (a link of the kubelet takes about 3 GB),
and a step whose binaries are already staged is not built again after a failure.

Failures stop with one line that names the step and the fix (:class:`BuildError`); the whole
output is kept in ``build.log`` next to the binaries.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.harness.kube import build as kube_build

ROOT = Path(__file__).resolve().parents[3]
KUBE_MODULE = kube_build.MODULE
TOOLS_MODULE = ROOT / "hack" / "kind" / "tools"
COREDNS_MODULE = ROOT / "hack" / "kind" / "coredns"
CACHE = ROOT / ".cache" / "kind"
PAUSE_VERSION = "3.10.2"  # TAG of k8s.io/kubernetes@v1.37.2/build/pause/Makefile
BINARIES = (
    "kind",
    "kubelet",
    "kubeadm",
    "kubectl",
    "kube-proxy",
    "containerd",
    "containerd-shim-runc-v2",
    "ctr",
    "crictl",
    "runc",
    "coredns",
    "pause",
    "host-local",
    "loopback",
    "ptp",
    "bridge",
    "portmap",
)
_PINS = {  # versions() key: (module dir, module path)
    "kind": (TOOLS_MODULE, "sigs.k8s.io/kind"),
    "kubernetes": (KUBE_MODULE, "k8s.io/kubernetes"),
    "containerd": (TOOLS_MODULE, "github.com/containerd/containerd/v2"),
    "runc": (TOOLS_MODULE, "github.com/opencontainers/runc"),
    "crictl": (TOOLS_MODULE, "sigs.k8s.io/cri-tools"),
    "cni": (TOOLS_MODULE, "github.com/containernetworking/plugins"),
    "coredns": (COREDNS_MODULE, "github.com/coredns/coredns"),
}
_CONTAINERD_TAGS = ("no_aufs", "no_btrfs", "no_devmapper", "no_zfs")
_PROXY_HINT = (
    "check that the Go module proxy is reachable (go env GOPROXY) and that `go version` is at "
    "least the `go` line of {module}/go.mod"
)


class BuildError(RuntimeError):
    """A kind binary could not be built; the message is one line with the fix."""


@dataclass(frozen=True)
class Step:
    """One ``go build`` (or, for pause, one gcc) run: the binaries it makes and how."""

    name: str
    module: Path
    packages: tuple[str, ...]
    binaries: tuple[str, ...]
    cgo: bool = False
    tags: tuple[str, ...] = ()
    ldflags: str = ""
    hint: str = ""


def _require(module: Path, path: str) -> str:
    text = (module / "go.mod").read_text()
    found = re.search(rf"^\s*(?:require\s+)?{re.escape(path)}\s+(v\S+)", text, re.M)
    if found is None:
        raise BuildError(f"{module / 'go.mod'} must require {path}; restore it from git")
    return found.group(1)


def versions() -> dict[str, str]:
    """The pinned versions, read from the go.mod files (pause: its image tag, without a ``v``)."""
    found = {name: _require(module, path) for name, (module, path) in _PINS.items()}
    return {**found, "pause": PAUSE_VERSION}


def steps() -> tuple[Step, ...]:
    """The build, in order: one ``go build`` per group of binaries, then pause."""
    pins = versions()
    kube = kube_build._ldflags(pins["kubernetes"])
    return (
        Step("kind", TOOLS_MODULE, ("sigs.k8s.io/kind",), ("kind",)),
        *(
            Step(name, KUBE_MODULE, (f"k8s.io/kubernetes/cmd/{name}",), (name,),
                 tags=("selinux", "notest"), ldflags=kube)
            for name in ("kubelet", "kubeadm", "kubectl", "kube-proxy")
        ),
        Step(
            "containerd", TOOLS_MODULE,
            tuple(f"github.com/containerd/containerd/v2/cmd/{name}" for name in
                  ("containerd", "containerd-shim-runc-v2", "ctr")),
            ("containerd", "containerd-shim-runc-v2", "ctr"),
            tags=_CONTAINERD_TAGS,
            ldflags=f"-X github.com/containerd/containerd/v2/version.Version={pins['containerd']}",
        ),
        Step(
            "runc", TOOLS_MODULE, ("github.com/opencontainers/runc",), ("runc",),
            cgo=True, tags=("seccomp", "urfave_cli_no_docs"),
            hint="runc is built with cgo against libseccomp: apt-get install gcc libseccomp-dev",
        ),
        Step(
            "crictl", TOOLS_MODULE, ("sigs.k8s.io/cri-tools/cmd/crictl",), ("crictl",),
            ldflags=f"-X sigs.k8s.io/cri-tools/pkg/version.Version={pins['crictl']}",
        ),
        Step(
            "cni", TOOLS_MODULE,
            tuple(f"github.com/containernetworking/plugins/plugins/{name}" for name in
                  ("ipam/host-local", "main/loopback", "main/ptp", "main/bridge", "meta/portmap")),
            ("host-local", "loopback", "ptp", "bridge", "portmap"),
            ldflags="-X github.com/containernetworking/plugins/pkg/utils/buildversion."
            f"BuildVersion={pins['cni']}",
        ),
        Step("coredns", COREDNS_MODULE, (".",), ("coredns",)),
        Step(
            "pause", KUBE_MODULE, ("build/pause/linux/pause.c",), ("pause",), cgo=True,
            hint="pause is compiled with gcc -static: apt-get install gcc libc6-dev",
        ),
    )  # fmt: skip


def _go() -> str:
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            "building the kind binaries: `go` is not on PATH; install Go 1.26 or newer "
            "(https://go.dev/dl/) and run `python -m tests.harness.kind build` again"
        )
    return go


def _env(*, cgo: bool) -> dict[str, str]:
    return {
        **os.environ,
        "CGO_ENABLED": "1" if cgo else "0",
        "GOTOOLCHAIN": "local",
        "GOFLAGS": "-mod=readonly -buildvcs=false",
    }


@functools.cache
def _go_version(go: str) -> str:
    result = subprocess.run(
        [go, "env", "GOVERSION"], env=_env(cgo=False), capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise BuildError(f"`go env GOVERSION` failed: {result.stderr.strip()[:200]}")
    return result.stdout.strip()


@functools.cache
def _gcc_version() -> str:
    gcc = shutil.which("gcc")
    if gcc is None:
        return "no gcc"  # the build stops with the fix; the key only has to be stable
    result = subprocess.run([gcc, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.partition("\n")[0]


@functools.cache
def _module_dir(module: Path, path: str, version: str) -> Path:
    """The extracted module ``path@version`` (``go mod download -json`` from ``module``)."""
    result = subprocess.run(
        [_go(), "mod", "download", "-json", f"{path}@{version}"],
        cwd=module, env=_env(cgo=False), capture_output=True, text=True, check=False,
    )  # fmt: skip
    try:
        info: Mapping[str, str] = json.loads(result.stdout)
    except json.JSONDecodeError:
        info = {"Error": (result.stderr.strip() or "no output").splitlines()[-1]}
    if result.returncode != 0 or "Dir" not in info:
        raise BuildError(
            f"downloading {path}@{version} failed (go mod download, exit {result.returncode}): "
            f"{info.get('Error', '?')[:200]}; " + _PROXY_HINT.format(module=module)
        )
    return Path(info["Dir"])


def kind_module_dir() -> Path:
    """The extracted ``sigs.k8s.io/kind`` module: ``images/base/files``, ``pkg/build/nodeimage``."""
    return _module_dir(TOOLS_MODULE, "sigs.k8s.io/kind", versions()["kind"])


def _pause_source() -> Path:
    return _module_dir(KUBE_MODULE, "k8s.io/kubernetes", versions()["kubernetes"]) / (
        "build/pause/linux/pause.c"
    )


def _go_argv(go: str, step: Step, out: Path) -> list[str]:
    argv = [go, "build", "-trimpath", "-ldflags", f"-s -w {step.ldflags}".strip()]
    if step.tags:
        argv += ["-tags", ",".join(step.tags)]
    return [*argv, "-o", f"{out}/", *step.packages]


def _pause_argv(out: Path) -> list[str]:
    return [
        "gcc", "-Os", "-Wall", "-Werror", "-static", f"-DVERSION=v{PAUSE_VERSION}-ddpjob",
        "-o", str(out / "pause"), str(_pause_source()),
    ]  # fmt: skip


def _inputs() -> bytes:
    """Everything the binaries depend on, for the cache key."""
    parts: list[bytes] = []
    for module in (KUBE_MODULE, TOOLS_MODULE, COREDNS_MODULE):
        for name in ("go.mod", "go.sum"):
            parts.append(f"{module.relative_to(ROOT)}/{name}".encode())
            parts.append((module / name).read_bytes())
    parts.append((COREDNS_MODULE / "main.go").read_bytes())
    parts.append(_pause_source().read_bytes())
    go = _go()
    example = Path("/out")
    for step in steps():
        argv = _pause_argv(example)[:-1] if step.name == "pause" else _go_argv(go, step, example)
        parts.append(repr((step.name, step.cgo, argv[1:])).encode())
    parts += [_go_version(go).encode(), _gcc_version().encode()]
    return b"\0".join(parts)


def bin_dir() -> Path:
    """Where the binaries of the current inputs are (built or not)."""
    pins = versions()
    digest = hashlib.sha256(_inputs()).hexdigest()[:12]
    return CACHE / f"go-kind-{pins['kind']}-k8s-{pins['kubernetes']}-{digest}" / "bin"


def built() -> bool:
    target = bin_dir()
    return all((target / name).is_file() for name in BINARIES)


def _say(quiet: bool, message: str) -> None:
    if not quiet:
        print(message, file=sys.stderr, flush=True)


def _run_step(step: Step, staging: Path, log_path: Path, *, nice: bool) -> None:
    """Build one step into a directory of its own, then move its binaries into ``staging``."""
    out = staging / f".{step.name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    if step.name == "pause":
        if shutil.which("gcc") is None:
            raise BuildError(f"building pause: `gcc` is not on PATH; {step.hint}")
        argv, tool, cwd = _pause_argv(out), "gcc", out
    else:
        argv, tool, cwd = _go_argv(_go(), step, out), "go build", step.module
    if nice:
        argv = ["nice", "-n", "19", *argv]
    result = subprocess.run(
        argv, cwd=cwd, env=_env(cgo=step.cgo), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, check=False,
    )  # fmt: skip
    with log_path.open("a") as log:
        log.write(f"== {step.name}: {' '.join(argv)}\n{result.stdout}")
    missing = [name for name in step.binaries if not (out / name).is_file()]
    if result.returncode != 0 or missing:
        tail = result.stdout.strip().splitlines()[-1:] or [f"no {', '.join(missing)} produced"]
        hint = step.hint or _PROXY_HINT.format(module=step.module.relative_to(ROOT))
        raise BuildError(
            f"building {step.name} failed ({tool}, exit {result.returncode}): {tail[0][:200]}; "
            f"the full output is in {log_path}; {hint}"
        )
    for name in step.binaries:
        (out / name).rename(staging / name)
    out.rmdir()


def build(*, quiet: bool = False, nice: bool = False) -> Path:
    """Build what is missing; return the directory of :data:`BINARIES`.

    ``nice=True`` runs the compilers under ``nice -n 19``, so a build can run next to the tests.
    """
    with kube_build.exclusive(CACHE / ".lock"):
        target = bin_dir()
        if built():
            return target
        staging = target.parent / "bin.partial"  # kept after a failure: same inputs, same key
        staging.mkdir(parents=True, exist_ok=True)
        log_path = target.parent / "build.log"
        todo = [s for s in steps() if not all((staging / b).is_file() for b in s.binaries)]
        _say(quiet, f"building {len(todo)} steps of the kind binaries into {target.parent}:")
        started = time.monotonic()
        for step in todo:
            _say(quiet, f"  {step.name} ({', '.join(step.binaries)}) ...")
            began = time.monotonic()
            _run_step(step, staging, log_path, nice=nice)
            took = f"{step.name}: {time.monotonic() - began:.0f}s"
            with log_path.open("a") as log:
                log.write(f"== {took}\n")
            _say(quiet, f"  {took}")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
        total = f"built in {time.monotonic() - started:.0f}s: {target}"
        with log_path.open("a") as log:
            log.write(f"== {total}\n")
        _say(quiet, total)
        return target
