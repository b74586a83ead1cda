"""Split sizes read off the routing (`.tolist()`, torchtitan's EP dispatcher): not traced yet, so
never proven. The case and its twin (tests/cases/unproven) are checked by the numeric oracle,
ready for the day the trace reads such sizes symbolically."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardproof import verify
from shardproof.case import load_case
from shardproof.errors import CaptureError
from shardproof.oracle import run_numeric

UNPROVEN = Path(__file__).parent.parent / "cases" / "unproven"


@pytest.mark.parametrize("twin", ["fixed", "buggy"])
def test_the_trace_stops_at_the_first_split_read_off_the_data(twin: str) -> None:
    path = UNPROVEN / f"moe-a2a-tolist_{twin}.py"
    first = next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.endswith(".tolist()"))
    with pytest.raises(CaptureError, match=rf"{path.name}:{first} .*\.tolist\(\)"):
        verify(path, world_size=2)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_oracle_agrees_with_the_dispatcher_and_not_with_its_twin(world_size: int) -> None:
    assert run_numeric(load_case(UNPROVEN / "moe-a2a-tolist_fixed.py"), world_size).agree
    assert not run_numeric(load_case(UNPROVEN / "moe-a2a-tolist_buggy.py"), world_size).agree
