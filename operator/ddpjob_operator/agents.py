"""What the pods' agents say of themselves: the operator's view past the API server.

The API server only knows what kubelets report. A node that froze or lost its network keeps its pods
``Running`` and ``Ready`` until the node controller gives up on it (40 s and more), and a pod whose
workers wait in a rendezvous is still ready for a few seconds. Each ddpjob-agent answers every
connection on the job's directory port (the rendezvous port + 1) with one JSON line: its phase, the
world it trains in (0 when it does not), the rendezvous round, and whether it hosts the store (see
``ddpjob_worker.membership.advert``). With ``--ask-agents`` the operator asks the running pods at
its passes and every :data:`ASK_EVERY_SECONDS` while the job runs, so that ``status.worldSize`` is
the world that trains now and ``status.storeHost`` names the pod that hosts the store.

Each question is a new TCP connection, and a job may have a thousand pods: asking all of them
every 2 s was 512 connections a second and as many sockets at once, and a second of the
operator's CPU per pass. So the answers are kept (:class:`Survey`, one per job), and a pass asks
only as many pods as an operator-wide :class:`Budget` allows (:data:`MAX_ASKS_PER_SECOND`, a
burst of :data:`ASK_BURST`): first the pods never asked at their address, then the pod that
hosts the store, then those that did not answer their first question (asked once more
:data:`ASK_EVERY_SECONDS` later: an agent not listening yet, or slow on a loaded node, counted
as not ready for a whole sweep, and a 1,024-pod start ended in a status write 10 s later with
1,018 of 1,024 ready); once the store's host has fallen silent (or said it no longer hosts),
the :data:`SUCCESSORS` lowest-indexed pods that answer, at most once a second, until one says
it hosts (its successor is the lowest-ranked survivor, docs/concepts/store-failover.md: found as
soon as it takes over, not in its turn of the sweep), for :data:`KEEP_SECONDS` at most; then
the other pods of a node where a pod fell silent (pods of a node are lost together: a node of
64 is found in a pass or two, not one pod after another over the sweep, each a change of the
job's counts); then those asked longest ago. A job of up to 64
pods is asked whole every 2 s, as before; a job of 1,024 pods is swept in about 26 s, and its
new pods and its store host are asked at once. An answer older than :data:`KEEP_SECONDS`
counts as none. The world is the one of the newest round that any kept answer names, so an
answer kept from an older round does not hold the world up.

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
MAX_ASKS_PER_SECOND = 32.0
"""Questions (new connections) per second, for all jobs together, on average."""
ASK_BURST = 64
"""Questions at once at most (a job of up to this many pods is asked whole)."""
SUCCESSORS = 16
"""Pods asked while the store's host is not known, the lowest-indexed that answer."""
KEEP_SECONDS = 60.0
"""How long an answer is kept (then the pod counts as not asked: the API's view)."""
_MAX_ANSWER = 4096


@dataclasses.dataclass(frozen=True)
class AgentAnswer:
    """One agent's words: its pod index, phase, world (0 unless it trains), and its store."""

    index: int
    phase: str
    world: int
    host: bool
    gen: int
    round: int = 0
    """The rendezvous round the agent is in (0: not said, an older agent)."""

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
            round=int(data.get("round") or 0),
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


def askable(pod: ObservedPod) -> bool:
    """A live pod whose trainer started and that has an address."""
    return pod.live and bool(pod.ip) and pod.started


async def ask_pods(
    pods: Sequence[ObservedPod], port: int, timeout: float = ASK_TIMEOUT_SECONDS
) -> dict[str, AgentAnswer | None]:
    """Ask the agent of every live pod that has an address, all at once."""
    asked = [p for p in pods if askable(p)]
    answers = await asyncio.gather(*(ask(str(p.ip), port, timeout) for p in asked))
    return {p.name: answer for p, answer in zip(asked, answers, strict=True)}


class Budget:
    """Questions the operator may ask now: a token bucket of :data:`MAX_ASKS_PER_SECOND`,
    :data:`ASK_BURST` deep, shared by every job."""

    def __init__(
        self, rate: float = MAX_ASKS_PER_SECOND, burst: int = ASK_BURST, now: float = 0.0
    ) -> None:
        self.rate = rate
        self.burst = burst
        self.tokens = float(burst)
        self.at = now

    def take(self, wanted: int, now: float) -> int:
        """Up to ``wanted`` questions, as many as the bucket holds now."""
        self.tokens = min(float(self.burst), self.tokens + (now - self.at) * self.rate)
        self.at = now
        granted = max(0, min(wanted, int(self.tokens)))
        self.tokens -= granted
        return granted


@dataclasses.dataclass(frozen=True)
class _Kept:
    ip: str
    answer: AgentAnswer | None
    at: float
    silent: int = 0
    """Questions in a row at this address that got no answer."""


