"""Benchmark: steps lost per failure, with the training-state API against checkpoints on disk.

Each run starts a job of 3 local agents (``tests.harness.agents``: real agents, real workers, gloo),
lets it train, injects one fault at a random point of a step once every rank is past step
``--fault-after``, and lets the survivors finish. Steps lost = the newest step any rank had
committed before the fault, less the step the job resumed at (a step redone counts as lost).

* ``ddpjob``: ``ddpjob-agent`` running ``tests/harness/snap_train.py`` on
  ``ddpjob_worker.train`` (snapshots in memory at the learned cadence, which for this
  model's 0.1 s steps is every step, and the committed step written at a stop; the restore
  from the survivors; hang detection).
* ``ddpjob-ckpt``: ``ddpjob-agent`` running ``examples/train.py`` with a checkpoint on disk
  every ``--ckpt-every`` steps: ddpjob as it was before the training-state API (a baseline).
* ``torchrun``: stock torchrun running the same, the other baseline.

``ddpjob`` first runs the job once without a fault (the reference: the checksum of its model
and optimizer state at each step), and checks after every run that its ranks ended with the
same model checksum; that every state a worker resumed with, at a step the job had reached
before the fault, is the reference's at that step (not for ``grow``, whose job starts with two
pods); and, after the faults that leave the world size as it was (``worker``, ``copy``,
``two``, ``hang``), that the final model is the reference's, bit for bit: nothing lost,
nothing done twice or differently.

That last check needs the script's DDP to be built with ``find_unused_parameters=True``
(``snap_train.py --find-unused``, which this benchmark passes): by default DDP rebuilds its
gradient buckets after its first iteration, so a new process's first step (a restart's, ours
or a checkpoint's) sums each gradient's three ranks in another order than the steps after it,
and floating-point sums of three depend on their order. Measured with a plain save and load of
a model and its Adam state into a new DDP (no ddpjob, 20 steps, a restart at step 3, 6 or 9):
at one and two ranks the final bits always equal the run's without a restart; at three they
differ at each restart point, and equal it with ``find_unused_parameters=True`` (no rebuild) or
when the state is loaded into the same DDP.

For each run it also measures **training again**: the seconds from the fault (for ``hang``,
from when the worker hung) until a worker started after it commits a step.

Faults: ``worker`` (one worker SIGKILLed), ``pod`` (a pod's agent and worker SIGKILLed),
``freeze`` (a pod SIGSTOPped whole), ``copy`` (a worker SIGKILLed while it writes its
snapshot: ddpjob only, seen in its progress record), ``two`` (two pods' workers SIGKILLed in
one step), ``grow`` (a third pod joins a job of two), ``rejoin`` (a pod frozen as in
``freeze``, then thawed once the others train again: it comes back and joins, the story of
issue 36's minGPT run), ``hang`` (a worker deadlocks before its
backward: ddpjob only, where hang detection ends the round; torchrun would wait for gloo's 30
min).

The agents keep their warm spare workers, as they do by default (``--cold`` turns them off:
every restart then imports torch, about 4 s here with three workers on two cores). Their
spares start 3 s into each group and import at the idle policy, which with three pods on two
cores takes a few seconds more: a fault in a job's first seconds finds none ready (in
``ddpjob`` and ``ddpjob-ckpt`` alike), hence ``--fault-after 40`` (about 9 s in). The fault
comes after step ``--fault-after`` plus a random 0 to ``--ckpt-every`` - 1 steps, so that the
baselines' checkpoints are as old as they would be at a random time.

``--background on`` makes ddpjob's workers copy their parameters and optimizer state on the
snapshot's background thread (the toy model is otherwise small enough to be written whole at
the commit), so that the faults land on the overlapped copy too.

Usage: ``python bench/bench_zero_loss.py --runs 10 [--fault worker ...] [--background on]
[--json out.json]``;
prints a table (median and worst steps lost per fault and mode, the seconds to training again
and to the job's end).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from ddpjob_worker.progress import Phase, path_for, read  # noqa: E402
from tests.harness.agents import TRAIN, Cluster, Node  # noqa: E402

SNAP = REPO / "tests" / "harness" / "snap_train.py"
FAULTS = ("worker", "pod", "freeze", "copy", "two", "grow", "rejoin", "hang")
ONLY_DDPJOB = {"copy", "hang"}
NO_REFERENCE = {"grow"}
"""Faults whose job is not the reference's until the fault (it starts with two pods)."""
SAME_WORLD = {"worker", "copy", "two", "hang"}
"""Faults after which the job trains on at the world size it had: its ranks' final checksums
must equal the reference's."""
MODES = ("ddpjob", "ddpjob-ckpt", "torchrun")
STEP_SLEEP = 0.1
REJOIN_EXTRA_STEPS = 100
"""``rejoin`` trains longer: the thawed pod must come back before the job ends."""
CAP_SECONDS = 240.0


