"""The light tracer records forward programs as make_fx does: the same IR, op for op and line for line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import shardproof.capture.torch_capture as torch_capture
from shardproof.capture.torch_capture import capture
from shardproof import verify
from shardproof.capture.dispatch_trace import record
from shardproof.case import Case, load_case
from shardproof.errors import CaptureError
from shardproof.oracle import run_numeric
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


def test_dtensor_programs_recorded_on_their_local_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """DTensor's own scalar constants (its embedding's masking fill) are located at the user's
    line by the light tracer and nowhere by make_fx; everything else is the same."""

    def unlocated_constants(graphs: list[list[tuple]]) -> list[list[tuple]]:
        return [[row[:-1] + (None,) if row[0] == "const" else row for row in g] for g in graphs]

    light = _graphs("examples/llama_dtensor.py", memo=False)
    monkeypatch.setattr(torch_capture, "_recorded", lambda *args: None)
    assert unlocated_constants(light) == unlocated_constants(_graphs("examples/llama_dtensor.py", memo=False))


def test_memoized_calls_recorded_as_make_fx_traces_them(monkeypatch: pytest.MonkeyPatch) -> None:
    light = _graphs("examples/llama_tp.py", memo=True)
    monkeypatch.setattr(torch_capture, "_recorded", lambda *args: None)
    traced = _graphs("examples/llama_tp.py", memo=True)
    assert [[row[0] for row in g] for g in light] == [[row[0] for row in g] for g in traced]
    assert any(row[0] == "call" for row in light[1])


def test_flex_attention_is_recorded_as_its_dense_math() -> None:
    """A higher-order op is recorded through its dense implementation, the one torch runs on the
    CPU: plain aten ops, no HOP."""
    q, k, v = (torch.randn(1, 2, 4, 3) for _ in range(3))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, q.shape[2], k.shape[2], device="cpu")
        return [flex_attention(q, k, v, block_mask=mask)]

    with torch.compiler.set_stance("force_eager"):  # flex_attention compiles itself in eager mode
        traced, _ = record(attend, [q, k, v])
    targets = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert "aten.bmm.default" in targets or "aten.matmul.default" in targets or "aten.mm.default" in targets
    assert not any("flex" in t for t in targets)


_doubled = torch.compile(lambda x: x * 2, fullgraph=True)


class _Compiled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _doubled(self.up(x))


@pytest.mark.parametrize("mode", ["forward", "train"])  # the light tracer, make_fx
def test_compiled_code_is_traced_as_the_eager_code_it_compiles(mode: str) -> None:
    case = Case(_Compiled, lambda rank, n: _Compiled(), lambda: (torch.randn(3, 4),), loss=lambda out, x: out.sum())
    assert verify(case, world_size=2, train=mode == "train").verdict == "equivalent"
    assert run_numeric(case, 2, mode=mode).agree


def test_an_input_given_twice_stays_one_tensor() -> None:
    """A tied embedding and head are one tensor under two names: both names read it alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tied = torch.empty(4, 3)
        traced, _ = record(lambda a, b: [a * 2 if a is b else a + b], [tied, tied])
    ops = [n for n in traced.graph.nodes if n.op == "call_function"]
    assert [n.target for n in ops] == [torch.ops.aten.mul.Tensor]


def test_a_tensor_returned_twice_stays_one_tensor() -> None:
    """A loader returning a tied embedding and head (one tensor under two names) hands make_fx
    one tensor, as functional_call requires of tied names."""
    weight = torch.randn(4, 3)
    _, outputs = record(lambda w: [w * 2] * 2, [weight])
    assert outputs[0] is outputs[1]


def test_a_value_computed_from_the_data_is_never_read_from_uninitialised_memory() -> None:
    """A cpu `torch.zeros` made in the traced code, with meta values scattered into it, comes out
    a real tensor of uninitialised memory: its `.tolist()` must stop the trace (rerun on fake
    tensors), not steer it by garbage (a routing's split sizes, say)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    def counts(ids: torch.Tensor) -> list[torch.Tensor]:
        per_expert = torch.zeros(4, dtype=torch.long).scatter_add(0, ids, torch.ones_like(ids))
        return [ids[: per_expert[0].item()]]

    with FakeTensorMode(), pytest.raises(DataDependentOutputException):
        record(counts, [torch.empty(8, dtype=torch.long)])


class _CountBranch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = (x[:1] > 0).long() * 0
        count = torch.zeros(1, dtype=torch.long).scatter_add(0, index, torch.ones_like(index))
        return x if count.item() == 1 else -x  # count is 1: x


class _Negated(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return -x


def test_a_branch_on_a_value_computed_from_the_data_is_not_proven() -> None:
    """Steered by uninitialised memory, the trace took the other branch and proved it equal to -x."""
    case = Case(_Negated, lambda rank, n: _CountBranch(), lambda: (torch.randn(4),))
    assert not run_numeric(case, 1).agree
    with pytest.raises(CaptureError, match=r"(?s)(DataDependentOutputException|GuardOnDataDependentSymNode).*count.item\(\) == 1"):
        verify(case, world_size=1)
