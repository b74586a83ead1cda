"""Every bundled example agrees numerically with its reference: the ground truth the verifier is held to.

Examples are found by globbing, so a case file added to examples/ is covered without editing this
test. A world size the example's config cannot be split over is skipped: the case says so by
raising ValueError or CaseError (e.g. "n_heads=8 is not divisible by world_size=3").
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from shardproof.case import Case, load_case
from shardproof.errors import CaseError
from shardproof.oracle import run_numeric

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD_SIZES = (1, 2, 4, 8)
# Helper modules (e.g. a shared reference model) sit next to the case files; cases define distributed().
CASE_FILES = sorted(p for p in EXAMPLES.glob("*.py") if re.search(r"^def distributed\(", p.read_text(), re.M))


def _assert_agrees(case: Case, world_size: int) -> None:
    try:
        result = run_numeric(case, world_size)
    except (ValueError, CaseError) as err:
        if world_size in (1, case.world_size):
            raise  # a case must run at world size 1 and at its own default
        pytest.skip(f"world size {world_size} does not fit the config: {err}")
    assert result.agree, result.detail


def test_examples_found() -> None:
    assert {"mlp_tp.py", "attention_tp.py"} <= {p.name for p in CASE_FILES}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("path", CASE_FILES, ids=lambda p: p.stem)
def test_example_agrees(path: Path, world_size: int) -> None:
    _assert_agrees(load_case(path), world_size)


ATTENTION = load_case(EXAMPLES / "attention_tp.py")
ATTENTION_MODULE = sys.modules[ATTENTION.reference.__module__]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("preset", sorted(ATTENTION_MODULE.PRESETS))
def test_attention_presets_agree(preset: str, world_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv heads fewer than, equal to and more than the ranks, and MHA."""
    monkeypatch.setattr(ATTENTION_MODULE, "CONFIG", ATTENTION_MODULE.PRESETS[preset])
    _assert_agrees(ATTENTION, world_size)