def snap_records(text: str, kind: str) -> list[dict[str, str]]:
    pattern = rf"SNAP {kind}((?: \w+=[^\s]+)+)"
    return [
        dict(item.split("=", 1) for item in m.group(1).split()) for m in re.finditer(pattern, text)
    ]


STEP_LINE = re.compile(r"^DDPJOB step=(\d+) rank=(\d+)", re.MULTILINE)
RESUME_LINE = re.compile(r"^DDPJOB resume step=(\d+) rank=(\d+)", re.MULTILINE)


def committed(mode: str, text: str) -> list[int]:
    """The steps committed in a log, in order (as the count of steps done)."""
    if mode == "ddpjob":
        return [int(r["step"]) for r in snap_records(text, "committed")]
    return [int(m.group(1)) + 1 for m in STEP_LINE.finditer(text)]


def resumed(mode: str, text: str) -> list[int]:
    """The steps the log's workers resumed at, in order (the first: the job's start)."""
    if mode == "ddpjob":
        return [int(r["step"]) for r in snap_records(text, "resumed")]
    return [int(m.group(1)) for m in RESUME_LINE.finditer(text)]


def resume_mark(mode: str) -> str:
    return "SNAP resumed" if mode == "ddpjob" else "DDPJOB resume"


def trained_again(mode: str, text: str, resumes_before: int) -> bool:
    """A worker that started after the fault (a resume record beyond ``resumes_before``) has
    committed a step."""
    parts = text.split(resume_mark(mode))
    return len(parts) - 1 > resumes_before and bool(committed(mode, parts[-1]))


def wait(what: str, check: Any, cap: float, poll: float = 0.02) -> None:
    deadline = time.monotonic() + cap
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(poll)
    raise TimeoutError(what)


def run_once(mode: str, fault: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"zero-{mode}-{fault}-", dir=args.tmp))
    cluster = Cluster(root, min_nodes=2, max_nodes=3)
    steps = args.steps + (REJOIN_EXTRA_STEPS if fault == "rejoin" else 0)
    # A step at random among the checkpoint interval's: right after a checkpoint the baselines
    # would lose nothing, right before it they lose the whole interval.
    after = args.fault_after + rng.randrange(args.ckpt_every)
    if mode == "ddpjob":
        script, train = SNAP, ["--steps", str(steps), "--step-sleep", str(STEP_SLEEP)]
        train += ["--find-unused"]  # bitwise comparable with the reference (see the doc)
        train += ["--background", args.background]
        if args.snapshot_every:
            train += ["--snapshot-every", str(args.snapshot_every)]
        if fault == "copy":
            train += ["--ballast-mb", "32"]  # a copy long enough to be caught in
        if fault == "hang":
            train += ["--hang-at", str(after + 2), "--hang-rank", "2"]
            train += ["--hang-marker", str(root / "hung-once")]
    else:  # ddpjob-ckpt, torchrun
        script = TRAIN
        train = ["--steps", str(steps), "--step-sleep", str(STEP_SLEEP)]
        train += ["--ckpt-every", str(args.ckpt_every)]
    env = {"DDPJOB_WARM_WORKERS": "0"} if args.cold else {}
    start = 2 if fault == "grow" else 3
    nodes: list[Node] = [
        cluster.start(i, train, stock=mode == "torchrun", env=env, script=script)
        for i in range(start)
    ]
    result: dict[str, Any] = {"mode": mode, "fault": fault}
    try:
        wait(
            "every rank past the fault step",
            lambda: all(max(committed(mode, n.text()), default=0) >= after for n in nodes),
            CAP_SECONDS,
        )
        if fault != "hang":
            time.sleep(rng.uniform(0.0, STEP_SLEEP * 1.5))  # a random point of a step
        old = list(nodes)  # the nodes of the job the fault hit
        resumes = {n.index: n.text().count(resume_mark(mode)) for n in old}
        at = time.monotonic()
        inject(fault, mode, cluster, nodes, train, env, script)
        if fault == "hang":
            at = time.monotonic()  # inject returned once the worker hung
        survivors = [n for n in nodes if fault not in ("pod", "freeze") or n.index != 2]
        if fault == "rejoin":
            survivors = [n for n in nodes if n.index != 2]  # until it is thawed
        with contextlib.suppress(TimeoutError):
            if fault == "none":
                raise TimeoutError  # nothing to recover from
            wait(
                "training again",
                lambda: any(
                    trained_again(mode, n.text(), resumes.get(n.index, 0)) for n in survivors
                ),
                CAP_SECONDS,
            )
            result["again_s"] = round(time.monotonic() - at, 2)
        if fault == "rejoin":
            marks = rejoin(mode, nodes, result)
            survivors = nodes
        for node in survivors:
            code = node.wait_exit(CAP_SECONDS)
            if code != 0:
                result["outcome"] = f"node {node.index} exited {code}"
                return result
        result["to_end_s"] = round(time.monotonic() - at, 2)
        # Before: the newest step any of the job's first workers committed. After: the step
        # the next workers resumed at (the earliest, when there were several restarts).
        before = max(max(committed(mode, first_gen(mode, n.text())), default=0) for n in old)
        after = [r for n in survivors for r in resumed(mode, n.text())[1:]]
        after += [r for n in nodes if n not in old for r in resumed(mode, n.text())]
        resume = min(after, default=0)
        result.update(before=before, resume=resume, lost=max(0, before - resume))
        if fault == "rejoin":
            rejoined = rejoin_loss(mode, nodes, marks)
            result.update(rejoined)
            result["lost"] = max(result["lost"], rejoined["rejoin_lost"])
        done = [max(committed(mode, n.text()), default=0) for n in survivors]
        result["outcome"] = "ok" if all(d >= steps for d in done) else "unfinished"
        if mode == "ddpjob":
            # The states workers resumed with at a step the job had before the fault (one
            # more than the newest logged: a worker killed between its commit and its log).
            result["resumed_states"] = [
                (int(r["step"]), r["sum"])
                for n in nodes
                for r in snap_records(n.text(), "resumed")
                if 0 < int(r["step"]) <= before + 1
            ]
            if fault == "none":
                records = snap_records(nodes[0].text(), "committed")
                result["states"] = {int(r["step"]): r["sum"] for r in records}
            done_sums = {r["sum"] for n in survivors for r in snap_records(n.text(), "done")}
            result["sums"] = sorted(done_sums)
        return result
    except TimeoutError as exc:
        result["outcome"] = f"timeout: {exc}"
        return result
    finally:
        cluster.kill_all()


