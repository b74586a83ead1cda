"""Fixtures shared across test folders."""

from __future__ import annotations

from typing import Callable

import pytest

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric
from shardproof.report.model import Report


@pytest.fixture
def checked_step() -> Callable[..., Report]:
    """Verify one training step ("train" or "step") and require the numeric oracle to agree: the
    verdict with whether the numbers agree, and every claim named failing with a claim that differs."""

    def check(case: Case, world_size: int, mode: str = "train", **options) -> Report:
        report = verify(case, world_size=world_size, train=mode == "train", step=mode == "step", **options)
        numbers = run_numeric(case, world_size, mode=mode)
        assert (report.verdict == "equivalent") == numbers.agree, (report.diagnosis, numbers.detail)
        assert set(report.claims) <= set(numbers.differing), (report.claims, numbers.differing)
        return report

    return check