class Survey:
    """One job's kept answers, and which pods to ask next (see the module doc)."""

    def __init__(self) -> None:
        self._kept: dict[str, _Kept] = {}
        self._host: str | None = None
        """The pod whose agent last said it hosts the store."""
        self._host_lost: float | None = None
        """When that pod fell silent, or said it no longer hosts (None: a host is known, or
        none ever was)."""

    def pick(self, pods: Sequence[ObservedPod], budget: Budget, now: float) -> list[ObservedPod]:
        """The pods to ask now: never asked at their address, then the store's host, then those
        silent at their first question once more, then (the host lost) its likely successors,
        then those asked before a pod of their node fell silent, then the longest unasked; as
        many as ``budget`` grants."""
        candidates = [p for p in pods if askable(p)]
        if not candidates:
            return []
        host = next((p.name for p in pods if p.store_host), None)
        if host is None:
            hosts = [
                (k.answer.gen, name)
                for name, k in self._kept.items()
                if k.answer is not None and k.answer.host
            ]
            host = max(hosts)[1] if hosts else None
        silent: dict[str, float] = {}
        """node -> when a pod there was last found silent."""
        for pod in pods:
            kept = self._kept.get(pod.name)
            if pod.node and kept is not None and kept.answer is None:
                silent[pod.node] = max(kept.at, silent.get(pod.node, kept.at))
        successors = self._successors(candidates, now)

        def order(pod: ObservedPod) -> tuple[int, float, int]:
            kept = self._kept.get(pod.name)
            if kept is None or kept.ip != pod.ip:
                return (0, 0.0, pod.index)
            if pod.name == host:
                return (1, kept.at, pod.index)
            if kept.silent == 1 and now - kept.at >= ASK_EVERY_SECONDS:
                return (2, kept.at, pod.index)  # its first question went unanswered
            if pod.name in successors:
                return (3, float(pod.index), pod.index)
            if kept.answer is not None and pod.node in silent and kept.at < silent[pod.node]:
                return (4, kept.at, pod.index)
            return (5, kept.at, pod.index)

        ordered = sorted(candidates, key=order)
        return ordered[: budget.take(len(ordered), now)]

    def _successors(self, candidates: Sequence[ObservedPod], now: float) -> set[str]:
        """While the store's host is lost (for :data:`KEEP_SECONDS` at most): the
        :data:`SUCCESSORS` lowest-indexed pods that answered, those not asked this second."""
        lost = self._host_lost
        if lost is None or now - lost >= KEEP_SECONDS:
            return set()
        answering = sorted(
            (p.index, p.name)
            for p in candidates
            if (kept := self._kept.get(p.name)) is not None
            and kept.ip == p.ip
            and kept.answer is not None
        )
        return {name for _, name in answering[:SUCCESSORS] if now - self._kept[name].at >= 1.0}

    def record(
        self, answers: Mapping[str, AgentAnswer | None], pods: Sequence[ObservedPod], now: float
    ) -> None:
        ips = {p.name: str(p.ip) for p in pods}
        for name, answer in answers.items():
            ip = ips.get(name, "")
            before = self._kept.get(name)
            silent = 0
            if answer is None:
                silent = 1 + (before.silent if before is not None and before.ip == ip else 0)
            self._kept[name] = _Kept(ip, answer, now, silent)
            if answer is not None and answer.host:
                self._host, self._host_lost = name, None
            elif name == self._host:
                self._host, self._host_lost = None, now

    def answers(self, pods: Sequence[ObservedPod], now: float) -> dict[str, AgentAnswer | None]:
        """The kept answers of the pods still at the address they were asked at (and younger
        than :data:`KEEP_SECONDS`); the others are forgotten."""
        current = {p.name: str(p.ip) for p in pods if askable(p)}
        self._kept = {
            name: kept
            for name, kept in self._kept.items()
            if current.get(name) == kept.ip and now - kept.at < KEEP_SECONDS
        }
        return {name: kept.answer for name, kept in self._kept.items()}


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
    newest = max(answer.round for answer in valid.values())
    seen = []
    for pod in pods:
        if pod.name not in answers:
            seen.append(pod)
            continue
        answer = valid.get(pod.name)
        if answer is None:  # silent while its peers answer
            seen.append(_told(pod, ready=False, world_size=None))
            continue
        seen.append(
            _told(
                pod,
                ready=pod.ready and answer.training,
                # An answer kept from an older round does not say the world of now.
                world_size=answer.world if answer.round == newest else None,
                store_host=answer.host,
                store_gen=answer.gen,
            )
        )
    return tuple(seen)


def _told(pod: ObservedPod, **said: Any) -> ObservedPod:
    """``pod`` with what its agent said: ``dataclasses.replace(pod, **said)``, without its
    ~9 µs (``__init__`` again) for every pod of a thousand at every pass. ObservedPod is a
    frozen dataclass with no ``__post_init__`` and no derived field, so a copy of its fields
    with ``said`` over them is the same record (a unit test compares the two)."""
    if all(getattr(pod, field) == value for field, value in said.items()):
        return pod
    told = object.__new__(ObservedPod)
    told.__dict__.update(pod.__dict__)
    told.__dict__.update(said)
    return told