def rejoin(mode: str, nodes: list[Node], result: dict[str, Any]) -> dict[int, int]:
    """Thaw the frozen pod (the others train without it again) and wait until it has
    committed a step in a round it rejoined; ``rejoin_again_s``: from the thaw to that step.
    The length of each node's log at the thaw: what came after it is the rejoin's."""
    marks = {n.index: len(n.text()) for n in nodes}
    thawed = time.monotonic()
    nodes[2].thaw()
    with contextlib.suppress(TimeoutError):
        wait(
            "the thawed pod training in a round it rejoined",
            lambda: trained_again(mode, nodes[2].text()[marks[2] :], 0),
            CAP_SECONDS,
        )
        result["rejoin_again_s"] = round(time.monotonic() - thawed, 2)
    return marks


def rejoin_loss(mode: str, nodes: list[Node], marks: dict[int, int]) -> dict[str, int]:
    """Steps lost to the rejoin: the newest step any worker committed before the first
    restart after the thaw, less the lowest step any worker resumed at after it."""
    before, resumes = 0, []
    for node in nodes:
        text = node.text()
        restart = text.find(resume_mark(mode), marks[node.index])
        before = max(before, *committed(mode, text if restart < 0 else text[:restart]), 0)
        resumes += resumed(mode, text[marks[node.index] :])
    resume = min(resumes, default=0)
    return {
        "rejoin_before": before,
        "rejoin_resume": resume,
        "rejoin_lost": max(0, before - resume),
    }


def first_gen(mode: str, text: str) -> str:
    """A node's log up to its second worker's start: its first worker's lines."""
    mark = "SNAP start" if mode == "ddpjob" else "DDPJOB resume"
    return mark.join(text.split(mark)[:2])


def inject(
    fault: str,
    mode: str,
    cluster: Cluster,
    nodes: list[Node],
    train: list[str],
    env: dict[str, str],
    script: Path,
) -> None:
    if fault == "worker":
        _kill_workers(nodes[1])
    elif fault == "pod":
        nodes[2].kill_node()
    elif fault in ("freeze", "rejoin"):
        nodes[2].freeze()
    elif fault == "two":
        _kill_workers(nodes[1])
        _kill_workers(nodes[2])
    elif fault == "grow":
        nodes.append(cluster.start(2, train, stock=mode == "torchrun", env=env, script=script))
    elif fault == "copy":
        directory = Path(snap_records(nodes[1].text(), "start")[0]["dir"])
        record = path_for(directory, 0)
        wait(
            "node 1's worker writing its snapshot",
            lambda: (r := read(record)) is not None and r.phase is Phase.SNAPSHOT,
            30,
            poll=0.001,
        )
        _kill_workers(nodes[1])
    elif fault == "hang":
        wait("rank 2 hanging", lambda: "SNAP hanging" in nodes[2].text(), CAP_SECONDS)
    elif fault != "none":
        raise ValueError(fault)


