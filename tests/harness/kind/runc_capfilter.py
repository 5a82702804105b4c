#!/usr/bin/python3 -I
"""A runc in front of runc: drop the capabilities this machine cannot grant, then exec runc.

dockerd 20.10 asks runc for every capability the kernel knows when a container or an exec is
``--privileged``. Here CAP_SYS_RESOURCE is missing from every bounding set, so runc fails with
"unable to apply caps: operation not permitted" (moby#42906, fixed after 20.10). Docker runs
this file as its default runtime (:class:`tests.harness.kind.docker.Dockerd` passes ``--add-runtime``
and ``--default-runtime``); for ``create``/``run`` it rewrites ``<bundle>/config.json`` and for
``exec`` the ``--process`` file, keeping only capabilities in our own bounding set, then it
execs the real runc with the same arguments. Every other command goes straight to runc.

Standard library only; the real runc is ``$RUNC_REAL`` or ``/usr/sbin/runc``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

REAL_RUNC = "/usr/sbin/runc"

# The kernel's capability numbers (include/uapi/linux/capability.h), in order.
CAPABILITIES = (
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID",
    "SETPCAP", "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW",
    "IPC_LOCK", "IPC_OWNER", "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT",
    "SYS_ADMIN", "SYS_BOOT", "SYS_NICE", "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD",
    "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP", "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG",
    "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF", "CHECKPOINT_RESTORE",
)  # fmt: skip

# runc's global options that take a value (everything before the command).
_GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu", "--rootless"}


def bounding_set(status: str | None = None) -> int:
    """Our CapBnd mask, from ``/proc/self/status`` (or the given text of such a file)."""
    if status is None:
        with open("/proc/self/status") as handle:
            status = handle.read()
    for line in status.splitlines():
        if line.startswith("CapBnd:"):
            return int(line.split()[1], 16)
    raise ValueError("no CapBnd line in the status")


def missing(mask: int) -> set[str]:
    """Names (``CAP_...``) of the known capabilities whose bit is not in ``mask``."""
    return {f"CAP_{name}" for bit, name in enumerate(CAPABILITIES) if not mask >> bit & 1}


def filter_document(doc: dict[str, Any], drop: set[str]) -> bool:
    """Remove ``drop`` from every capability list of an OCI config (``process.capabilities``)
    or of a process file (``capabilities``). True if anything changed."""
    caps = (doc.get("process") or {}).get("capabilities") if "ociVersion" in doc else None
    if caps is None:
        caps = doc.get("capabilities")
    if not isinstance(caps, dict):
        return False
    changed = False
    for kind, names in caps.items():
        if not isinstance(names, list):
            continue
        kept = [name for name in names if name not in drop]
        if len(kept) != len(names):
            caps[kind] = kept
            changed = True
    return changed


def filter_file(path: str, drop: set[str]) -> bool:
    """:func:`filter_document` on a JSON file, rewritten in place (atomically) if it changed."""
    with open(path) as handle:
        doc = json.load(handle)
    if not filter_document(doc, drop):
        return False
    temporary = f"{path}.capfilter"
    with open(temporary, "w") as handle:
        json.dump(doc, handle)
    os.replace(temporary, path)
    return True


def target(argv: Sequence[str]) -> str | None:
    """The JSON file runc will read capabilities from for this command line, if any:
    ``<bundle>/config.json`` for create/run, the ``--process`` file for exec."""
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index]
        index += 2 if option in _GLOBAL_WITH_VALUE else 1
    if index >= len(argv):
        return None
    command, rest = argv[index], argv[index + 1 :]
    wanted = {"create": ("--bundle", "-b"), "run": ("--bundle", "-b"), "exec": ("--process", "-p")}
    if command not in wanted:
        return None
    found: str | None = None
    for position, arg in enumerate(rest):
        for flag in wanted[command]:
            if arg == flag and position + 1 < len(rest):
                found = rest[position + 1]
            elif arg.startswith(f"{flag}="):
                found = arg.split("=", 1)[1]
    if command == "exec":
        return found
    return os.path.join(found or ".", "config.json")


def main(argv: Sequence[str]) -> None:
    real = os.environ.get("RUNC_REAL", REAL_RUNC)
    path = target(argv)
    if path is not None and os.path.isfile(path):
        drop = missing(bounding_set())
        if drop:
            filter_file(path, drop)
    os.execv(real, [real, *argv])


if __name__ == "__main__":
    main(sys.argv[1:])
