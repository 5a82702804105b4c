"""The loop people write, on the training-state API in one process: torch's DataLoader with
worker processes over the sampler, a ``.mean()`` loss at any world size (no empty share),
gradient accumulation, a GradScaler's skipped step, a scheduler stepped per micro-batch, and the
errors that say what to do."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from ddpjob_worker.train import ElasticSampler, TrainState, model_checksum
from ddpjob_worker.train.sampler import max_world


class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i is (i, [i/100, ...]): a batch says which samples it holds."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(i), torch.full((4,), i / 100)


def walk(sampler: ElasticSampler, worlds: list[int]) -> list[list[list[int]]]:
    """Every rank's shares of each step, the world of each step taken from ``worlds`` in turn
    (a restart at every change: a fresh sampler loads the position)."""
    steps: list[list[list[int]]] = []
    while True:
        world = worlds[len(steps) % len(worlds)]
        shares = [sampler.next_batch(rank, world) for rank in range(world)]
        if shares[0] is None:
            return steps
        steps.append([share.indices for share in shares if share is not None])
        moved = ElasticSampler(sampler.size, batch_size=sampler.batch_size, seed=sampler.seed,
                               epochs=sampler.epochs, max_world=sampler.max_world)  # fmt: skip
        moved.load_state_dict(sampler.state_dict())
        moved.advance(shares[0].consumed)
        sampler = moved


@pytest.mark.parametrize("seed", range(40))
def test_no_rank_gets_an_empty_batch_and_each_epoch_is_seen_once_across_world_changes(
    seed: int,
) -> None:
    rng = random.Random(seed)
    size, batch, epochs = rng.randint(1, 90), rng.randint(1, 6), rng.randint(1, 3)
    worlds = [rng.randint(1, 8) for _ in range(rng.randint(1, 5))]
    sampler = ElasticSampler(size, batch_size=batch, seed=seed, epochs=epochs, max_world=8)
    seen: list[int] = []
    for shares in walk(sampler, worlds):
        if size >= 8:  # a dataset smaller than the world cannot give every rank a sample
            assert all(shares), (size, batch, worlds, shares)
        assert len(shares) in worlds
        seen += [i for share in shares for i in share]
    assert sorted(seen) == sorted(list(range(size)) * epochs)


def test_the_tail_is_merged_into_the_last_step_not_left_to_a_few_ranks() -> None:
    sampler = ElasticSampler(10, batch_size=4, shuffle=False, max_world=2)
    first = [sampler.next_batch(rank, 2) for rank in range(2)]
    assert [b.indices for b in first if b is not None] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # 10 - 8 = 2 left: as many as the largest world, so they are a step of their own.
    sampler.advance(8)
    assert [sampler.next_batch(r, 2).indices for r in range(2)] == [[8], [9]]  # type: ignore[union-attr]
    # With a largest world of 3, two left would starve one rank: the first step takes them.
    wider = ElasticSampler(10, batch_size=4, shuffle=False, max_world=3)
    assert [wider.next_batch(r, 2).indices for r in range(2)] == [  # type: ignore[union-attr]
        [0, 1, 2, 3, 4],
        [5, 6, 7, 8, 9],
    ]


def test_a_world_beyond_the_largest_borrows_from_the_next_epoch() -> None:
    sampler = ElasticSampler(5, batch_size=2, shuffle=False, epochs=2, max_world=1)
    sampler.advance(4)  # one left for a world of 3 (larger than max_world)
    shares = [sampler.next_batch(r, 3) for r in range(3)]
    assert [s.indices for s in shares if s is not None] == [[4], [0], [1]]
    sampler.advance(3)
    assert (sampler.epoch, sampler.processed) == (1, 2)


def test_the_largest_world_comes_from_the_launchers_environment() -> None:
    assert max_world({"PET_NNODES": "1:4", "PET_NPROC_PER_NODE": "2"}) == 8
    assert max_world({"PET_NNODES": "3"}) == 3
    assert max_world({}) is None and max_world({"PET_NPROC_PER_NODE": "gpu"}) is None


def make(
    path: Path | None, *, size: int = 48, batch: int = 4, every: int = 1, **kwargs: object
) -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return TrainState(
        model=model,
        optimizer=opt,
        sampler=ElasticSampler(size, batch_size=batch, seed=5, epochs=2),
        path=path,
        snapshots=path is not None,
        snapshot_every=every,
        **kwargs,  # type: ignore[arg-type]
    )


def loader_of(state: TrainState, workers: int) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
    return DataLoader(
        Indexed(state.sampler.size),
        batch_sampler=state.sampler,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
    )


def train_loader(state: TrainState, loader: DataLoader, seen: list[int], stop: int) -> None:  # type: ignore[type-arg]
    for _ in state.epochs():
        for ids, x in loader:
            if state.step_no >= stop:
                return
            with state.step():
                state.optimizer.zero_grad()
                state.model(x).mean().backward()
                state.optimizer.step()
            seen.extend(ids.tolist())


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataloader_with_workers_resumes_at_what_the_commits_consumed(
    tmp_path: Path, workers: int
) -> None:
    """The loader's workers prefetch batches ahead; the snapshot's position is what the
    committed steps consumed, so the restart trains every sample of both epochs once."""
    path = tmp_path / "rank0.snap"
    first = make(path)
    seen: list[int] = []
    train_loader(first, loader_of(first, workers), seen, stop=17)  # 12 steps an epoch
    assert first.step_no == 17 and first.sampler.state_dict()["epoch"] == 1

    again = make(path)
    loader = loader_of(again, workers)
    train_loader(again, loader, seen, stop=10_000)
    assert again.restored is not None and again.restored.step == 17
    assert sorted(seen) == sorted(list(range(48)) * 2)
    reference = make(None)
    train_loader(reference, loader_of(reference, workers), [], stop=10_000)
    assert model_checksum(again.model) == model_checksum(reference.model)


def test_len_of_the_loader_is_the_rest_of_the_epoch(tmp_path: Path) -> None:
    state = make(tmp_path / "s")
    loader = loader_of(state, 0)
    assert len(loader) == 12
    seen: list[int] = []
    train_loader(state, loader, seen, stop=5)
    assert len(loader) == 7


def test_accumulated_micro_batches_commit_once_with_every_sample(tmp_path: Path) -> None:
    """Four micro-batches a step: three blocks without ``optimizer.step`` and the block with it;
    one commit, the sampler moved by the four batches; a restart mid-step trains the step's
    micro-batches again, and the model is the run's without a restart."""
    k = 4

    def run(state: TrainState, stop: int, seen: list[int]) -> None:
        data = torch.arange(48 * 4, dtype=torch.float32).reshape(48, 4) / 100
        for i, indices in enumerate(state.batches()):
            if state.step_no >= stop and i % k == 0:
                return
            with state.step():
                state.model(data[indices]).mean().div(k).backward()
                if i % k == k - 1:
                    state.optimizer.step()
                    state.optimizer.zero_grad()
            seen.extend(indices)

    path = tmp_path / "rank0.snap"
    first = make(path)
    seen: list[int] = []
    run(first, 2, seen)
    assert first.step_no == 2 and first.sampler.state_dict()["processed"] == 2 * k * 4
    # Two micro-batches of the third step, then the worker dies: they are not committed.
    partial = make(path)
    blocks = partial.batches()
    for _ in range(2):
        next(blocks)
        with partial.step():
            pass
    assert partial.step_no == 2
    again = make(path)
    run(again, 10_000, seen)
    assert again.restored is not None and again.restored.step == 2
    assert again.step_no == 2 * 48 // (4 * k)
    assert sorted(seen) == sorted(list(range(48)) * 2)
    reference = make(None)
    run(reference, 10_000, [])
    assert model_checksum(again.model) == model_checksum(reference.model)


