"""The pytorch/examples patches (``examples/pytorch-examples``) keep the API's promise of a small
change: each script's own patch onto the training-state API changes at most 15 lines by git's
count (added plus removed), the CPU port kept apart, and no patch of the API touches a device."""

from __future__ import annotations

import pytest

from tests.harness import pytorch_examples

SCRIPTS = sorted(pytorch_examples.FOLDERS)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_api_patch_changes_at_most_15_lines(script: str) -> None:
    added, removed = pytorch_examples.changed_lines(script)
    assert 0 < added + removed <= 15, (added, removed)


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_api_patch_leaves_devices_to_the_cpu_port(script: str) -> None:
    api = (pytorch_examples.PATCHES / f"{script}.patch").read_text(encoding="utf-8")
    changed = [line for line in api.splitlines() if line[:1] in "+-" and line[:3] not in "+++---"]
    assert not [line for line in changed if "cuda" in line or "gloo" in line or ".to(" in line]
    names = [patch.name for patch in pytorch_examples.patches(script)]
    assert names[-2:] == [f"{script}.patch", f"{script}.cpu.patch"], names
    assert [p.name for p in pytorch_examples.patches(script, cpu=False)] == names[:-1]
