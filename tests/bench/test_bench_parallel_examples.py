"""bench/parallel_examples.py prints a row per example, mode and world size, with the example's verdict."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_the_bench_prints_a_row_per_configuration(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = importlib.import_module("parallel_examples")
    bench.main(["moe_ep.py:small-etp", "--world-sizes", "2", "--modes", "forward,train", "--markdown"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0].lstrip("| "), r[1], r[2], r[3]) for r in rows] == [
        ("moe_ep.py:small-etp", mode, "2", "equivalent") for mode in ("forward", "train")
    ]