def test_a_step_the_scaler_skips_commits_and_the_scaler_state_is_restored(tmp_path: Path) -> None:
    path = tmp_path / "rank0.snap"
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = make(path, scaler=scaler)
    data = torch.ones(48, 4)
    for n, indices in enumerate(state.batches()):
        if n == 3:
            break
        with state.step():
            loss = state.model(data[indices]).mean()
            if n == 1:
                loss = loss * float("inf")  # the scaler finds inf gradients: no optimizer.step
            state.optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(state.optimizer)
            scaler.update()
    assert state.step_no == 3
    assert scaler.get_scale() == 512.0  # halved once, at the skipped step
    other = make(path, scaler=torch.amp.GradScaler("cpu", init_scale=1.0))
    assert other._restore().step == 3
    assert other.scaler is not None and other.scaler.get_scale() == 512.0


def test_a_scheduler_stepped_per_micro_batch_is_held_at_the_commit(tmp_path: Path) -> None:
    """A stop between the micro-batches of a step writes the commit's scheduler and learning
    rate, not the ones the micro-batches since moved."""
    path = tmp_path / "rank0.snap"
    state = make(path, every=1000)  # the first commit's snapshot, then none
    sched = torch.optim.lr_scheduler.StepLR(state.optimizer, step_size=1, gamma=0.5)
    state.scheduler = sched
    data = torch.ones(48, 4)
    blocks = state.batches()
    for n in range(4):  # steps of two micro-batches, the scheduler stepped in each
        indices = next(blocks)
        with state.step():
            state.model(data[indices]).mean().backward()
            if n in (0, 2):
                state.optimizer.step()
            sched.step()
    assert state.step_no == 2 and sched.last_epoch == 4
    assert state._commits.write_held(2, "a test's stop")
    other = make(path)
    other.scheduler = torch.optim.lr_scheduler.StepLR(other.optimizer, step_size=1, gamma=0.5)
    assert other._restore().step == 2
    assert other.scheduler.last_epoch == 3
    assert other.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert other.sampler.state_dict()["processed"] == 3 * 4


