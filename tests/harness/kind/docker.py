"""A Docker daemon in a network namespace of its own, started and stopped by the harness.

:class:`Dockerd` makes the namespace ``ddpjob-kind-<name>`` (``ip netns add``; loopback up,
``net.ipv4.ip_forward=1`` inside it only), then starts ``dockerd`` in it with
``nsenter --net=/run/netns/<ns>`` (not ``ip netns exec``, which remounts /sys and hides the v1
cgroup mounts: dockerd then dies with "Devices cgroup isn't mounted"). The daemon has no
docker0 bridge and writes no iptables rules; the networks kind makes (its "kind" bridge) and
every address on them exist only in that namespace, never in the machine's.

Where things are:

* data root (images, the image cache between runs): ``.cache/kind/docker`` (``docker-<name>``
  for another name); the daemon's log next to it, ``.cache/kind/dockerd-<name>.log``;
* socket, exec root (its containerd's state and socket), pidfile: ``/run/ddpjob-kind/<name>/``;
* default runtime: ``runc-capfilter`` (:mod:`tests.harness.kind.runc_capfilter`), so that
  ``docker run --privileged`` and ``docker exec --privileged`` work on a machine without
  CAP_SYS_RESOURCE in its bounding set.

A daemon already running under the same name is reused. Every user holds a shared lock on
``/run/ddpjob-kind/<name>/users.lock``; ``owner`` there names the process that started it (or
``keep`` for ``python -m tests.harness.kind.docker start``). :meth:`Dockerd.stop` by the last user
tears it down if that user started it or its starter is gone: every container removed (with
its anonymous volumes), dockerd stopped (its containerd goes with it), any process left in the
namespace killed, mounts under our directories unmounted, the namespace deleted. A ``keep``
daemon stays until ``python -m tests.harness.kind.docker stop``, which always tears down.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from tests.harness.kube.build import exclusive

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / ".cache" / "kind"
RUN_BASE = Path("/run/ddpjob-kind")
NETNS_DIR = Path("/run/netns")
CAPFILTER = Path(__file__).resolve().parent / "runc_capfilter.py"
SYSTEM_CONTAINERD = Path("/run/containerd/containerd.sock")
MADE_MODULES_MARKER = "made-lib-modules"
"""A file in the daemon's run directory: a kind cluster made /lib/modules, which the
teardown removes (if still empty) when the cluster's own delete did not run."""
START_TIMEOUT = 60.0
STOP_TIMEOUT = 40.0


class DockerError(RuntimeError):
    """The daemon could not be started, checked or stopped; the message says which check
    failed and what to do about it."""


