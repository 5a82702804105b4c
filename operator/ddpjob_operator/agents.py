"""What the pods' agents say of themselves: the operator's view past the API server.

The API server only knows what kubelets report. A node that froze or lost its network keeps its
pods ``Running`` and ``Ready`` until the node controller gives up on it (40 s and more), and a
pod whose workers wait in a rendezvous is still ready for a few seconds. Each ddpjob-agent
answers every connection on the job's directory port (the rendezvous port + 1) with one JSON
line: its phase, the world it trains in (0 when it does not), and whether it hosts the store
(see ``ddpjob_worker.liveness``). With ``--ask-agents`` the operator asks every running pod at
each pass and while the job runs, so that ``status.worldSize`` is the world that trains now and
``status.storeHost`` names the pod that hosts the store.

The answers only ever lower what the API says: a pod whose agent answers that it does not train
is not ready, and when some agents answer and one does not, that one is not ready either (its
node is silent). When no agent answers at all (a NetworkPolicy of the user's, plain torchrun
pods, an operator outside the cluster network) the API's view stands unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

from ddpjob_operator.observe import ObservedPod

ASK_TIMEOUT_SECONDS = 0.5
"""How long one question waits for the answer line (a live agent answers in milliseconds)."""
ASK_EVERY_SECONDS = 2.0
"""How often a running job's agents are asked, with no event from the API server."""
_MAX_ANSWER = 4096


@dataclasses.dataclass(frozen=True)
class AgentAnswer:
    """One agent's words: its pod index, phase, world (0 unless it trains), and its store."""

    index: int
    phase: str
    world: int
    host: bool
    gen: int

    @property
    def training(self) -> bool:
        return self.phase == "running"


def parse_answer(line: bytes) -> AgentAnswer | None:
    """An answer line, or None when it is not one (an older agent, garbage)."""
    try:
        data: Any = json.loads(line)
    except ValueError:
        return None
    if not isinstance(data, Mapping) or "phase" not in data:
        return None
    try:
        return AgentAnswer(
            index=int(data["index"]),
            phase=str(data["phase"]),
            world=max(0, int(data.get("world") or 0)),
            host=data.get("host") is True,
            gen=int(data.get("gen") or 0),
        )
    except (KeyError, TypeError, ValueError):
        return None


async def ask(host: str, port: int, timeout: float = ASK_TIMEOUT_SECONDS) -> AgentAnswer | None:
    """Ask the agent at ``host:port``; None when it does not answer in time (or at all)."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                line = await reader.readuntil(b"\n")
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
    except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return None
    return parse_answer(line[:_MAX_ANSWER])


async def ask_pods(
    pods: Sequence[ObservedPod], port: int, timeout: float = ASK_TIMEOUT_SECONDS
) -> dict[str, AgentAnswer | None]:
    """Ask the agent of every live pod that has an address, all at once."""
    asked = [p for p in pods if p.live and p.ip and p.started]
    answers = await asyncio.gather(*(ask(str(p.ip), port, timeout) for p in asked))
    return {p.name: answer for p, answer in zip(asked, answers, strict=True)}


def apply(
    pods: Sequence[ObservedPod], answers: Mapping[str, AgentAnswer | None]
) -> tuple[ObservedPod, ...]:
    """``pods`` as their agents describe them (see the module doc). An answer from another
    pod index (an address that a new pod took over) counts as no answer."""
    index_of = {p.name: p.index for p in pods}
    valid = {
        name: answer
        for name, answer in answers.items()
        if answer is not None and index_of.get(name) == answer.index
    }
    if not valid:
        return tuple(pods)
    seen = []
    for pod in pods:
        if pod.name not in answers:
            seen.append(pod)
            continue
        answer = valid.get(pod.name)
        if answer is None:  # silent while its peers answer
            seen.append(dataclasses.replace(pod, ready=False, world_size=None))
            continue
        seen.append(
            dataclasses.replace(
                pod,
                ready=pod.ready and answer.training,
                world_size=answer.world,
                store_host=answer.host,
                store_gen=answer.gen,
            )
        )
    return tuple(seen)