def test_the_wrong_sampler_or_a_shuffling_loader_is_named_with_the_fix() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = Indexed(8)
    plain = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    with pytest.raises(TypeError, match=r"DistributedSampler.*batch_sampler=ElasticSampler"):
        TrainState(model=model, optimizer=opt, loader=plain, snapshots=False)
    wrong: object = DistributedSampler(data, 1, 0)
    with pytest.raises(TypeError, match=r"takes an ElasticSampler, not a DistributedSampler"):
        TrainState(model=model, optimizer=opt, sampler=wrong, snapshots=False)  # type: ignore[arg-type]
    sampler = ElasticSampler(8, batch_size=2)
    with pytest.raises(ValueError, match="mutually exclusive"):  # torch's own message
        DataLoader(data, batch_sampler=sampler, shuffle=True)
    # Serving no TrainState (an evaluation loader): every iteration is the epoch from its start.
    evaluation = DataLoader(data, batch_sampler=sampler)
    assert [ids.tolist() for ids, _ in evaluation] == [ids.tolist() for ids, _ in evaluation]
    assert sorted(i for ids, _ in evaluation for i in ids.tolist()) == list(range(8))
    state = TrainState(model=model, optimizer=opt, loader=DataLoader(data, batch_sampler=sampler),
                       snapshots=False)  # fmt: skip
    assert state.sampler is sampler
    with pytest.raises(ValueError, match="dataset's length changed"):
        ElasticSampler(9).load_state_dict(sampler.state_dict())
    unordered = DataLoader(data, batch_sampler=sampler, num_workers=2, in_order=False)
    with pytest.raises(ValueError, match=r"in_order=False.*drop in_order=False"):
        TrainState(model=model, optimizer=opt, loader=unordered, snapshots=False)


class Stream(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


def test_an_iterable_dataset_is_refused_with_what_to_do() -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(Stream(), batch_size=2)
    with pytest.raises(
        TypeError, match=r"iterable dataset \(Stream\).*map-style Dataset.*state_dict"
    ):
        TrainState(model=model, optimizer=opt, loader=loader, snapshots=False)


def test_the_audit_proves_every_sample_once_along_the_kept_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDPJOB_TRAIN_AUDIT: a run, a restart that resumes from its snapshot, and a stale commit
    past the restored step (a lineage given up) check clean; an audit whose steps repeat a batch
    or skip one does not."""
    from ddpjob_worker.train import audit  # noqa: PLC0415

    monkeypatch.setenv(audit.DDPJOB_TRAIN_AUDIT, str(tmp_path / "audit"))
    path = tmp_path / "rank0.snap"
    first = make(path)
    train_loader(first, loader_of(first, 2), [], stop=7)
    # A pod that resumed from step 7 and reached 10, then died with its snapshots: the job
    # resumes from step 7 again, and the commits of 8-10 are a lineage given up.
    (tmp_path / "lost.snap").write_bytes(path.read_bytes())
    lost = make(tmp_path / "lost.snap")
    train_loader(lost, loader_of(lost, 0), [], stop=10)
    again = make(path)
    train_loader(again, loader_of(again, 0), [], stop=10_000)
    lines = audit.read(tmp_path / "audit")
    found = audit.check(lines, 48)
    assert found.problems == []
    assert found.steps == 24 and found.restores == [(0, 1), (7, 1), (7, 1)]
    commits = [line for line in lines if "step" in line]
    repeated = [dict(line) for line in commits]
    repeated[3]["to"] = repeated[3]["from"]  # step 4 "consumed nothing": step 5 repeats it
    assert any("starts at" in p for p in audit.check(repeated, 48).problems)
    doubled = [dict(line) for line in commits]
    doubled[5]["batches"] = doubled[4]["batches"]
    assert any("samples twice" in p for p in audit.check(doubled, 48).problems)


def test_a_compiled_model_and_clipped_gradients_restore_to_the_run_without_a_restart(
    tmp_path: Path,
) -> None:
    """torch.compile wraps the model (its state dict's keys gain ``_orig_mod.``): the snapshot is
    the compiled module's own state dict, and restores into the same compiled script."""

    def compiled(path: Path | None) -> TrainState:
        torch.manual_seed(0)
        model: torch.nn.Module = torch.compile(torch.nn.Linear(4, 1), backend="eager")  # type: ignore[assignment]
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sampler = ElasticSampler(48, batch_size=4, seed=5)
        return TrainState(model=model, optimizer=opt, sampler=sampler, path=path,
                          snapshots=path is not None, snapshot_every=1)  # fmt: skip

    def run(state: TrainState, stop: int) -> None:
        data = torch.arange(48 * 4, dtype=torch.float32).reshape(48, 4) / 100
        for indices in state.batches():
            if state.step_no >= stop:
                return
            with state.step():
                state.model(data[indices]).mean().backward()
                torch.nn.utils.clip_grad_norm_(state.model.parameters(), 0.01)
                state.optimizer.step()
                state.optimizer.zero_grad()

    path = tmp_path / "rank0.snap"
    first = compiled(path)
    run(first, 5)
    assert any(key.startswith("_orig_mod.") for key in first.model.state_dict())
    again = compiled(path)
    run(again, 10_000)
    assert again.restored is not None and again.restored.step == 5
    reference = compiled(None)
    run(reference, 10_000)
    assert model_checksum(again.model) == model_checksum(reference.model)
