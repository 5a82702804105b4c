"""The DDPJob reference page: generated from the models, kept in sync."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from ddpjob_operator import api

ROOT = Path(__file__).resolve().parents[2]
GENERATOR = ROOT / "hack" / "gen_reference.py"
PAGE = ROOT / "docs" / "reference" / "ddpjob.md"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", GENERATOR)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_matches_the_models() -> None:
    rendered = generator().render()
    assert PAGE.read_text() == rendered, (
        f"{PAGE.relative_to(ROOT)} is stale: run `make docs-reference`"
    )


def test_every_spec_and_status_field_is_on_the_page() -> None:
    text = PAGE.read_text()
    for model in (api.DDPJobSpec, api.DDPJobStatus):
        for name, field in model.model_fields.items():
            assert f"| `{field.alias or name}` |" in text, f"{model.__name__}.{name} is missing"
