"""bench/op_coverage.py: the table of how the lowering handles each op the traces reach, read off
what the lowering does (its path per op), on the sampling cases and on a program of ops no hand
lowering covers."""

from __future__ import annotations

import importlib
import textwrap
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"

OPEN_OPS = '''
import torch

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(4, 6))

    def forward(self, x):
        y = (x @ self.w).expm1()
        return torch.sort(y, dim=-1).values + torch.logsumexp(y, -1, keepdim=True)

def reference():
    return Model()

def distributed(rank, world_size):
    return Model()

def inputs():
    return (torch.randn(3, 4),)
'''


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("op_coverage")


def _rows(text: str) -> dict[str, str]:
    """op -> how it is handled, from the printed table."""
    cells = [line.split(" | ") for line in text.splitlines() if line.startswith("| `")]
    return {cell[0].strip("| `"): cell[1] for cell in cells}


def test_the_categories_come_from_what_the_lowering_did(bench, tmp_path: Path, capsys) -> None:
    case = tmp_path / "open_ops.py"
    case.write_text(textwrap.dedent(OPEN_OPS))
    assert bench.main(["--only", "", "--case", str(case)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows["aten.expm1.default"] == "pointwise tag"
    assert rows["aten.sort.default"] == "congruence only"
    assert rows["aten.logsumexp.default"] == "decomposed (torch)"
    assert rows["aten.mm.default"] == "own rules"
    assert "aten.amax.default" in rows  # a piece of logsumexp's decomposition, on its own row


def test_the_sampling_cases_reach_no_op_without_a_rule(bench, capsys) -> None:
    assert bench.main(["--only", "sampling"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows["aten.argmax.default"] == "own rules" and rows["aten.max.dim"] == "decomposed (ours)"
    assert "no rule" not in rows.values() and "trace failed" not in out
