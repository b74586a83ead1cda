"""Split sizes read off the routing (`.tolist()`, torchtitan's EP dispatcher): traced with the sizes
unbacked and rewritten in fixed-shape form (`capture/segments.py`), but not proven yet, so never
called equivalent. The case and its twin (tests/cases/unproven) are checked by the numeric oracle."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardproof import verify
from shardproof.case import load_case
from shardproof.oracle import run_numeric

UNPROVEN = Path(__file__).parent.parent / "cases" / "unproven"


@pytest.mark.parametrize("twin", ["fixed", "buggy"])
def test_the_dispatcher_is_traced_but_not_proven_yet(twin: str) -> None:
    report = verify(UNPROVEN / f"moe-a2a-tolist_{twin}.py", world_size=2)
    assert report.verdict == "unknown", report


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_oracle_agrees_with_the_dispatcher_and_not_with_its_twin(world_size: int) -> None:
    assert run_numeric(load_case(UNPROVEN / "moe-a2a-tolist_fixed.py"), world_size).agree
    assert not run_numeric(load_case(UNPROVEN / "moe-a2a-tolist_buggy.py"), world_size).agree
