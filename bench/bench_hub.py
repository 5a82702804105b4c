"""Benchmark: what the membership hub costs per member, this checkout against another.

The hub (``ddpjob_worker.membership.hub``) runs alone in a process of its own, as on the store
host's pod; N members that speak its wire protocol (hello, join, then a heartbeat every
``HEARTBEAT_SECONDS``, reading every answer) all run on one event loop in this driver, so the hub's
process holds nothing but the hub. Once the round of N has formed, the hub process's CPU time is
read over ``--seconds``: cores used, and microseconds per message in (heartbeats, and the acks they
cause). The same members then do the same against ``--baseline``'s hub, in the same run, alternated
run by run, and the table gives the ratio.

Usage: ``python bench/bench_hub.py --members 1024 [--baseline /path/to/checkout] [--runs 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def serve(members: int) -> None:
    """The hub's process: a hub for ``members``, its address on stdout, until stdin closes."""
    from ddpjob_worker.membership.hub import Hub  # noqa: PLC0415 - the checkout PYTHONPATH names
    from ddpjob_worker.membership.seal import Seal  # noqa: PLC0415
    from ddpjob_worker.membership.wire import Wire  # noqa: PLC0415

    run_id, key = sys.stdin.readline().split()

    async def main() -> None:
        hub = Hub(
            Wire(Seal(key.encode()), run_id),
            gen=1,
            min_nodes=members,
            max_nodes=members,
            last_call=1.0,
        )
        address = await hub.start(HOST)
        print(address, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        print(json.dumps({"received": hub.received, "sent": hub.sent}), flush=True)

    asyncio.run(main())


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def members_run(
    address: str, wire: Any, members: int, heartbeat: float, seconds: float, pid: int
) -> dict[str, float]:
    """Connect ``members``, join, wait for the round, then beat for ``seconds``."""
    host, _, port = address.rpartition(":")
    formed = asyncio.Event()
    rounds = 0
    sent = 0

    async def member(k: int) -> None:
        nonlocal rounds, sent
        reader, writer = await asyncio.open_connection(host, int(port), limit=1 << 20)
        ident = f"m{k}"
        hello = {"t": "hello", "ident": ident, "index": k, "liveness": None, "fresh": True}
        writer.write(wire.encode(hello) + wire.encode({"t": "join"}))

        async def read() -> None:
            nonlocal rounds
            while line := await reader.readline():
                message = wire.decode(line)
                if message is not None and message["t"] == "round":
                    rounds += 1
                    if rounds == members:
                        formed.set()

        reading = asyncio.get_running_loop().create_task(read())
        seq = 0
        await asyncio.sleep(heartbeat * (k % 100) / 100)  # spread, as real members are
        while not reading.done():
            seq += 1
            writer.write(wire.encode({"t": "hb", "seq": seq}))
            sent += 1
            await asyncio.sleep(heartbeat)

    tasks = []
    for k in range(members):
        tasks.append(asyncio.get_running_loop().create_task(member(k)))
        if k % 64 == 63:
            await asyncio.sleep(0.01)
    await asyncio.wait_for(formed.wait(), 120)
    await asyncio.sleep(2.0)  # the round's messages are through
    cpu0, sent0, t0 = cpu_seconds(pid), sent, time.monotonic()
    await asyncio.sleep(seconds)
    cpu1, sent1, t1 = cpu_seconds(pid), sent, time.monotonic()
    for task in tasks:
        task.cancel()
    cores = (cpu1 - cpu0) / (t1 - t0)
    messages = (sent1 - sent0) / (t1 - t0)
    return {
        "hub_cores": round(cores, 4),
        "heartbeats_per_s": round(messages, 1),
        "us_per_heartbeat": round(cores / messages * 1e6, 2) if messages else 0.0,
    }


def run_once(code: Path, members: int, seconds: float) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "worker"))
    from ddpjob_worker.membership.hub import HEARTBEAT_SECONDS  # noqa: PLC0415
    from ddpjob_worker.membership.seal import Seal  # noqa: PLC0415
    from ddpjob_worker.membership.wire import Wire  # noqa: PLC0415

    run_id, key = uuid.uuid4().hex, uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": str(code / "worker")}
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--serve", str(members)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdin is not None
    assert proc.stdout is not None
    try:
        proc.stdin.write(f"{run_id} {key}\n")
        proc.stdin.flush()
        address = proc.stdout.readline().strip()
        wire = Wire(Seal(key.encode()), run_id)
        result = asyncio.run(
            members_run(address, wire, members, HEARTBEAT_SECONDS, seconds, proc.pid)
        )
        proc.stdin.close()
        counts = json.loads(proc.stdout.readline() or "{}")
        return {"code": str(code), "members": members, **result, **counts}
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout, to compare")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve)
        return 0
    codes = [REPO, *([args.baseline.resolve()] if args.baseline else [])]
    results: list[dict[str, Any]] = []
    for run in range(args.runs):
        for code in codes if run % 2 == 0 else codes[::-1]:
            result = run_once(code, args.members, args.seconds)
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\n| checkout | members | hub cores | us per heartbeat | ratio to {codes[0].name} |")
    print("|---|---|---|---|---|")
    ours = statistics.median(r["us_per_heartbeat"] for r in results if r["code"] == str(REPO))
    for code in codes:
        rows = [r for r in results if r["code"] == str(code)]
        cores = statistics.median(r["hub_cores"] for r in rows)
        us = statistics.median(r["us_per_heartbeat"] for r in rows)
        print(f"| {code} | {args.members} | {cores:.3f} | {us:.1f} | {us / ours:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
