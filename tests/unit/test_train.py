"""The training-state API (:mod:`ddpjob_worker.train`) in one process: the sampler's
re-partition across world-size changes (no sample skipped or repeated), the payload's round
trip, and snapshots after each committed step (a fresh start, a resume, a state that outgrows
its file)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from ddpjob_worker.train import (
    ElasticSampler,
    TrainState,
    model_checksum,
    newest,
    onstop,
    snapshot_path,
)
from ddpjob_worker.train.snapshot import SnapshotFile


def run_world(sampler: ElasticSampler, world: int, steps: int) -> list[int]:
    """``steps`` steps of every rank of ``world``; the indices they saw."""
    seen: list[int] = []
    for _ in range(steps):
        batches = [sampler.next_batch(rank, world) for rank in range(world)]
        if batches[0] is None:
            break
        for batch in batches:
            assert batch is not None and batch.consumed == batches[0].consumed
            seen.extend(batch.indices)
        sampler.advance(batches[0].consumed)
    return seen


@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_a_world_change_mid_epoch_sees_the_epoch_exactly_once(before: int, after: int) -> None:
    sampler = ElasticSampler(103, batch_size=4, seed=7)
    seen = run_world(sampler, before, 5)
    # The new world's processes start from the snapshot's position.
    resumed = ElasticSampler(103, batch_size=4, seed=7)
    resumed.load_state_dict(sampler.state_dict())
    seen += run_world(resumed, after, 1000)
    assert sorted(seen) == list(range(103))
    assert resumed.next_batch(0, after) is None  # one epoch: done


def test_epochs_have_their_own_order_and_the_tail_is_shared_not_padded() -> None:
    sampler = ElasticSampler(10, batch_size=4, seed=1, epochs=2)
    first = sampler.order(0)
    assert sorted(first) == list(range(10)) and first != sampler.order(1)
    seen = run_world(sampler, 3, 1000)
    assert sorted(seen) == sorted(list(range(10)) * 2)
    tail = ElasticSampler(5, batch_size=4, shuffle=False)
    tail.advance(3)  # 2 left for 3 ranks
    shares = [tail.next_batch(rank, 3) for rank in range(3)]
    assert [s.indices for s in shares if s is not None] == [[], [3], [4]]


def test_bad_sampler_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="batch_size must be positive"):
        ElasticSampler(3, batch_size=0)
    other = ElasticSampler(4)
    with pytest.raises(ValueError, match="same dataset length"):
        other.load_state_dict(ElasticSampler(5).state_dict())


def make_state(
    path: Path | None,
    *,
    extra: dict[str, int] | None = None,
    checkpoint: Path | None = None,
    every: int | None = 1,
) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    return TrainState(
        model=model,
        optimizer=opt,
        scheduler=sched,
        sampler=ElasticSampler(64, batch_size=8, seed=3),
        extra={} if extra is None else extra,
        path=path,
        snapshots=path is not None,
        checkpoint=checkpoint,
        snapshot_every=every,
    )


def train(state: TrainState, steps: int) -> None:
    data = torch.arange(64 * 4, dtype=torch.float32).reshape(64, 4) / 100
    for indices in state.batches():
        if state.step_no >= steps:
            return
        with state.step():
            loss = state.model(data[indices]).pow(2).mean()
            state.optimizer.zero_grad()
            loss.backward()
            state.optimizer.step()
            assert state.scheduler is not None
            state.scheduler.step()  # type: ignore[attr-defined]
            state.extra["seen"] = state.extra.get("seen", 0) + len(indices)


def test_the_payload_round_trips_model_optimizer_scheduler_sampler_rng_and_extra() -> None:
    state = make_state(None)
    train(state, 3)
    torch.manual_seed(42)
    random.seed(42)
    payload = bytes(state._payload())
    expected_torch, expected_py = torch.rand(3), random.random()
    other = make_state(None)
    other._load_payload(payload)
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py
    assert other.step_no == 3 and other.extra == {"seen": 24}
    assert other.sampler.state_dict() == state.sampler.state_dict()
    assert model_checksum(other.model) == model_checksum(state.model)
    for mine, theirs in zip(
        state.optimizer.state_dict()["state"].values(),
        other.optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert other.scheduler is not None and state.scheduler is not None
    assert other.scheduler.state_dict() == state.scheduler.state_dict()


def test_each_commit_is_snapshotted_and_a_restart_resumes_where_it_was(tmp_path: Path) -> None:
    path = tmp_path / "rank0.snap"
    fresh = make_state(path)
    assert fresh._restore().source is None  # nothing anywhere: step 0
    train(fresh, 5)
    snap = newest(SnapshotFile.open(path))
    assert snap is not None and snap.step == 5
    assert fresh.stats.snapshot_seconds > 0

    again = make_state(path)
    train(again, 8)  # restores step 5 first, then trains 3 more
    assert again.restored is not None and again.restored.step == 5 and again.restored.local
    reference = make_state(None)
    train(reference, 8)  # the same 8 steps without a restart
    assert model_checksum(again.model) == model_checksum(reference.model)
    assert again.extra == reference.extra


def test_with_no_snapshot_anywhere_the_checkpoint_on_disk_is_the_fallback(
    tmp_path: Path,
) -> None:
    """Snapshots lost (a node's memory gone with it): the restore falls back to the last
    checkpoint on disk, and the steps after it are trained again to the same model."""
    ckpt = tmp_path / "disk" / "latest.pt"
    first = make_state(tmp_path / "a.snap", checkpoint=ckpt)
    assert first._restore().checkpoint is False  # no checkpoint yet: a fresh start
    train(first, 4)
    assert first.save_checkpoint()
    train(first, 6)  # two steps past the checkpoint, then every snapshot is lost
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["latest.pt"]  # no temporary left

    again = make_state(tmp_path / "b.snap", checkpoint=ckpt)
    train(again, 8)
    assert again.restored is not None
    assert (again.restored.step, again.restored.checkpoint, again.restored.source) == (
        4,
        True,
        None,
    )
    reference = make_state(None)
    train(reference, 8)
    assert model_checksum(again.model) == model_checksum(reference.model)
    assert again.extra == reference.extra

    newer = make_state(tmp_path / "b.snap", checkpoint=ckpt)
    assert newer._restore().step == 8  # a snapshot anywhere wins over the checkpoint
    assert newer.restored is not None and newer.restored.checkpoint is False
    with pytest.raises(ValueError, match="checkpoint=<path>"):
        make_state(None).save_checkpoint()


def test_a_checkpoint_that_cannot_be_read_is_an_error_not_a_fresh_start(
    tmp_path: Path,
) -> None:
    unreadable = tmp_path / "state.pt"
    unreadable.mkdir()  # a directory where the file should be: reading it fails
    state = make_state(tmp_path / "a.snap", checkpoint=unreadable)
    with pytest.raises(RuntimeError, match=r"cannot read the checkpoint \(.*state\.pt"):
        state._restore()


def test_an_uncommitted_step_is_not_counted_and_its_batch_comes_again(tmp_path: Path) -> None:
    state = make_state(tmp_path / "s")
    batches = state.batches()
    first = next(batches)
    with pytest.raises(RuntimeError, match="boom"), state.step():
        raise RuntimeError("boom")
    assert state.step_no == 0 and next(batches) == first


def test_a_state_that_outgrows_its_file_gets_a_larger_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rank0.snap"
    state = make_state(path)
    SnapshotFile.create(path, 16)  # someone else's tiny file
    train(state, 1)
    snaps = SnapshotFile.open(path)
    assert snaps.capacity >= 2 * len(state._payload())
    state.extra["big"] = b"x" * (2 * snaps.capacity)
    with caplog.at_level("INFO", logger="ddpjob_worker.train.snapwriter"):
        train(state, 2)
    assert "remaking" in caplog.text
    snap = newest(SnapshotFile.open(path))
    assert snap is not None and snap.step == 2
    assert not path.with_name(path.name + ".new").exists()


def test_the_snapshot_file_is_the_agents_or_one_per_torchrun_run(tmp_path: Path) -> None:
    env = {"DDPJOB_SNAPSHOT_DIR": str(tmp_path), "LOCAL_RANK": "1"}
    assert snapshot_path(env) == tmp_path / "rank1.snap"
    plain = {"TORCHELASTIC_RUN_ID": "abc-1", "LOCAL_RANK": "0"}
    assert snapshot_path(plain, base=tmp_path) == tmp_path / "ddpjob-torchrun_abc_1/rank0.snap"


def test_each_phase_of_a_ddp_step_is_marked_for_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A world of one over gloo, a real DDP model: the communication hook marks the
    # all-reduce, and the record the agent reads follows the step.
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from ddpjob_worker.progress import Phase, path_for, read  # noqa: PLC0415

    monkeypatch.setenv("DDPJOB_SNAPSHOT_DIR", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "0")
    store = dist.HashStore()  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = DistributedDataParallel(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        state = TrainState(model=model, optimizer=opt, sampler=ElasticSampler(12, batch_size=4))
        record = path_for(tmp_path, 0)
        data = torch.randn(12, 4)
        phases = []
        for indices in state.batches():
            with state.step():
                phases.append(read(record))
                loss = model(data[indices]).sum()
                loss.backward()
                phases.append(read(record))
                opt.step()
        phases.append(read(record))
    finally:
        dist.destroy_process_group()
        onstop.uninstall()  # DDPJOB_SNAPSHOT_DIR made it watch SIGTERM: not in pytest's process
    seen = [(r.step, r.phase) for r in phases if r is not None]
    assert seen == [
        (0, Phase.COMPUTE), (0, Phase.COLLECTIVE),
        (1, Phase.COMPUTE), (1, Phase.COLLECTIVE),
        (2, Phase.COMPUTE), (2, Phase.COLLECTIVE),
        (3, Phase.IDLE),
    ]  # fmt: skip
    since = [r.since for r in phases if r is not None]
    assert since == sorted(since)


def test_a_checkpoint_also_snapshots_its_step_so_no_older_snapshot_wins_over_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rank0.snap"
    state = make_state(path, checkpoint=tmp_path / "ckpt.pt", every=1000)
    train(state, 7)
    assert newest(SnapshotFile.open(path)).step == 1  # type: ignore[union-attr]
    assert state.save_checkpoint()
    # The restore prefers any snapshot to the file: the snapshots must not be older than it.
    assert newest(SnapshotFile.open(path)).step == 7  # type: ignore[union-attr]
    again = make_state(path, checkpoint=tmp_path / "ckpt.pt", every=1000)
    assert again._restore().step == 7
