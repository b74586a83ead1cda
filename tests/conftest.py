"""Fixtures shared across test folders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import jsonschema
import pytest

from shardproof import driver, verify
from shardproof.case import Case
from shardproof.oracle import run_numeric
from shardproof.report.model import Report

pytest_plugins = ["pytester"]


def _checked(case: Case, world_size: int, mode: str | None = None, **options) -> Report:
    """Verify the case (in `mode`: "forward", "train" or "step"; None for the case's own) and
    require the numeric oracle to agree: the verdict with whether the numbers agree, and every
    claim named failing with a claim that differs."""
    modes = {} if mode is None else {"train": mode == "train", "step": mode == "step"}
    report = verify(case, world_size=world_size, **modes, **options)
    numbers = run_numeric(case, world_size, mode=mode)
    assert (report.verdict == "equivalent") == numbers.agree, (report.diagnosis, numbers.detail)
    assert set(report.claims) <= set(numbers.differing), (report.claims, numbers.differing)
    return report


@pytest.fixture
def checked() -> Callable[..., Report]:
    """`_checked`, the case's own mode unless one is given."""
    return _checked


@pytest.fixture
def checked_step() -> Callable[..., Report]:
    """`_checked` of one training step ("train" unless "step" is given)."""
    return lambda case, world_size, mode="train", **options: _checked(case, world_size, mode, **options)


SCHEMA = json.loads((Path(__file__).parent.parent / "shardproof" / "report" / "schema.json").read_text())


@pytest.fixture(autouse=True)
def reports_follow_the_schema(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every report the driver makes anywhere in the suite is checked against the JSON Schema."""
    for name in ("_report", "_no_rule"):
        make = getattr(driver, name)

        def checked(*args, make=make, **kwargs) -> Report:
            report = make(*args, **kwargs)
            jsonschema.validate(report.to_json(), SCHEMA)
            return report

        monkeypatch.setattr(driver, name, checked)
