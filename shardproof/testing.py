"""Helpers for tests that verify models: `assert_equivalent` fails with the report as its message."""

from __future__ import annotations

from typing import Any

from shardproof.report.model import Report


def assert_equivalent(case: Any = None, **kwargs: Any) -> Report:
    """`shardproof.verify(case, **kwargs)` (same arguments), raising AssertionError with the report's
    text unless the verdict is `equivalent`; returns the report."""
    from shardproof.api import verify
    from shardproof.report.text import render

    report = verify(case, **kwargs)
    if report.verdict != "equivalent":
        raise AssertionError(render(report))
    return report
