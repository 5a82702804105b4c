"""A warm spare's own main: import torch, say so, wait for a worker's argv and environment,
and become that worker (:mod:`ddpjob_worker.agent.warm` is the agent's pool of them).

The spare runs as ``python -u -c <import ddpjob_worker.agent.spare ...> <script>``; handed a
worker, it sets the worker's argv and environment and runs the script as ``__main__``, as
``python -u script`` would. What differs from a cold start otherwise is kept from the worker's view:

* ``sys.path``: the spare drops ``-c``'s current directory before it imports anything, so a
  ``sympy.py`` in the working directory does not shadow torch's; at the handover the script's
  directory (``-m``: the current directory) goes first, as ``python`` puts it (none with
  ``PYTHONSAFEPATH``). What is preloaded stays preloaded, though: a module next to the script
  named like one torch imports shadows it in a cold worker only.
* stdin: the spare's stdin is the handover pipe; it also inherits a copy of the agent's stdin,
  which becomes its fd 0 and a new ``sys.stdin`` (made as python makes its own) at the handover:
  a warm worker reads what a cold one would (``ddpjob-agent train.py < input``, ``breakpoint()``
  under ``kubectl attach -it``).
* CUDA: a spare never initialises CUDA itself, but a ``sitecustomize``, a ``.pth`` hook or a
  preloaded module might, and the driver keeps the ``CUDA_VISIBLE_DEVICES`` it read then. A
  spare that holds a GPU device open (or whose ``torch.cuda`` says it is initialised) and is
  handed a worker with other ``CUDA_VISIBLE_DEVICES`` (``--virtual-local-rank``) does not run it:
  it says why on the worker's stderr and execs the worker's own command: a cold start, with the
  same pid, so the agent's ``Popen`` stays the worker's (:func:`cuda_pinned`).

Stdlib only (torch is what it imports for the worker, on a thread of its own).
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.util
import io
import json
import os
import runpy
import signal
import sys
import threading
import time
import types
from collections.abc import Iterable, Mapping, Sequence
from importlib.machinery import ModuleSpec
from typing import NoReturn

GPU_DEVICES = ("/dev/nvidia", "/dev/kfd")
"""Device files a process that initialised CUDA (or ROCm's HIP) holds open: ``/dev/nvidiactl``,
``/dev/nvidia-uvm``, ``/dev/nvidia0``..., ``/dev/kfd``."""
EXIT_WAIT_SECONDS = 2.0
"""How long a spare waits for its importing thread, at the idle policy, to finish dying."""
IDLE_OOM_SCORE_ADJ = "1000"
"""An idle spare's ``oom_score_adj``: the OOM killer's first choice, never a worker (a spare may
raise its own; at the handover it lowers it back to what it started with)."""


def _preload(names: Sequence[str]) -> None:
    for name in names:
        try:
            __import__(name)
        except BaseException:  # the worker's own import reports it, as in a cold start
            return


def _preload_idle(names: Sequence[str]) -> None:
    """:func:`_preload` at the ``SCHED_IDLE`` policy: this thread alone (and threads it starts),
    so that the process's main thread, the worker's, keeps the normal policy, which an
    unprivileged process could not get back (it needs ``CAP_SYS_NICE``)."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: the calling thread
    _preload(names)


def _import(names: Sequence[str], *, idle: bool) -> list[int]:
    """Preload ``names``, at the idle policy on a thread of its own if ``idle``: the threads left
    at that policy (:func:`_idle_threads`)."""
    if not idle:
        _preload(names)
        return []
    importer = threading.Thread(target=_preload_idle, args=(names,), name="preload", daemon=True)
    importer.start()
    importer.join()
    # join() returns before the thread has left the kernel, and a thread at the idle policy on
    # busy cores can take a while to finish dying: wait for it (a bounded while; it holds
    # nothing by then), so that the worker never starts with it still listed.
    task = f"/proc/self/task/{importer.native_id}"
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.005)
    return _idle_threads()


def _idle_threads() -> list[int]:
    """This process's threads left at the ``SCHED_IDLE`` policy once the idle preload is over
    (threads an import started, which inherit it), each set back to the normal policy where
    allowed: those that could not be."""
    left = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            try:
                if os.sched_getscheduler(tid) != os.SCHED_IDLE:
                    continue
                os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            except ProcessLookupError:
                continue  # it ended
            except OSError:
                left.append(tid)
    return left


