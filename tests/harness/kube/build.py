"""Build etcd, kube-apiserver, kube-controller-manager and kube-scheduler from Go modules.

The pinned versions live in ``hack/kube/go.mod`` (with its ``go.sum``): ``k8s.io/kubernetes``
with a replace for every staging module, and ``go.etcd.io/etcd/server/v3``. Everything comes
from the Go module proxy; nothing else is downloaded. The binaries land in
``.cache/kube/<versions>-<hash of go.mod and go.sum>/bin`` (ignored by git), so a change of pin
builds into a new directory and an unchanged one is never rebuilt. Go's own build cache
(``go env GOCACHE``) makes a rebuild after a pin change fast.

Failures stop with one line that names the step and the fix (:class:`BuildError`); the whole
``go`` output is kept in ``build.log`` next to the binaries.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
MODULE = ROOT / "hack" / "kube"
CACHE = ROOT / ".cache" / "kube"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
PACKAGES = (
    "go.etcd.io/etcd/server/v3",
    "k8s.io/kubernetes/cmd/kube-apiserver",
    "k8s.io/kubernetes/cmd/kube-controller-manager",
    "k8s.io/kubernetes/cmd/kube-scheduler",
)
_REQUIRE = re.compile(r"^\s*(k8s\.io/kubernetes|go\.etcd\.io/etcd/server/v3)\s+(v\S+)", re.M)


class BuildError(RuntimeError):
    """The control plane could not be built; the message is one line with the fix."""


def versions() -> dict[str, str]:
    """The pinned ``k8s.io/kubernetes`` and etcd server versions, read from hack/kube/go.mod."""
    found = dict(_REQUIRE.findall((MODULE / "go.mod").read_text()))
    if len(found) != 2:
        raise BuildError(f"{MODULE / 'go.mod'} must require k8s.io/kubernetes and etcd server/v3")
    return found


def kubernetes_version() -> str:
    return versions()["k8s.io/kubernetes"]


def bin_dir() -> Path:
    """Where the binaries of the pinned versions are (built or not)."""
    pins = versions()
    key = f"{pins['k8s.io/kubernetes']}-etcd-{pins['go.etcd.io/etcd/server/v3']}"
    return CACHE / f"{key}-{module_digest(MODULE)}" / "bin"


def module_digest(module: Path) -> str:
    """12 hex digits of the sha256 of ``module``'s go.mod and go.sum: the part of a cache key
    that changes with any pin."""
    digest = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        digest.update((module / name).read_bytes())
    return digest.hexdigest()[:12]


def built() -> bool:
    return all((bin_dir() / name).is_file() for name in BINARIES)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (made, with its directory, if missing) for the block:
    parallel test sessions build (or start) a thing once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _ldflags(version: str) -> str:
    major, minor = version.lstrip("v").split(".")[:2]
    pkg = "k8s.io/component-base/version"
    return f"-X {pkg}.gitVersion={version} -X {pkg}.gitMajor={major} -X {pkg}.gitMinor={minor}"


def build(*, quiet: bool = False) -> Path:
    """Build what is missing; return the directory of the four binaries."""
    with exclusive(CACHE / ".lock"):
        target = bin_dir()
        if built():
            return target
        return go_build(
            MODULE, PACKAGES, target,
            what=f"the control plane ({', '.join(BINARIES)}; {kubernetes_version()})",
            rerun="make kube", tags=("selinux", "notest"), ldflags=_ldflags(kubernetes_version()),
            # go names the etcd binary after its package path, go.etcd.io/etcd/server/v3.
            renames={"server": "etcd", "v3": "etcd"}, quiet=quiet,
        )  # fmt: skip


def find_go(step: str, rerun: str) -> str:
    """The ``go`` on PATH; without one, a :class:`BuildError` naming ``step`` and the fix."""
    go = shutil.which("go")
    if go is None:
        raise BuildError(
            f"{step}: `go` is not on PATH; install Go 1.26 or newer (https://go.dev/dl/) and "
            f"run `{rerun}` again"
        )
    return go


def go_build(
    module: Path,
    packages: Sequence[str],
    target: Path,
    *,
    what: str,
    rerun: str,
    tags: Sequence[str] = (),
    ldflags: str = "",
    renames: Mapping[str, str] | None = None,
    quiet: bool = False,
) -> Path:
    """``go build`` ``packages`` of the Go module ``module`` into ``target`` and return it.

    The binaries are built into ``bin.partial`` next to ``target`` and moved in place only when
    all of them are there, so a failure never leaves a half-built ``target``; the whole ``go``
    output is kept in ``build.log`` next to it. The caller holds the lock (:func:`exclusive`) and
    has seen that ``target`` is missing. ``what`` names the build in messages, ``rerun`` is the
    command that starts it again, ``renames`` renames produced binaries (old name: new name).
    """
    go = find_go(f"building {what}", rerun)
    staging = target.parent / "bin.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    log_path = target.parent / "build.log"
    env = {**os.environ, "CGO_ENABLED": "0", "GOTOOLCHAIN": "local", "GOFLAGS": "-mod=readonly"}
    argv = [go, "build", "-trimpath", *(["-tags", ",".join(tags)] if tags else [])]
    argv += ["-ldflags", ldflags, "-o", str(staging) + "/", *packages]
    if not quiet:
        print(
            f"building {what} from {module}: minutes on a cold Go cache",
            file=sys.stderr,
            flush=True,
        )
    started = time.monotonic()
    with log_path.open("w") as log:
        result = subprocess.run(
            argv, cwd=module, env=env, stdout=log, stderr=subprocess.STDOUT, check=False
        )
    if result.returncode != 0:
        tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["?"]
        raise BuildError(
            f"building {what} failed (go build, exit {result.returncode}): "
            f"{tail[0][:200]}; the full output is in {log_path}; check that the Go module "
            "proxy is reachable (go env GOPROXY) and that `go version` is at least the "
            f"`go` line of {module / 'go.mod'}"
        )
    for produced, name in (renames or {}).items():
        if (staging / produced).is_file():
            (staging / produced).rename(staging / name)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    if not quiet:
        print(f"built in {time.monotonic() - started:.0f}s: {target}", file=sys.stderr)
    return target
