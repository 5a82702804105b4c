"""A container's init, as a runtime's (runc init): set the container up, then exec its command.

The process kubelet starts every container as
``unshare --mount --uts --propagation private -- python -I -S tests/harness/kube/init.py SPEC``
followed by the container's argv. In the new mount and UTS namespaces this:

1. joins the container's cgroup and the pod's network namespace (``setns``);
2. opens every mount source first (``O_PATH``): a volume mounted over a parent of a later
   source (an emptyDir at ``/tmp`` while the pod's directory is under ``/tmp``) cannot hide
   it, since the bind is made from the open file, not from a path;
3. sets the hostname, bind-mounts the pod's hosts and resolv.conf, then each mount in order:
   an image's files as an overlay (copy-on-write: the container may write there, the source
   is never changed), a volume as a bind mount (a tmpfs for a memory-backed emptyDir),
   read-only where asked; and brings back the programs' own paths (the dev venv, the repo)
   where a mount hid them;
4. changes to the working directory (creating it, as runtimes do) and execs the command.

A failure prints one line and exits 128 (containerd's StartError). Standard library only, run
with ``-I -S``: it starts in a few milliseconds.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
SETUP_FAILED = 128
MARKER = "process-kubelet: container set-up failed"

_libc = ctypes.CDLL(None, use_errno=True)


def _encode(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    args = (_encode(source), _encode(target), _encode(fstype), flags, _encode(data))
    if _libc.mount(*args) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"mount {source or fstype} on {target}: {os.strerror(error)}")


def _bind(fd: int, target: str, recursive: bool = False) -> None:
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (MS_REC if recursive else 0), None)


def _target(path: str, like_file: bool) -> None:
    if like_file:
        os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
        if not os.path.exists(path):
            with open(path, "a"):
                pass
    else:
        os.makedirs(path, exist_ok=True)


def setup(spec: dict[str, object]) -> None:
    cgroup = spec.get("cgroup")
    if isinstance(cgroup, str):
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(os.getpid()))
    netns = spec.get("netns")
    if isinstance(netns, str):
        netns_fd = os.open(netns, os.O_RDONLY)
        if _libc.setns(netns_fd, CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"setns {netns}: {os.strerror(error)}")
        os.close(netns_fd)
    mounts = list(spec.get("mounts") or [])  # type: ignore[call-overload]
    keep = list(spec.get("keep") or [])  # type: ignore[call-overload]
    files = {"hosts": "/etc/hosts", "resolv": "/etc/resolv.conf"}
    opened = {name: os.open(str(spec[name]), os.O_PATH) for name in files}
    sources = [
        None if m.get("tmpfsBytes") is not None else os.open(m["source"], os.O_PATH) for m in mounts
    ]
    layers = [
        [os.open(path, os.O_RDONLY | os.O_DIRECTORY) for path in m["overlay"]]
        if m.get("overlay")
        else []
        for m in mounts
    ]
    kept = {path: os.open(path, os.O_PATH) for path in keep if os.path.exists(path)}
    socket.sethostname(str(spec["hostname"]))
    for name, target in files.items():
        _bind(opened[name], target)
    for mount, fd, layer in zip(mounts, sources, layers, strict=True):
        target = str(mount["target"])
        if fd is None:
            _target(target, like_file=False)
            _mount("tmpfs", target, "tmpfs", 0, f"size={int(mount['tmpfsBytes'])}")
        elif layer:
            # An image's files: copy-on-write over their source, as a container's rootfs.
            _target(target, like_file=False)
            lower = os.open(mount["source"], os.O_RDONLY | os.O_DIRECTORY)
            upper, work = (f"/proc/self/fd/{n}" for n in layer)
            options = f"lowerdir=/proc/self/fd/{lower},upperdir={upper},workdir={work}"
            _mount("overlay", target, "overlay", 0, options)
        else:
            _target(target, like_file=not os.path.isdir(f"/proc/self/fd/{fd}"))
            _bind(fd, target, recursive=True)
        if mount.get("readOnly"):
            _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY, None)
        prefix = target.rstrip("/") + "/"
        for path, kept_fd in kept.items():
            if path == target or path.startswith(prefix):
                _target(path, like_file=False)
                _bind(kept_fd, path, recursive=True)
    working_dir = str(spec.get("workingDir") or "/")
    os.makedirs(working_dir, exist_ok=True)
    os.chdir(working_dir)


def main() -> None:
    spec = json.loads(sys.argv[1])
    argv = sys.argv[2:]
    try:
        setup(spec)
    except OSError as exc:
        print(f"{exc}\n{MARKER}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    try:
        os.execv(argv[0], argv)
    except OSError as exc:
        print(f"exec {argv[0]}: {exc}\n{MARKER}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)


if __name__ == "__main__":
    main()
