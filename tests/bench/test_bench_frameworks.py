"""bench/frameworks.py prints a row per model, cold (its CPU after the imports too) and (with
--warm) through `shardproof serve`, both with the verdict the model gets."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"

pytest.importorskip("transformers")


@pytest.mark.slow
def test_a_row_is_timed_cold_and_warm(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = importlib.import_module("frameworks")
    monkeypatch.setattr(bench, "TRANSFORMERS", ["llama"])
    bench.main(["--only", "transformers", "--world-sizes", "2", "--warm"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith("| transformers")]
    assert len(rows) == 1 and rows[0][3] == "equivalent", out
    assert float(rows[0][5]) > 0 and "note:" not in out  # a warm time, and the warm run agreed
    assert 0 < float(rows[0][7]) < float(rows[0][6])  # the CPU after the imports, a part of the whole
