"""The live view of ``ddpjob run``: a rich table on a TTY, plain log lines otherwise."""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ddpjob_operator import api
from ddpjob_operator.core.events import Event

if TYPE_CHECKING:
    from ddpjob_operator.local.pods import LocalPod
    from ddpjob_operator.local.runner import Progress


class View(Protocol):
    def start(self, job: api.DDPJob, run_dir: Path) -> None: ...
    def update(
        self, job: api.DDPJob, pods: Mapping[str, LocalPod], progress: Progress, elapsed: float
    ) -> None: ...
    def event(self, event: Event) -> None: ...
    def message(self, text: str) -> None: ...
    def summary(self, text: str, ok: bool) -> None: ...
    def stop(self) -> None: ...


def _pod_phase(pod: LocalPod) -> str:
    if pod.deleting_since is not None:
        return "Terminating"
    code = pod.exit_code
    if code is None and pod.frozen_since is not None:
        return "Frozen (SIGSTOP)"
    if code is None:
        state = pod.agent_state
        return f"Running ({state.phase.value})" if state is not None else "Running"
    return "Succeeded" if code == 0 else f"Failed ({code})"


def _headline(job: api.DDPJob, progress: Progress, elapsed: float) -> str:
    status = job.status
    step = "-" if progress.step is None else str(progress.step)
    store = f"  store {status.store_host}" if status.store_host else ""
    return (
        f"{job.name}: {status.phase.value}  world {status.world_size}  "
        f"pods {status.ready_replicas}/{progress.desired} ready  "
        f"replaced {status.restarts}{store}  step {step}  {elapsed:.0f}s"
    )


class PlainView:
    """One line per change, for logs and CI."""

    def __init__(self) -> None:
        self.last = ""

    def _print(self, text: str) -> None:
        print(f"[ddpjob {time.strftime('%H:%M:%S')}] {text}", flush=True)

    def start(self, job: api.DDPJob, run_dir: Path) -> None:
        self._print(f"running DDPJob {job.name}; logs, state and checkpoints in {run_dir}")

    def update(
        self, job: api.DDPJob, pods: Mapping[str, LocalPod], progress: Progress, elapsed: float
    ) -> None:
        pods_text = "  ".join(f"{p.name}={_pod_phase(p)}" for p in pods.values())
        line = f"{_headline(job, progress, elapsed)}  |  {pods_text}"
        comparable = line.split("  step ", maxsplit=1)[0] + pods_text
        if comparable != self.last:
            self.last = comparable
            self._print(line)

    def event(self, event: Event) -> None:
        self._print(f"{event.type}: {event.reason}: {event.message}")

    def message(self, text: str) -> None:
        self._print(text)

    def summary(self, text: str, ok: bool) -> None:
        print(text, file=sys.stdout if ok else sys.stderr, flush=True)

    def stop(self) -> None:
        pass


class RichView:
    """A live table: one row per pod, the job's phase, world size and progress on top."""

    def __init__(self) -> None:
        self.console = Console()
        self.live = Live(console=self.console, refresh_per_second=4, transient=False)
        self.notes: list[str] = []

    def start(self, job: api.DDPJob, run_dir: Path) -> None:
        self.console.print(
            f"running DDPJob [bold]{job.name}[/]; logs, state and checkpoints in {run_dir}"
        )
        self.live.start()

    def update(
        self, job: api.DDPJob, pods: Mapping[str, LocalPod], progress: Progress, elapsed: float
    ) -> None:
        table = Table(title=_headline(job, progress, elapsed), title_justify="left")
        for column in ("pod", "phase", "pid", "agent restarts", "log"):
            table.add_column(column)
        for pod in sorted(pods.values(), key=lambda p: p.index):
            restarts = progress.agent_restarts.get(pod.uid, 0)
            table.add_row(
                pod.name, _pod_phase(pod), str(pod.process.pid), str(restarts), pod.log_path.name
            )
        self.live.update(Group(table, Text("\n".join(self.notes[-6:]))))

    def event(self, event: Event) -> None:
        self.message(f"{event.reason}: {event.message}")

    def message(self, text: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S')} {text}")

    def summary(self, text: str, ok: bool) -> None:
        self.live.stop()
        self.console.print(Text(text, style="green" if ok else "red"))

    def stop(self) -> None:
        self.live.stop()


def make_view(plain: bool) -> View:
    if plain or not sys.stdout.isatty():
        return PlainView()
    return RichView()