def _log(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[kind.docker] {message}", file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for us (our own child that nobody reaped yet).
    with contextlib.suppress(OSError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            return False
    return True


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _tail(path: Path, lines: int = 8) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


class Dockerd:
    """dockerd in the network namespace ``ddpjob-kind-<name>``; see the module doc."""

    def __init__(
        self,
        name: str = "main",
        *,
        data_root: Path | None = None,
        cgroup_parent: str | None = None,
        quiet: bool = False,
    ) -> None:
        self.name = name
        self.netns_name = f"ddpjob-kind-{name}"
        self.netns = NETNS_DIR / self.netns_name
        self.run_dir = RUN_BASE / name
        self.socket = self.run_dir / "docker.sock"
        self.exec_root = self.run_dir / "exec"
        self.pidfile = self.run_dir / "dockerd.pid"
        default_root = CACHE / ("docker" if name == "main" else f"docker-{name}")
        self.data_root = data_root if data_root is not None else default_root
        self.log_path = CACHE / f"dockerd-{name}.log"
        self.cgroup_parent = cgroup_parent
        self.quiet = quiet
        self.pid: int | None = None
        self.started_here = False
        self._users: IO[str] | None = None
        self._process: subprocess.Popen[bytes] | None = None

    # ---- what callers use -------------------------------------------------------------------

    @property
    def host(self) -> str:
        return f"unix://{self.socket}"

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: our environment) with DOCKER_HOST set to this daemon."""
        merged = dict(os.environ if base is None else base)
        merged["DOCKER_HOST"] = self.host
        merged.pop("DOCKER_CONTEXT", None)
        return merged

    def netns_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run in the daemon's network namespace (same mount namespace, same files)."""
        return ["nsenter", f"--net={self.netns}", *argv]

    def run_in_netns(
        self, argv: Sequence[str], *, check: bool = True, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in the namespace with DOCKER_HOST set (kind, kubectl, helm, pytest:
        the ports docker publishes exist only there)."""
        env = self.env(kwargs.pop("env", None))
        return subprocess.run(self.netns_argv(argv), env=env, check=check, **kwargs)

    def docker(
        self,
        *args: str,
        check: bool = True,
        timeout: float | None = None,
        input_bytes: bytes | None = None,
        env_extra: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> subprocess.CompletedProcess[str]:
        """The docker CLI against this daemon; output captured as text unless redirected.
        ``input_bytes`` is fed to its stdin (``docker cp - ...``, ``docker load``)."""
        if "stdout" not in kwargs and "capture_output" not in kwargs:
            kwargs["capture_output"] = True
        env = {**self.env(), **(env_extra or {})}
        argv = ["docker", *args]
        if input_bytes is not None:
            raw = subprocess.run(argv, env=env, check=False, timeout=timeout, input=input_bytes,
                                 **kwargs)  # fmt: skip
            result = subprocess.CompletedProcess(
                argv, raw.returncode, (raw.stdout or b"").decode(errors="replace"),
                (raw.stderr or b"").decode(errors="replace"),
            )  # fmt: skip
        else:
            kwargs.setdefault("text", True)
            result = subprocess.run(argv, env=env, check=False, timeout=timeout, **kwargs)
        if check and result.returncode != 0:
            err = result.stderr.strip() if isinstance(result.stderr, str) else ""
            raise DockerError(f"docker {' '.join(args[:4])}: exit {result.returncode}: {err}")
        return result

    def answers(self) -> bool:
        if not self.socket.exists():
            return False
        try:
            result = self.docker("version", "--format", "{{.Server.Version}}", check=False,
                                 timeout=10)  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
        return result.returncode == 0

    def __enter__(self) -> Dockerd:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- start ------------------------------------------------------------------------------

    def _running_pid(self) -> int | None:
        try:
            pid = int(self.pidfile.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) and _comm(pid) == "dockerd" else None

    def _start_lock(self) -> contextlib.AbstractContextManager[None]:
        return exclusive(self.run_dir / "start.lock")

    def start(self, *, keep: bool = False) -> Dockerd:
        """Start the daemon, or join the one already running under this name. ``keep``: a
        daemon started here outlives every :meth:`stop` but a forced one."""
        if self._users is not None:
            return self
        if os.geteuid() != 0:
            raise DockerError("dockerd: needs root (network namespaces, mounts); run as root")
        for tool, package in (("dockerd", "docker.io"), ("docker", "docker.io"),
                              ("nsenter", "util-linux"), ("ip", "iproute2")):  # fmt: skip
            if shutil.which(tool) is None:
                raise DockerError(f"dockerd: `{tool}` is not on PATH; apt-get install {package}")
        if not os.access(CAPFILTER, os.X_OK):
            raise DockerError(f"dockerd: {CAPFILTER} is not executable; chmod +x it (git mode)")
        started = time.monotonic()
        with self._start_lock():
            pid = self._running_pid()
            if pid is not None:
                if not self.answers():
                    raise DockerError(
                        f"dockerd {self.name}: pid {pid} is running but does not answer on "
                        f"{self.socket} (log: {self.log_path}); stop it with "
                        f"`python -m tests.harness.kind.docker stop --name {self.name}`"
                    )
                self.pid = pid
                _log(f"reusing dockerd pid {pid} ({self.host}, netns {self.netns})", self.quiet)
            else:
                self._launch()
                self.started_here = True
                (self.run_dir / "owner").write_text("keep" if keep else str(os.getpid()))
                if not keep:
                    self._spawn_reaper()
            users = (self.run_dir / "users.lock").open("w")
            fcntl.flock(users, fcntl.LOCK_SH)
            self._users = users
        try:
            self._check_runtime()
        except DockerError:
            self.stop()
            raise
        if self.started_here:
            _log(f"dockerd pid {self.pid} up in {time.monotonic() - started:.1f}s "
                 f"({self.host}, netns {self.netns}, data root {self.data_root})",
                 self.quiet)  # fmt: skip
        return self

    def _spawn_reaper(self) -> None:
        """A process of its own that tears the daemon down if we die without :meth:`stop`
        (SIGKILL, a crash): the starter's death leaves no container, process, mount or
        namespace behind. It exits quietly once we stop the daemon ourselves."""
        log = self.log_path.open("a")
        subprocess.Popen(
            [sys.executable, "-m", "tests.harness.kind.docker", "--name", self.name, "reap",
             "--starter", str(os.getpid())],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
        )  # fmt: skip
        log.close()

    def reap(self, starter: int, interval: float = 0.5) -> bool:
        """Wait for ``starter`` to die; then, if it still owns the daemon, tear it down.
        Returns whether it did."""
        while _alive(starter):
            time.sleep(interval)
        try:
            owner = (self.run_dir / "owner").read_text().strip()
        except OSError:
            return False  # stopped (and cleaned) by its starter
        if owner != str(starter):
            return False  # another daemon under the same name now
        _log(f"its starter, pid {starter}, died without stopping it: tearing down", self.quiet)
        with self._start_lock():
            self._teardown()
        return True

    def _make_netns(self) -> None:
        if not self.netns.exists():
            result = subprocess.run(["ip", "netns", "add", self.netns_name],
                                    capture_output=True, text=True, check=False)  # fmt: skip
            if result.returncode != 0:
                raise DockerError(
                    f"dockerd: `ip netns add {self.netns_name}` failed: {result.stderr.strip()}"
                    " (needs CAP_SYS_ADMIN and a writable /run/netns)"
                )
        for argv in (["ip", "link", "set", "lo", "up"],
                     ["sysctl", "-qw", "net.ipv4.ip_forward=1"],
                     ["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]):  # fmt: skip
            result = subprocess.run(self.netns_argv(argv), capture_output=True, text=True,
                                    check=False)  # fmt: skip
            if result.returncode != 0:
                raise DockerError(
                    f"dockerd: `{' '.join(argv)}` in netns {self.netns_name} failed: "
                    f"{result.stderr.strip()}"
                )

    def argv(self) -> list[str]:
        """The dockerd command line (without the nsenter in front)."""
        argv = [
            "dockerd",
            f"--data-root={self.data_root}",
            f"--exec-root={self.exec_root}",
            f"--pidfile={self.pidfile}",
            f"--host={self.host}",
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            f"--add-runtime=capfilter={CAPFILTER}",
            "--default-runtime=capfilter",
            "--storage-driver=overlay2",
        ]
        if self.cgroup_parent:
            argv.append(f"--cgroup-parent={self.cgroup_parent}")
        return argv

    def _launch(self) -> None:
        if SYSTEM_CONTAINERD.exists():
            raise DockerError(
                f"dockerd: {SYSTEM_CONTAINERD} exists, and dockerd 20.10 would use that "
                "containerd instead of starting its own (its containers would then outlive our "
                "stop); stop the system containerd first"
            )
        self._make_netns()
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.exec_root.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.pidfile.unlink(missing_ok=True)
        _log(f"starting dockerd in netns {self.netns_name} (log: {self.log_path})", self.quiet)
        with self.log_path.open("ab") as log:
            process = subprocess.Popen(
                self.netns_argv(self.argv()),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, close_fds=True,
            )  # fmt: skip
        self.pid = process.pid  # nsenter execs dockerd: same pid
        self._process = process
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise DockerError(
                    f"dockerd exited at start (exit {process.returncode}); the end of "
                    f"{self.log_path}:\n{_tail(self.log_path)}"
                )
            if self.answers():
                return
            time.sleep(0.3)
        raise DockerError(
            f"dockerd did not answer on {self.socket} within {START_TIMEOUT:.0f}s; the end of "
            f"{self.log_path}:\n{_tail(self.log_path)}"
        )

    def _check_runtime(self) -> None:
        result = self.docker("info", "--format", "{{.DefaultRuntime}}", check=False, timeout=20)
        runtime = result.stdout.strip()
        if runtime != "capfilter":
            raise DockerError(
                f"dockerd {self.name}: the default runtime is {runtime!r}, not 'capfilter' "
                "(another daemon owns this socket?); stop it with "
                f"`python -m tests.harness.kind.docker stop --name {self.name}`"
            )

    def check_privileged(self, image: str) -> None:
        """``docker run --rm --privileged IMAGE true``: fails on this machine unless the
        capfilter runtime does its job."""
        result = self.docker("run", "--rm", "--privileged", "--network=none",
                             "--entrypoint=true", image, check=False, timeout=120)  # fmt: skip
        if result.returncode != 0:
            raise DockerError(
                f"`docker run --rm --privileged {image} true` failed: {result.stderr.strip()}; "
                "if it says 'unable to apply caps', the capfilter runtime did not filter: check "
                f"that {CAPFILTER} runs (`{CAPFILTER} --version`) and that dockerd uses it "
                "(`docker info | grep -i runtime`)"
            )

    # ---- stop -------------------------------------------------------------------------------

    def stop(self, *, force: bool = False) -> None:
        """Leave the daemon to its other users, or (last user, or ``force``) tear it all down."""
        users = self._users
        self._users = None
        if users is not None:
            users.close()
        elif not force:
            return
        if not force:
            reason = self._keep_reason()
            if reason:
                _log(f"dockerd {self.name} left running: {reason}", self.quiet)
                return
        with self._start_lock():
            self._teardown()

    def _keep_reason(self) -> str:
        """Why a non-forced stop leaves the daemon running ('' if it should not)."""
        with contextlib.suppress(OSError), (self.run_dir / "users.lock").open("w") as probe:
            try:
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return "another session uses it"
        try:
            owner = (self.run_dir / "owner").read_text().strip()
        except OSError:
            return ""
        if owner == "keep":
            return "started to be kept (python -m tests.harness.kind.docker stop ends it)"
        if owner.isdigit() and int(owner) != os.getpid() and _alive(int(owner)):
            return f"its starter, pid {owner}, is still running"
        return ""

    def _teardown(self) -> None:
        started = time.monotonic()
        if self.answers():
            ids = self.docker("ps", "-aq", check=False, timeout=30).stdout.split()
            if ids:
                self.docker("rm", "-f", "-v", *ids, check=False, timeout=120)
        pid = self._running_pid() or self.pid
        if pid is not None and _alive(pid) and _comm(pid) == "dockerd":
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if _alive(pid):
                _log(f"dockerd pid {pid} ignored SIGTERM for {STOP_TIMEOUT:.0f}s: SIGKILL",
                     self.quiet)  # fmt: skip
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self._process is not None:  # reap our child (no zombie left behind)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._process.wait(timeout=5)
            self._process = None
        killed = self._kill_leftovers()
        unmounted = self._unmount_leftovers()
        if self.netns.exists():
            subprocess.run(["ip", "netns", "del", self.netns_name], capture_output=True,
                           check=False)  # fmt: skip
        shutil.rmtree(self.exec_root, ignore_errors=True)
        made_modules = self.run_dir / MADE_MODULES_MARKER
        if (
            made_modules.exists()
        ):  # kind's docker run -v made /lib/modules (tests.harness.kind.cluster)
            with contextlib.suppress(OSError):  # not empty: someone else's now
                Path("/lib/modules").rmdir()
        for leftover in (self.socket, self.pidfile, self.run_dir / "owner", made_modules):
            leftover.unlink(missing_ok=True)
        self.pid = None
        extra = f"; killed {killed} leftover processes" if killed else ""
        extra += f"; unmounted {unmounted} leftover mounts" if unmounted else ""
        _log(f"dockerd {self.name} stopped in {time.monotonic() - started:.1f}s{extra}",
             self.quiet)  # fmt: skip

    def leftover_pids(self) -> list[int]:
        """Processes still in our network namespace, or naming our exec root (shims)."""
        try:
            ours = os.stat(self.netns)
        except OSError:
            ours = None
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                if ours is not None:
                    net = os.stat(entry / "ns" / "net")
                    if (net.st_dev, net.st_ino) == (ours.st_dev, ours.st_ino):
                        found.append(int(entry.name))
                        continue
                cmdline = (entry / "cmdline").read_bytes()
                if str(self.exec_root).encode() in cmdline:
                    found.append(int(entry.name))
        return found

    def _kill_leftovers(self) -> int:
        pids = self.leftover_pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        return len(pids)

    def leftover_mounts(self) -> list[str]:
        """Mount points under our run directory or data root, deepest first."""
        roots = (str(self.run_dir), str(self.data_root.resolve()))
        points = []
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                point = line.split()[4].replace("\\040", " ")
                if any(point == root or point.startswith(root + "/") for root in roots):
                    points.append(point)
        return sorted(set(points), key=lambda point: point.count("/"), reverse=True)

    def _unmount_leftovers(self) -> int:
        points = self.leftover_mounts()
        for point in points:
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        return len(points)

    def leftovers(self) -> list[str]:
        """What a clean stop must not leave: a description per item (empty: all clean)."""
        found = []
        if self.netns.exists():
            found.append(f"netns {self.netns}")
        found += [f"process {pid} ({_comm(pid)})" for pid in self.leftover_pids()]
        found += [f"mount {point}" for point in self.leftover_mounts()]
        if self._running_pid() is not None:
            found.append(f"dockerd pid {self._running_pid()}")
        return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness.kind.docker", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--name", default="main")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("start", help="start (or find) the daemon and leave it running")
    sub.add_parser("stop", help="tear the daemon down, whoever started it")
    sub.add_parser("status", help="print DOCKER_HOST and the namespace, or what is left over")
    reap = sub.add_parser("reap", help="(internal) tear down once the starter pid has died")
    reap.add_argument("--starter", type=int, required=True)
    run = sub.add_parser("exec", help="run a command in the namespace with DOCKER_HOST set")
    run.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    daemon = Dockerd(args.name)
    if args.command == "start":
        daemon.start(keep=True)
        print(f"DOCKER_HOST={daemon.host}\nNETNS={daemon.netns}")
        return 0
    if args.command == "reap":
        daemon.reap(args.starter)
        return 0
    if args.command == "stop":
        daemon.stop(force=True)
        left = daemon.leftovers()
        for item in left:
            print(f"left over: {item}", file=sys.stderr)
        return 1 if left else 0
    if args.command == "status":
        if daemon.answers():
            print(f"running: DOCKER_HOST={daemon.host} NETNS={daemon.netns} pid "
                  f"{daemon._running_pid()}")  # fmt: skip
            return 0
        left = daemon.leftovers()
        print("not running" + "".join(f"\nleft over: {item}" for item in left))
        return 1 if left else 0
    if not daemon.answers():
        print(f"dockerd {args.name} is not running: python -m tests.harness.kind.docker start",
              file=sys.stderr)  # fmt: skip
        return 1
    command = [a for a in args.argv if a != "--"] or ["sh"]
    return daemon.run_in_netns(command, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
