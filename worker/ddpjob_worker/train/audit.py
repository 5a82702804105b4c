"""An audit of what each rank trained: with ``DDPJOB_TRAIN_AUDIT=<directory>`` in a worker's
environment, every rank appends one JSON line per restore and per committed step to
``<directory>/rank<rank>-<pid>.jsonl``, so that a run can be checked afterwards without a line
in the script: every sample seen exactly once per epoch along the steps the job kept, and every
rank holding the same model after each restore (:func:`check`).

A line per restore: ``{"t", "restore": step, "rank", "world", "sum": the model's checksum}``;
per commit: ``{"t", "step": the step committed, "rank", "world", "from": [epoch, processed],
"to": [epoch, processed], "batches": [[epoch, [indices]], ...]}``: the sampler's committed
position before and after the step (the whole job's) and this rank's batches (several for a
step of micro-batches). Off by default: it costs a file write per step.
"""

from __future__ import annotations

import collections
import json
import os
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

DDPJOB_TRAIN_AUDIT = "DDPJOB_TRAIN_AUDIT"

__all__ = ["DDPJOB_TRAIN_AUDIT", "Audit", "Lineage", "check", "read"]


class Audit:
    """This process's audit file (line-buffered: a worker killed after a commit has written
    the commit's line)."""

    def __init__(self, directory: Path, rank: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self._file: IO[str] = (directory / f"rank{rank}-{os.getpid()}.jsonl").open(
            "a", buffering=1, encoding="utf-8"
        )

    @classmethod
    def from_env(cls, env: Mapping[str, str], rank: int) -> Audit | None:
        directory = env.get(DDPJOB_TRAIN_AUDIT)
        return None if not directory else cls(Path(directory), rank)

    def restored(self, step: int, world: int, checksum: int) -> None:
        self._write({"restore": step, "rank": self.rank, "world": world, "sum": checksum})

    def committed(
        self,
        step: int,
        world: int,
        before: tuple[int, int],
        after: tuple[int, int],
        batches: list[tuple[int, list[int]]] | None,
    ) -> None:
        self._write(
            {"step": step, "rank": self.rank, "world": world, "from": before, "to": after,
             "batches": batches or []}
        )  # fmt: skip

    def _write(self, line: dict[str, Any]) -> None:
        line["t"] = time.time()
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")


def read(directory: Path) -> list[dict[str, Any]]:
    """Every line of every audit file in ``directory``."""
    lines: list[dict[str, Any]] = []
    for path in sorted(directory.glob("rank*.jsonl")):
        for text in path.read_text(encoding="utf-8").splitlines():
            if text.strip():
                lines.append(json.loads(text))
    return lines


class Lineage:
    """What :func:`check` found: the steps the job kept, its restores, what went wrong."""

    def __init__(self) -> None:
        self.steps = 0
        self.restores: list[tuple[int, int]] = []
        """Each restore's step and world."""
        self.lost: list[int] = []
        """Each restore's lost steps: the newest step any rank had committed before it, less
        the step it resumed from (0 for the first start)."""
        self.end: list[int] = [0, 0]
        """The sampler's committed position after the last kept step: [epoch, processed]."""
        self.problems: list[str] = []


def check(lines: Iterable[Mapping[str, Any]], size: int) -> Lineage:
    """Check an audit (the lines of every process, in any order): the ranks of each restore
    agree on the model; the steps the job kept (a restore at step r drops the commits past r
    made before it: a lineage the job abandoned) follow each other, each step's position
    starting where the one before it ended, from the start, so that no sample of an epoch's
    order is skipped or trained twice; and no index is in two kept batches of one epoch."""
    found = Lineage()
    sums: dict[tuple[int, int], set[int]] = collections.defaultdict(set)
    kept: dict[int, dict[int, Mapping[str, Any]]] = {}
    event = -1  # the restore under way: its ranks' lines, until a step is committed
    newest = 0
    for line in sorted(lines, key=lambda line: float(line["t"])):
        if "restore" in line:
            step, world = int(line["restore"]), int(line["world"])
            if event < 0 or found.restores[event] != (step, world):
                found.restores.append((step, world))
                found.lost.append(max(0, newest - step))
                event = len(found.restores) - 1
            for later in [s for s in kept if s > step]:
                del kept[later]
            sums[(event, world)].add(int(line["sum"]))
        else:
            event = -1
            newest = max(newest, int(line["step"]))
            kept.setdefault(int(line["step"]), {})[int(line["rank"])] = line
    for (event, world), seen in sums.items():
        if len(seen) != 1:
            step = found.restores[event][0]
            found.problems.append(f"the restore at step {step} (world {world}): {len(seen)} models")
    found.steps = max(kept, default=0)
    position = [0, 0]
    per_epoch: dict[int, collections.Counter[int]] = collections.defaultdict(collections.Counter)
    for step in range(1, found.steps + 1):
        ranks = kept.get(step)
        if not ranks:
            found.problems.append(f"step {step}: no rank's commit in the audit")
            continue
        for rank, line in sorted(ranks.items()):
            if list(line["from"]) != position:
                found.problems.append(
                    f"step {step} rank {rank}: starts at {line['from']}, the step before ended "
                    f"at {position}"
                )
            for epoch, indices in line["batches"]:
                if any(not 0 <= i < size for i in indices):
                    found.problems.append(f"step {step} rank {rank}: an index outside {size}")
                per_epoch[int(epoch)].update(indices)
        position = list(next(iter(ranks.values()))["to"])
    found.end = position
    for epoch, counts in sorted(per_epoch.items()):
        twice = sorted(i for i, n in counts.items() if n > 1)
        if twice:
            found.problems.append(f"epoch {epoch}: {len(twice)} samples twice, e.g. {twice[:5]}")
    return found
