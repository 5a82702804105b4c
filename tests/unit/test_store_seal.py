"""The job's key seals what the agents write to the rendezvous store (review finding 8, 9).

Real torch handlers on a real TCPStore; the "outsider" writes to that store as anyone who reaches
its port and knows the run id can.
"""

from __future__ import annotations

import base64
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from ddpjob_worker.agent.rendezvous import RendezvousAdapter, _fresh_sync, is_jobs_store
from ddpjob_worker.membership import watch
from ddpjob_worker.membership.keys import END_FAILURE, END_LEAVE
from ddpjob_worker.membership.liveness import Health
from ddpjob_worker.membership.nodes import NodeRepr
from ddpjob_worker.membership.seal import KEY_ENV, Seal, SealError
from tests.harness.agents import free_port

KEY = Seal(b"the job's key")


def test_a_sealed_value_opens_only_with_the_key_and_under_its_own_name() -> None:
    sealed = KEY.value("ddpjob.r.left", "10.0.0.2_7_1")
    assert sealed != "10.0.0.2_7_1"
    assert KEY.open("ddpjob.r.left", sealed) == "10.0.0.2_7_1"
    assert KEY.open("ddpjob.r.gone.1", sealed) is None, "moved to another key"
    assert KEY.open("ddpjob.r.left", "10.0.0.2_7_1") is None, "never sealed"
    assert Seal(b"another job's key").open("ddpjob.r.left", sealed) is None
    tampered = sealed.replace("10.0.0.2", "10.0.0.3")
    assert KEY.open("ddpjob.r.left", tampered) is None
    raw = KEY.items("k", ["a", "b"]) + "forged;" + KEY.items("k", ["c"])
    assert KEY.open_items("k", raw) == ["a", "b", "c"]
    assert KEY.open_bytes("s", KEY.seal_bytes("s", b"state")) == b"state"
    with pytest.raises(SealError, match=KEY_ENV):
        KEY.open_bytes("s", b"state" + bytes(32))
    with pytest.raises(SealError):
        KEY.open_bytes("s", b"x")


def test_without_a_key_everything_is_taken_as_written() -> None:
    off = Seal.from_env({})
    assert not off.on
    assert off.value("k", "v") == "v" and off.open("k", "v") == "v"
    assert off.open_items("k", "a;b;") == ["a", "b"]
    assert off.open_bytes("s", b"state") == b"state"
    assert Seal.from_env({KEY_ENV: "x"}).on


class Job:
    """One agent's rendezvous handler (hosting the store) with our additions, sealed or not."""

    def __init__(self, port: int, run_id: str, seal: Seal, *, host: bool = True) -> None:
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"127.0.0.1:{port}",
            run_id=run_id,
            min_nodes=1,
            max_nodes=1,
            is_host=host,
            local_addr="127.0.0.1",
            last_call_timeout=1,
            join_timeout=20,
        )
        self.handler = rdzv_registry.get_rendezvous_handler(params)
        fast = RendezvousAdapter.attach(self.handler, seal)
        assert fast is not None
        self.fast = fast
        self.run_id = run_id

    def join(self) -> None:
        self.handler.next_rendezvous()
        self.fast.note_round()

    def close(self) -> None:
        stop = getattr(self.handler, "_stop_heartbeats", None)
        if stop is not None:
            stop()


def sync(job: Job) -> None:
    """Read the rendezvous state from the store now (past torch's 1 s cache)."""
    _fresh_sync(job.fast._holder)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def job(port: int) -> Iterator[Job]:
    made = Job(port, uuid.uuid4().hex, KEY)
    yield made
    made.close()


def outsider(port: int) -> Any:
    """A client of the store, as anyone who reaches its port is."""
    return dist.TCPStore("127.0.0.1", port, is_master=False, use_libuv=True)  # type: ignore[attr-defined]


class Payload:
    """A pickle that runs code where it is loaded: it writes ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[Path, str]]:
        return (Path.write_text, (self.path, "code ran in the agent"))


def test_a_forged_rendezvous_state_is_refused_not_unpickled(
    job: Job, port: int, tmp_path: Path
) -> None:
    job.join()
    ran = tmp_path / "ran"
    forged = base64.b64encode(pickle.dumps(Payload(ran)))
    outsider(port).set(f"torch.rendezvous.{job.run_id}", forged)
    with pytest.raises(SealError, match="not sealed with this job's key"):
        sync(job)  # as every agent's monitor tick does
    assert not ran.exists(), "the forged pickle ran"


def test_without_the_key_torch_unpickles_whatever_the_store_holds(
    port: int, tmp_path: Path
) -> None:
    """Why the state is sealed: stock torch loads the store's pickle, forged or not."""
    plain = Job(port, uuid.uuid4().hex, Seal(None))
    try:
        plain.join()
        ran = tmp_path / "ran"
        forged = base64.b64encode(pickle.dumps(Payload(ran)))
        outsider(port).set(f"torch.rendezvous.{plain.run_id}", forged)
        with pytest.raises(Exception):  # noqa: B017, PT011 (torch then chokes on the result)
            sync(plain)
        assert ran.exists()
    finally:
        plain.close()


