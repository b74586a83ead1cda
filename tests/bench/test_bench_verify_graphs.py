"""Smoke test for bench/verify_graphs.py: the smallest real pair in a spawned child."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    module = importlib.import_module("verify_graphs")
    if not module.DATA.is_dir():
        pytest.skip("../shared/data/entangle (graph dumps) not present")
    return module


@pytest.mark.slow
def test_one_pair_gives_a_full_row(bench: ModuleType):
    row = bench.run_pair("aws_llama/tp1_layer1", "aws_llama/tp2_layer1", 10.1, timeout=300)
    assert row.verdict == "equivalent", row.note
    assert row.ranks == 2 and row.total >= row.imported > 0 and row.peak_mib > 0 and row.terms > 0
    cells = row.cells()
    assert cells[:3] == ["aws_llama/tp2_layer1", "2", "equivalent"] and cells[-1].endswith("x")
