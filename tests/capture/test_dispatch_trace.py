"""The light tracer records forward programs as make_fx does: the same IR, op for op and line for line."""

from __future__ import annotations

from pathlib import Path

import pytest

import shardproof.capture.torch_capture as torch_capture
from shardproof.capture.torch_capture import capture
from shardproof.case import load_case
from shardproof.ir.graph import Graph

ROOT = Path(__file__).parents[2]
CASES = [
    "examples/llama_tp.py",  # in-place all_reduce, all_gather into a list, memoized layers
    "examples/attention_tp.py",
    "tests/cases/te-gather-last-dim_fixed.py",  # into-tensor all_gather through a deprecated wrapper
    "tests/cases/fused-naive-concat_buggy.py",
]


def _ir(graph: Graph) -> list[tuple]:
    return [
        (n.op, n.inputs, repr(n.attrs), n.shape, n.dtype, (n.loc.file, n.loc.line) if n.loc else None)
        for n in graph.nodes
    ]


@pytest.fixture(autouse=True)
def _each_rank_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks traced one by one, as make_fx traces them (tests/capture/test_symbolic_rank.py
    compares the symbolic rank's graphs with these, up to shared constants)."""
    monkeypatch.setattr(torch_capture, "_rank_class", lambda *args: None)


def _graphs(path: str, memo: bool) -> list[list[tuple]]:
    captured = capture(load_case(ROOT / path), 2, memo=memo)
    return [_ir(g) for g in [captured.reference, *captured.ranks]]


@pytest.mark.parametrize("path", CASES)
def test_light_tracer_records_what_make_fx_traces(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    light = _graphs(path, memo=False)
    monkeypatch.setattr(torch_capture, "_recorded", lambda *args: None)  # make_fx only
    assert light == _graphs(path, memo=False)


def test_memoized_calls_recorded_as_make_fx_traces_them(monkeypatch: pytest.MonkeyPatch) -> None:
    light = _graphs("examples/llama_tp.py", memo=True)
    monkeypatch.setattr(torch_capture, "_recorded", lambda *args: None)
    traced = _graphs("examples/llama_tp.py", memo=True)
    assert [[row[0] for row in g] for g in light] == [[row[0] for row in g] for g in traced]
    assert any(row[0] == "call" for row in light[1])
