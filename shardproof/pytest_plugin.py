"""A pytest plugin (registered as `shardproof` through the `pytest11` entry point): every case file
named `*_case.py` is a test that passes when its distributed model is proven equivalent, and fails
with the report otherwise. Files named `test_*` are left to pytest's own collection. The case runs
with its own WORLD_SIZE and MODE; torch is imported only when a case runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.name.endswith("_case.py") and not file_path.name.startswith("test_"):
        return CaseFile.from_parent(parent, path=file_path)
    return None


class CaseFile(pytest.File):
    def collect(self) -> Iterator[pytest.Item]:
        yield CaseItem.from_parent(self, name="equivalent")


class CaseItem(pytest.Item):
    def runtest(self) -> None:
        from shardproof.testing import assert_equivalent

        assert_equivalent(self.path)

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, AssertionError):
            return f"{self.path.name} is not proven equivalent:\n{excinfo.value}"
        return super().repr_failure(excinfo, style)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, f"shardproof case {self.path.name}"
