"""A step's state as one flat buffer (``ddpjob_worker.train.flat``), the snapshots' format: what goes
in comes out equal, in its own types, from bytes or from a snapshot slot written in place."""

from __future__ import annotations

import collections
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ddpjob_worker.train import flat
from ddpjob_worker.train.snapshot import SnapshotFile

Pair = collections.namedtuple("Pair", ["left", "right"])


def rich_state() -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    wide = torch.arange(24, dtype=torch.float64).reshape(4, 6)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {"torch": torch.get_rng_state(), "random": random.getstate()},
        "extra": {
            "strided": wide[:, ::2],  # not contiguous
            "transposed": wide.t(),
            "bf16": torch.randn(5).to(torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "scalar": torch.tensor(7, dtype=torch.int64),
            "empty": torch.empty(0, 3),
            "pair": Pair(torch.ones(2), "x"),
            "nested": [(torch.zeros(2, 2), 1.5), {"k": torch.full((3,), 2, dtype=torch.int8)}],
            "text": "step",
        },
        "step": 12,
    }


def same(a: Any, b: Any) -> None:
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            same(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            same(x, y)
    else:
        assert a == b


def test_a_state_comes_back_equal_in_its_own_types() -> None:
    state = rich_state()
    laid = flat.plan(state)
    payload = bytes(laid.to_bytes())  # read only, as a snapshot's bytes are
    assert flat.is_flat(payload) and len(payload) == laid.nbytes
    back = flat.load(payload)
    same(state, back)
    # A module's state dict keeps its modules' versions, which load_state_dict reads.
    assert back["model"]._metadata == state["model"]._metadata
    # Fresh tensors, not views of the buffer.
    back["model"]["0.weight"].add_(1)
    same(flat.load(payload)["model"], state["model"])


def test_the_tensors_go_flat_aligned_and_the_rest_in_a_small_pickle() -> None:
    big = torch.randn(10_000)
    laid = flat.plan({"big": big, "n": 3})
    assert len(laid.head) < 1_000
    ((tensor, ref),) = laid.tensors
    assert tensor is not None and ref.offset % flat.ALIGN == 0
    assert laid.nbytes == ref.offset + big.numel() * 4


def test_a_state_written_in_place_into_a_snapshot_slot_reads_back(tmp_path: Path) -> None:
    state = rich_state()
    laid = flat.plan(state)
    snaps = SnapshotFile.create(tmp_path / "rank0.snap", 2 * laid.nbytes)
    snaps.write_with(12, 3, laid.nbytes, laid.fill)
    snap = SnapshotFile.open(tmp_path / "rank0.snap").latest()
    assert snap is not None and (snap.step, snap.generation) == (12, 3)
    same(state, flat.load(snap.payload))


@pytest.mark.parametrize(
    "payload",
    [b"", b"PK\x03\x04 a zip: torch.save's", flat.MAGIC + (10**9).to_bytes(8, "little")],
)
def test_bytes_that_are_not_a_flat_state_are_refused(payload: bytes) -> None:
    with pytest.raises(ValueError, match="not a flat state"):
        flat.load(payload)


def test_a_tensor_ref_past_the_end_is_refused() -> None:
    payload = flat.plan({"t": torch.ones(100)}).to_bytes()
    with pytest.raises(ValueError, match="past its end"):
        flat.load(payload[:-8])