def test_forged_and_outside_keys_do_not_steer_the_round(job: Job, port: int) -> None:
    job.join()
    run, rnd = job.run_id, job.fast.round
    node = job.fast.me
    store = outsider(port)
    over = f"ddpjob.{run}.round.{rnd}.over"
    store.append(over, f"{END_FAILURE};{END_FAILURE}@{node};")  # unsealed: anyone
    store.append(f"ddpjob.{run}.left", f"{node};")
    store.append(f"ddpjob.{run}.round.{rnd}.silent", f"{node};")
    assert job.fast.round_over() == frozenset()
    assert job.fast.keys.left() == set() and job.fast.silent() == set()
    # Sealed, but not by a member of the round: a round's end is its members' to say.
    store.append(over, KEY.items(over, [f"{END_FAILURE}@10.9.9.9_1_1"]))
    assert job.fast.round_over() == frozenset()
    job.fast.announce_end(END_LEAVE)
    assert job.fast.round_over() == frozenset({END_LEAVE})


def test_forged_failure_reports_are_dropped() -> None:
    from ddpjob_worker.agent.blame import FAILURE_REPORTS_KEY, parse_reports  # noqa: PLC0415

    raw = "1.0@1@error;" + KEY.items(FAILURE_REPORTS_KEY, ["2.0@0@comm"])
    opened = parse_reports(";".join(KEY.open_items(FAILURE_REPORTS_KEY, raw)))
    assert [(r.at, r.node, r.cause) for r in opened] == [(2.0, 0, "comm")]


def test_a_store_is_the_jobs_only_once_its_host_said_so_with_the_key(port: int) -> None:
    host = Job(port, uuid.uuid4().hex, KEY)
    other = Job(port, uuid.uuid4().hex, KEY, host=False)  # another run id on the same store
    try:
        assert not is_jobs_store(host.handler, KEY, timeout=0.3), "nobody said so yet"
        host.fast.keys.mark_hosted()
        assert is_jobs_store(host.handler, KEY, timeout=0.3)
        assert not is_jobs_store(other.handler, KEY, timeout=0.3), "another job's store"
        outsider(port).set(f"ddpjob.{other.run_id}.hosted", "forged")
        assert not is_jobs_store(other.handler, KEY, timeout=0.3)
        assert is_jobs_store(other.handler, Seal(None), timeout=0.3), "no key: nothing to check"
    finally:
        host.close()
        other.close()


class Counting:
    """A store that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


@pytest.mark.parametrize("members", [3, 30])
def test_naming_the_gone_takes_the_same_store_requests_for_any_number_of_members(
    job: Job, members: int
) -> None:
    """Every agent asks after a failure, all at once: O(members) requests in all, not
    O(members²) on the single-threaded store."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc  # noqa: PLC0415

    job.join()
    nodes = [NodeRepr(repr(_NodeDesc(f"127.0.0.{i + 2}", 100 + i, 1))) for i in range(members)]
    keys = job.fast.keys
    for node in nodes:  # each published its address (refused: nobody listens there)
        name = f"ddpjob.{job.run_id}.alive"
        keys.store.append(name, KEY.items(name, [f"{node}=127.0.0.1:1"]))
    counting = Counting(keys.store)
    keys.store = counting
    health = watch.judge(keys, nodes, timeout=0.5)
    assert health == dict.fromkeys(nodes, Health.GONE)
    assert counting.calls <= 8, counting.calls


def test_a_new_stores_hub_is_read_in_two_requests_and_only_if_sealed() -> None:
    """Every member asks a new store for its hub at once (a host lost): a wait and a get
    each, not a wait, a check and a get."""
    from datetime import timedelta  # noqa: PLC0415

    from ddpjob_worker.agent.hubrdzv import HUB_KEY  # noqa: PLC0415
    from ddpjob_worker.membership.keys import RunKeys, key  # noqa: PLC0415
    from tests.unit.memstore import MemStore  # noqa: PLC0415

    store = MemStore()
    me = NodeRepr("127.0.0.1_1_0")
    RunKeys(store, "run", KEY, me)._put(HUB_KEY, "127.0.0.1:4242")
    before = store.requests
    assert RunKeys(store, "run", KEY, me)._wait_read(HUB_KEY, timedelta(seconds=1)) == (
        "127.0.0.1:4242"
    )
    assert store.requests - before == 2
    store.set(key("forged", HUB_KEY), "127.0.0.1:1")  # not sealed with the job's key
    assert RunKeys(store, "forged", KEY, me)._wait_read(HUB_KEY, timedelta(seconds=1)) is None
    with pytest.raises(RuntimeError, match="wait timeout"):
        RunKeys(store, "nobody", KEY, me)._wait_read(HUB_KEY, timedelta(seconds=1))
