"""Benchmark: one job of N hollow agents (``tests.harness.hollow_agents``): rounds, losses and what
membership costs, for ddpjob-agent and for stock torch (the anchor), in the same run.

Each process hosts agents on loopback addresses of their own (127.2.x.y); agent 0, which hosts
the job's store, has a process of its own, as do its successor (agent 1) when the host is lost
and each agent a fault hits alone, and the 64 of a "node" share one. The workers are
stand-ins (no processes, no torch), so what is measured is the agents' own control path: the
c10d rendezvous through the real TCPStore, the peer watch, failover and fencing.
Scenarios (each run starts a fresh job):

* ``first``: all processes started within about a second -> one round of all N;
* ``loud``: SIGKILL one agent -> all survivors in one round of N-1;
* ``silent``: SIGSTOP one agent -> a round of N-1;
* ``host-loud`` / ``host-silent``: the same on the store's host (agent 0);
* ``node``: SIGSTOP a process of 64 agents -> a round of N-64, and how many rounds it took;
* ``stalls``: for ``--soak`` seconds, every 30 s one random agent (the host among them) is
  frozen for 1 s; the count of rounds after the first must stay 0.

Every run also measures the steady state for ``--steady`` seconds after the first round: TCP
segments (sent and received, ACKs included: an upper bound on messages) and new connections
per agent per second, machine-wide (this box runs nothing else of ours meanwhile), the CPU of
the store host's process and of all agents, and the box's own CPU and the agents' scheduling
lag (a result counts only if the box was not saturated).

Each process runs in a CPU cgroup of equal weight (``--no-cpu-groups`` to share the box among
threads instead): a pod has one, and on 2 cores shared thread by thread, the process of the
store host's one agent got a 200th of the box while a thousand agents restarted.

Usage: ``python bench/bench_membership.py --agents 64 [--mode ddpjob --mode torch]
[--scenario loud ...] [--runs 5] [--json out.json]``. Prints a table and, with ``--json``,
writes every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tests.harness.hollow_agents
from tests.harness.hollow_agents import NODE_SIZE, SWITCH_INTERVAL_ENV, Job  # noqa: E402

CAP_SECONDS = 120.0
SETTLE_SECONDS = 3.0
SCENARIOS = ("first", "loud", "silent", "host-loud", "host-silent", "node", "stalls")


# -- steady-state figures ---------------------------------------------------------------------


def tcp_counters(pid: int | str = "self") -> dict[str, int]:
    """TCP's counters of the network namespace ``pid`` is in."""
    lines = Path(f"/proc/{pid}/net/snmp").read_text().splitlines()
    heads = next(line for line in lines if line.startswith("Tcp:")).split()[1:]
    values = [line for line in lines if line.startswith("Tcp:")][1].split()[1:]
    return dict(zip(heads, map(int, values), strict=True))


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def box_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole box."""
    fields = list(map(int, Path("/proc/stat").read_text().splitlines()[0].split()[1:]))
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def steady(job: Job, seconds: float) -> dict[str, float]:
    members = list(range(job.n))
    since, rounds0 = time.time(), job.rounds_after(members, 0.0)
    tcp0, box0 = tcp_counters(job.host.pid), box_busy()
    cpu0 = {proc.pid: cpu_seconds(proc.pid) for proc in job.procs}
    lag = Lagging()
    with lag.running():
        time.sleep(seconds)
    tcp1, box1 = tcp_counters(job.host.pid), box_busy()
    cpu1 = {proc.pid: cpu_seconds(proc.pid) for proc in job.procs}
    n = job.n
    host = (cpu1[job.host.pid] - cpu0[job.host.pid]) / seconds
    everyone = sum(cpu1[pid] - cpu0[pid] for pid in cpu0) / seconds
    return {
        "segments_per_agent_s": 2 * (tcp1["OutSegs"] - tcp0["OutSegs"]) / n / seconds,
        "connects_per_agent_min": (tcp1["ActiveOpens"] - tcp0["ActiveOpens"]) / n / seconds * 60,
        "host_cpu_cores": host,
        "agents_cpu_cores": everyone,
        "box_cpu_busy": (box1[0] - box0[0]) / max(1, box1[1] - box0[1]),
        "driver_lag_p99_ms": lag.p99() * 1000,
        # Nothing happened: a round change here is a bug (the figures above then include it).
        "steady_round_changes": len(job.rounds_after(members, since) - rounds0),
    }


class Lagging:
    """How late a 50 ms sleep wakes up in this process: the box's scheduling lag."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._stop = threading.Event()

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        thread = threading.Thread(target=self._run, daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._stop.set()
            thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            time.sleep(0.05)
            self.lags.append(max(0.0, time.monotonic() - start - 0.05))

    def p99(self) -> float:
        if not self.lags:
            return 0.0
        ordered = sorted(self.lags)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


# -- one run -----------------------------------------------------------------------------------


def run_once(
    mode: str, scenario: str, agents: int, args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    rng = random.Random(args.seed)
    victim = agents - 1
    singles: list[int] = []
    node: list[int] = []
    if scenario in ("loud", "silent"):
        singles = [victim]
    elif scenario == "stalls":
        singles = sorted(rng.sample(range(1, agents), min(4, agents - 1)))
    elif scenario == "node":
        node = list(range(agents - NODE_SIZE, agents))
    elif scenario in ("host-loud", "host-silent") and agents > 1:
        # The host's successor, who hosts the next generation, is one pod like the host:
        # a process of its own, not a 64th of one whose agents all fail over with it.
        singles = [1]
    log_dir = root / f"{mode}-{scenario}-{agents}-{time.monotonic_ns()}"
    log_dir.mkdir(parents=True)
    job = Job(
        "torch" if mode == "torch" else "ddpjob",
        agents,
        per_process=args.per_process,
        singles=singles,
        node=node,
        log_dir=log_dir,
        code=args.baseline if mode == "baseline" else None,
        cpu_groups=args.cpu_groups,
        host_weight=args.host_weight,
    )
    result: dict[str, Any] = {"mode": mode, "scenario": scenario, "agents": agents}
    result["cpu_groups"] = job.shares is not None and job.shares.on
    result["host_weight"] = args.host_weight
    result["lone_successor"] = singles == [1] and scenario.startswith("host")
    if args.switch_interval is not None:
        result["switch_interval"] = args.switch_interval
    try:
        everyone = list(range(agents))
        first = job.wait(everyone, agents, 0.0, args.cap)
        if first is None:
            result["outcome"] = "timeout (first round)"
            return result
        # From the moment the last process had started all its agents (torch imported).
        result["first_round_s"] = first[0] - max(job.started_at.values())
        result["start_spread_s"] = max(job.started_at.values()) - min(job.started_at.values())
        time.sleep(SETTLE_SECONDS)
        result.update(steady(job, args.steady))
        if scenario == "first":
            result["outcome"] = "ok"
            return result
        if scenario == "stalls":
            return soak(job, result, args, rng)
        lost = {
            "loud": [victim],
            "silent": [victim],
            "host-loud": [0],
            "host-silent": [0],
            "node": node,
        }[scenario]
        sig = signal.SIGKILL if scenario.endswith("loud") else signal.SIGSTOP
        survivors = [i for i in everyone if i not in lost]
        before = job.rounds_after(survivors, 0.0)
        at = time.time()
        job.signal(job.proc_of(lost[0]), sig)
        found = job.wait(survivors, agents - len(lost), at, args.cap)
        if found is None:
            result["outcome"] = "timeout"
            return result
        result["recovery_s"] = found[0] - at
        result["round_changes"] = len(job.rounds_after(survivors, at) - before)
        result["outcome"] = "ok"
        return result
    finally:
        result["exits"] = {str(i): e for i, e in job.exits.items() if e}
        job.close()


def soak(
    job: Job, result: dict[str, Any], args: argparse.Namespace, rng: random.Random
) -> dict[str, Any]:
    everyone = list(range(job.n))
    start = time.time()
    before = job.rounds_after(everyone, 0.0)
    stalls = 0
    candidates = [proc for proc in job.procs if len(proc.agents) == 1]
    while time.time() - start < args.soak:
        time.sleep(min(30.0, max(0.0, args.soak - (time.time() - start))))
        if time.time() - start >= args.soak:
            break
        proc = rng.choice(candidates)
        job.signal(proc, signal.SIGSTOP)
        time.sleep(1.0)
        job.signal(proc, signal.SIGCONT)
        stalls += 1
    time.sleep(5.0)
    result["stalls"] = stalls
    result["false_cuts"] = len(job.rounds_after(everyone, start) - before)
    result["outcome"] = "ok"
    return result


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered):.2f} [{ordered[-1]:.2f}]"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--agents", type=int, action="append", required=True)
    parser.add_argument(
        "--mode",
        action="append",
        choices=("ddpjob", "torch", "baseline"),
        help="ddpjob: this checkout's agent; torch: stock torch; baseline: the agent of the "
        "checkout --baseline names (say, the previous version); default: ddpjob and torch",
    )
    parser.add_argument("--baseline", type=Path, help="a checkout for --mode baseline")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--per-process", type=int, default=NODE_SIZE)
    parser.add_argument("--steady", type=float, default=10.0)
    parser.add_argument("--soak", type=float, default=600.0)
    parser.add_argument("--cap", type=float, default=CAP_SECONDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="the GIL switch interval of every hollow process, in seconds (default: Python's)",
    )
    parser.add_argument(
        "--cpu-groups",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each hollow process in a CPU cgroup of equal weight, as each pod has one "
        "(default: on, where the machine lets us; the result says whether it did)",
    )
    parser.add_argument(
        "--host-weight",
        type=int,
        default=1,
        help="the CPU groups of the store's host and of its successor weigh this many times "
        "another process's (default 1: equal). A diagnostic: on a cluster the host is a pod "
        "with a node's CPU, here a share of 2 cores among all the hollow processes",
    )
    args = parser.parse_args(argv)
    if not 1 <= args.host_weight <= 100:
        parser.error(
            "--host-weight must be between 1 and 100 (cgroup v2's cpu.weight tops at 10,000)"
        )
    if args.switch_interval is not None:
        os.environ[SWITCH_INTERVAL_ENV] = str(args.switch_interval)  # the processes inherit it
    results: list[dict[str, Any]] = []
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-membership-{uuid.uuid4().hex[:8]}"
    for agents in args.agents:
        for scenario in args.scenario or [
            "first",
            "loud",
            "silent",
            "host-loud",
            "host-silent",
            "node",
        ]:
            if scenario == "node" and agents <= NODE_SIZE + 8:
                continue
            for run in range(args.runs):
                for mode in (
                    (args.mode or ["ddpjob", "torch"])
                    if run % 2 == 0
                    else (args.mode or ["ddpjob", "torch"])[::-1]
                ):
                    result = run_once(mode, scenario, agents, args, root)
                    results.append(result)
                    print(json.dumps(result), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


COLUMNS = (
    ("first round s", "first_round_s"),
    ("recovery s", "recovery_s"),
    ("round changes", "round_changes"),
    ("steady round changes", "steady_round_changes"),
    ("segments/agent/s", "segments_per_agent_s"),
    ("connects/agent/min", "connects_per_agent_min"),
    ("host CPU", "host_cpu_cores"),
    ("agents CPU", "agents_cpu_cores"),
    ("box busy", "box_cpu_busy"),
    ("lag p99 ms", "driver_lag_p99_ms"),
)
"""The table's columns: a heading, and the result's key (median [worst])."""


def print_table(results: list[dict[str, Any]]) -> None:
    keys = sorted({(r["agents"], r["scenario"], r["mode"]) for r in results})
    print("\n| N | scenario | mode | ok/runs | " + " | ".join(h for h, _ in COLUMNS) + " |")
    print("|---" * (4 + len(COLUMNS)) + "|")
    for agents, scenario, mode in keys:
        rows = [
            r
            for r in results
            if (r["agents"], r["scenario"], r["mode"]) == (agents, scenario, mode)
        ]
        ok = [r for r in rows if r.get("outcome") == "ok"]
        cells = [summary([r[key] for r in ok if key in r]) for _, key in COLUMNS]
        print(
            f"| {agents} | {scenario} | {mode} | {len(ok)}/{len(rows)} | "
            + " | ".join(cells)
            + " |"
        )


if __name__ == "__main__":
    sys.exit(main())