def _take_stdin(fd: int | None) -> None:
    """Make ``fd`` (the copy of the agent's stdin; None: ``/dev/null``) this process's fd 0 in
    place of the handover pipe, and ``sys.stdin`` a new stream on it, made as python makes its
    own at start-up (the old one's buffer, name and seekability are the pipe's)."""
    if fd is None:
        fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    old = sys.__stdin__
    buffer = open(0, "rb", closefd=False)  # noqa: SIM115 - fd 0 lives as long as the process
    if isinstance(buffer.raw, io.FileIO):
        buffer.raw.name = "<stdin>"
    stdin = io.TextIOWrapper(
        buffer,
        encoding=old.encoding if old is not None else None,
        errors=old.errors if old is not None else None,
        newline="\n",
        line_buffering=old.line_buffering if old is not None else False,
        write_through=old.write_through if old is not None else False,
    )
    stdin.mode = "r"  # type: ignore[misc]
    sys.stdin = sys.__stdin__ = stdin  # type: ignore[misc]


def cuda_pinned(fd_targets: Iterable[str], torch_cuda_initialized: bool) -> bool:
    """Whether a process has initialised CUDA, and so keeps the ``CUDA_VISIBLE_DEVICES`` it had
    then: it holds a GPU device open (``fd_targets``: where its descriptors point,
    :data:`GPU_DEVICES`), or torch says so (``torch.cuda.is_available()`` opens the devices
    without setting torch's flag; the flag covers a driver that opens none)."""
    return torch_cuda_initialized or any(t.startswith(GPU_DEVICES) for t in fd_targets)


def _fd_targets() -> list[str]:
    """Where this process's file descriptors point (``/proc/self/fd``)."""
    targets = []
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                targets.append(os.readlink(f"/proc/self/fd/{name}"))
    return targets


def _torch_cuda_initialized() -> bool:
    """``torch.cuda.is_initialized()`` if ``torch.cuda`` is imported (this never imports it)."""
    check = getattr(sys.modules.get("torch.cuda"), "is_initialized", None)
    if not callable(check):
        return False
    try:
        return bool(check())
    except Exception:  # unknown: take it as initialised, a cold start is safe
        return True


def _start_cold(command: Sequence[str], env: Mapping[str, str]) -> NoReturn:
    """Become ``command`` with ``env``, as torch's ``Popen`` would have started it (the default
    SIGPIPE and SIGXFSZ of its ``restore_signals``; fds 0 to 2; the spare's new session)."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    os.execvpe(command[0], list(command), dict(env))  # noqa: S606 - the worker's own command


def _oom_score_adj(value: str | None = None) -> str | None:
    """This process's ``oom_score_adj``, or set it; None when it cannot be read or set."""
    path = "/proc/self/oom_score_adj"
    try:
        if value is None:
            with open(path, encoding="ascii") as handle:
                return handle.read().strip()
        with open(path, "w", encoding="ascii") as handle:
            handle.write(value)
    except OSError:
        return None
    return value


def _say_ready(fd: int | None) -> None:
    """One byte on the readiness pipe, then close it: the worker must not inherit it."""
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, b"1")
    with contextlib.suppress(OSError):
        os.close(fd)