def _kill_workers(node: Node) -> None:
    for pid in node.worker_pids():
        os.kill(pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--fault", action="append", choices=FAULTS)
    parser.add_argument("--mode", action="append", choices=MODES)
    parser.add_argument("--steps", type=int, default=70)
    parser.add_argument("--fault-after", type=int, default=40)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--background", choices=("auto", "on", "off"), default="auto")
    parser.add_argument(
        "--snapshot-every",
        type=int,
        help="ddpjob's periodic snapshots every N steps (default: learned, every step for this "
        "model's 0.1 s steps); 1000: only the write at the stop keeps the steps since the first",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="turn the agents' warm spare workers off (DDPJOB_WARM_WORKERS=0)",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--tmp", default=os.environ.get("TMPDIR", "/tmp"))
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    results: list[dict[str, Any]] = []
    modes = args.mode or list(MODES)
    reference: dict[int, str] = {}
    final: list[str] = []
    if "ddpjob" in modes and set(args.fault or FAULTS) - NO_REFERENCE:
        first = run_once("ddpjob", "none", args, rng)
        print(json.dumps(first), file=sys.stderr, flush=True)
        reference, final = first.get("states", {}), first.get("sums", [])
        if first.get("outcome") != "ok" or len(final) != 1:
            print(f"the reference run without faults failed: {first}", file=sys.stderr)
            return 1
    for fault in args.fault or FAULTS:
        for run in range(args.runs):
            for mode in modes if run % 2 == 0 else modes[::-1]:
                if mode != "ddpjob" and fault in ONLY_DDPJOB:
                    continue
                result = run_once(mode, fault, args, rng)
                if "sums" in result:
                    result["same"] = len(result["sums"]) == 1
                    if fault not in NO_REFERENCE:
                        states = result["resumed_states"]
                        result["resumed_as_reference"] = bool(states) and all(
                            reference.get(step) == crc for step, crc in states
                        )
                    if fault in SAME_WORLD:
                        result["as_reference"] = result["sums"] == final
                results.append(result)
                print(json.dumps(result), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(
        "\n| fault | mode | ok/runs | steps lost, median [worst] | training again s, median "
        "[worst] | to the job's end s | ranks' final checksums equal | resumed states equal to the "
        "run without faults' | final model equal to it |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for fault in args.fault or FAULTS:
        for mode in modes:
            rows = [r for r in results if (r["fault"], r["mode"]) == (fault, mode)]
            if not rows:
                continue
            ok = [r for r in rows if r.get("outcome") == "ok"]
            lost = [r["lost"] for r in ok]
            secs = [r["to_end_s"] for r in ok]
            again = [r["again_s"] for r in ok if "again_s" in r]
            shown = _stat(lost)
            back = f"{statistics.median(again):.2f} [{max(again):.2f}]" if again else "-"
            took = f"{statistics.median(secs):.1f}" if secs else "-"
            same = _count(ok, "same")
            resumed_ref = _count(ok, "resumed_as_reference")
            as_ref = _count(ok, "as_reference")
            print(
                f"| {fault} | {mode} | {len(ok)}/{len(rows)} | {shown} | {back} | {took} "
                f"| {same} | {resumed_ref} | {as_ref} |"
            )
            rejoined = [r["rejoin_again_s"] for r in ok if "rejoin_again_s" in r]
            if rejoined:
                print(
                    f"| (rejoin) | {mode} | {len(rejoined)}/{len(rows)} thawed pods trained "
                    f"again | {_stat(r['rejoin_lost'] for r in ok)} | "
                    f"{statistics.median(rejoined):.2f} [{max(rejoined):.2f}] after the thaw "
                    "| | | | |"
                )
    return 0


def _stat(values: Any) -> str:
    seen = list(values)
    return f"{statistics.median(seen):g} [{max(seen)}]" if seen else "-"


def _count(rows: list[dict[str, Any]], key: str) -> str:
    """``k/n`` of the rows whose ``key`` is true, of those that have it; ``-``: none has."""
    have = [r[key] for r in rows if key in r]
    return f"{sum(have)}/{len(have)}" if have else "-"


if __name__ == "__main__":
    sys.exit(main())