def run(argv: Sequence[str]) -> None:
    """Import torch, say so, wait for a worker's argv and environment, and run it as
    ``__main__``.

    ``argv``: ``--preload mod1,mod2``, ``--ready-fd N`` (the pipe :attr:`Spare.ready` reads),
    ``--stdin-fd N`` (the agent's stdin, the worker's), ``--idle 1`` (import at the
    ``SCHED_IDLE`` policy, on a thread of its own), then, ignored, what the worker will run (for
    ``ps``).

    With ``--idle``, the main thread says ready only once the importing thread has ended: it
    would otherwise hold the GIL at a priority any busy core starves, and the worker's main
    thread would wait for it (a priority inversion of over a second with both cores busy).
    """
    options = dict(zip(argv[0::2], argv[1::2], strict=False))
    ready_fd = int(options["--ready-fd"]) if "--ready-fd" in options else None
    idle = options.get("--idle") == "1"
    stdin_fd = int(options["--stdin-fd"]) if "--stdin-fd" in options else None
    container_score = _oom_score_adj()
    if container_score is not None:
        _oom_score_adj(IDLE_OOM_SCORE_ADJ)
    # Read the handover while we import: a payload beyond the pipe's 64 KiB (a namespace's many
    # service variables) would otherwise block the agent's write until the imports are done.
    received: list[bytes] = []
    reader = threading.Thread(
        target=lambda: received.append(sys.stdin.buffer.read()), name="handover", daemon=True
    )
    reader.start()
    names = [name for name in options.get("--preload", "").split(",") if name]
    try:
        left = _import(names, idle=idle)
    finally:
        _say_ready(ready_fd)
    reader.join()
    data = received[0] if received else b""
    if not data:
        return  # the agent closed the pool or died
    message = json.loads(data)
    worker_argv: list[str] = message["argv"]
    if container_score is not None and _oom_score_adj(container_score) is None:
        print(
            f"ddpjob warm worker: could not set oom_score_adj back to {container_score}",
            file=sys.stderr,
            flush=True,
        )
    spare_devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ.clear()
    os.environ.update(message["env"])
    _take_stdin(stdin_fd)
    devices = os.environ.get("CUDA_VISIBLE_DEVICES")
    if devices != spare_devices and cuda_pinned(_fd_targets(), _torch_cuda_initialized()):
        print(
            f"ddpjob warm worker: CUDA was initialised in this spare with CUDA_VISIBLE_DEVICES="
            f"{spare_devices!r}; the worker's is {devices!r}: starting it cold",
            file=sys.stderr,
            flush=True,
        )
        _start_cold(message["command"], os.environ)
    if left:
        print(
            f"ddpjob warm worker: threads {left} started by the imports keep the idle policy "
            "(setting it back needs CAP_SYS_NICE): starting the worker cold",
            file=sys.stderr,
            flush=True,
        )
        _start_cold(message["command"], os.environ)
    if worker_argv[0] == "-m":
        if not sys.flags.safe_path:
            sys.path.insert(0, os.getcwd())  # as python -m does
        _run_module(worker_argv[1], worker_argv[2:])
        return
    script = worker_argv[0]
    sys.argv = list(worker_argv)
    if not os.path.isfile(script):  # a directory or zip with __main__.py: runpy's to find
        runpy.run_path(script, run_name="__main__")  # it puts the path first, as python does
        return
    if not sys.flags.safe_path:
        sys.path.insert(0, os.path.dirname(os.path.realpath(script)))  # as python does
    with open(script, "rb") as handle:
        source = handle.read()
    _exec_as_main(compile(source, script, "exec"), file=script, spec=None)


def _run_module(name: str, args: Sequence[str]) -> None:
    """``python -m name args``: the module (a package's ``__main__``) as ``__main__``."""
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.submodule_search_locations is not None:
        spec = importlib.util.find_spec(f"{name}.__main__")
    if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
        sys.argv = [name, *args]  # runpy sets argv[0] to the module's file
        runpy.run_module(name, run_name="__main__", alter_sys=True)
        return
    sys.argv = [spec.origin or name, *args]
    code = spec.loader.get_code(spec.name)
    _exec_as_main(code, file=spec.origin, spec=spec)


def _exec_as_main(code: types.CodeType, *, file: str | None, spec: ModuleSpec | None) -> None:
    """Run ``code`` in a new ``__main__`` module that stays ``sys.modules["__main__"]`` for the
    rest of the process, as python's own does: pickle looks a script's classes up there, from
    an atexit handler or a thread that outlives the script's body too (``runpy`` puts its own
    ``__main__`` back when the body returns)."""
    main = types.ModuleType("__main__")
    main.__dict__.update(
        __file__=file,
        __cached__=None,
        __spec__=spec,
        __loader__=spec.loader if spec is not None else None,
        __package__=spec.parent if spec is not None else None,
        __builtins__=builtins,
    )
    sys.modules["__main__"] = main
    exec(code, main.__dict__)  # noqa: S102 - the worker's own script, as python would run it


if __name__ == "__main__":
    run(sys.argv[1:])
