"""Constants a dump does not record: the candidate values (identities of the reductions over ranks
they reach), run numerically, and verify-graphs on a vocab-parallel lookup that needs them."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shardproof.importers.constants import reduction_identities
from shardproof.importers.numeric import run_graphs
from shardproof.importers.verify import import_pair, verify_graphs
from shardproof.ir.build import GraphBuilder
from shardproof.ir.graph import Graph

VOCAB, ROWS = 8, 5


def lookup(first: int, last: int, collect: str) -> str:
    """A vocab-parallel lookup as Megatron writes it: out-of-shard targets read row 0, and their
    picked logit is filled with a constant the dump does not show, then the ranks' values meet."""
    local = last - first
    tail = {
        "none": "        return (filled,)",
        "all_reduce": """        all_reduce: "f32[5]" = torch.ops._c10d_functional.all_reduce.default(filled, 'sum', '0')
        wait: "f32[5]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce)
        return (wait,)""",
        "gather_sum": """        all_gather: "f32[10]" = torch.ops._c10d_functional.all_gather_into_tensor.default(filled, 2, '0')
        wait: "f32[10]" = torch.ops._c10d_functional.wait_tensor.default(all_gather)
        view: "f32[2, 5]" = torch.ops.aten.view.default(wait, [2, 5])
        total: "f32[5]" = torch.ops.aten.sum.dim_IntList(view, [0])
        return (total,)""",
    }[collect]
    return f'''class G(torch.nn.Module):
    def forward(self, logits: "f32[5, {local}]", target: "i64[5]"):
        lt: "b8[5]" = torch.ops.aten.lt.Scalar(target, {first})
        ge: "b8[5]" = torch.ops.aten.ge.Scalar(target, {last})
        mask: "b8[5]" = torch.ops.aten.bitwise_or.Tensor(lt, ge)
        sub: "i64[5]" = torch.ops.aten.sub.Tensor(target, {first})
        _tensor_constant0 = self._tensor_constant0
        lift: "i64[]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant0)
        masked: "i64[5]" = torch.ops.aten.index_put.default(sub, [mask], lift)
        arange: "i64[5]" = torch.ops.aten.arange.start(0, 5)
        picked: "f32[5]" = torch.ops.aten.index.Tensor(logits, [arange, masked])
        _tensor_constant1 = self._tensor_constant1
        lift_1: "f32[]" = torch.ops.aten.lift_fresh_copy.default(_tensor_constant1)
        filled: "f32[5]" = torch.ops.aten.index_put.default(picked, [mask], lift_1)
{tail}
'''


def write_pair(tmp_path: Path, collect: str) -> tuple[Path, Path]:
    ref, dist = tmp_path / "ref", tmp_path / "dist"
    ref.mkdir(), dist.mkdir()
    (ref / "fw.g0.r0.py").write_text(lookup(0, VOCAB, "none"))
    half = VOCAB // 2
    for rank in range(2):
        (dist / f"fw.g0.r{rank}.py").write_text(lookup(rank * half, (rank + 1) * half, collect))
    return ref, dist


def test_candidates_are_the_identities_of_the_reductions_reached_nearest_first() -> None:
    graph = Graph(rank=0)
    b = GraphBuilder(graph)
    c = graph.add("leaf", (), ("c",), (), "float32", "c")
    i = graph.add("leaf", (), ("i",), (), "int64", "i")
    x = b.binary("add", c, i)
    near = graph.add("all_reduce", (x,), ("max", (0, 1)), (), "float32", "near")
    graph.add("all_reduce", (b.binary("add", near, x),), ("sum", (0, 1)), (), "float32", "far")
    graph.add("leaf", (), ("unused",), (), "float32", "unused")
    assert reduction_identities(graph, c) == [(-math.inf, "max"), (0, "sum")]
    assert reduction_identities(graph, i) == [(0, "sum")]  # an integer cannot be -inf
    assert reduction_identities(graph, len(graph.nodes) - 1) == []


def test_inferred_fill_values_prove_the_vocab_parallel_lookup_and_are_reported(tmp_path: Path) -> None:
    ref, dist = write_pair(tmp_path, "all_reduce")
    report = verify_graphs(ref, dist)
    assert report.verdict == "equivalent"
    inferred = "= 0 (not recorded in the dumps; inferred: the identity of the `sum` reduction over ranks it reaches)"
    assert f"_tensor_constant1 = _tensor_constant1 {inferred}" in report.inputs
    assert f"_tensor_constant0 = _tensor_constant0 {inferred}" in report.inputs


def test_the_inferred_values_and_only_they_make_the_numbers_agree(tmp_path: Path) -> None:
    pair = import_pair(*write_pair(tmp_path, "all_reduce"))
    layouts = [p.candidates[0] for p in pair.pairs]
    assert [(l.kind, l.value) for l in layouts[2:]] == [("value", 0), ("value", 0)]
    captured = pair.captured(layouts)
    assert run_graphs(captured.reference, captured.ranks, pair.checks).agree
    other = layouts[:3] + [type(layouts[3])("value", value=1.0)]
    captured = pair.captured(other)
    assert not run_graphs(captured.reference, captured.ranks, pair.checks).agree


def test_a_constant_that_reaches_no_reduction_stays_unknown_and_says_so(tmp_path: Path) -> None:
    """Gathered and summed locally: the same numbers, but no reduction over ranks to infer from."""
    report = verify_graphs(*write_pair(tmp_path, "gather_sum"))
    assert report.verdict == "unknown"
    assert "the dumps do not show the values of constants _tensor_constant0, _tensor_constant1" in report.unknown["reason"]


@pytest.mark.parametrize("collect", ["all_reduce", "gather_sum"])
def test_both_pairs_agree_numerically_with_zero_fills(tmp_path: Path, collect: str) -> None:
    pair = import_pair(*write_pair(tmp_path, collect))
    layouts = [p.candidates[0] for p in pair.pairs]
    zeros = layouts[:2] + [type(layouts[2])("value", value=0), type(layouts[3])("value", value=0.0)]
    captured = pair.captured(zeros)
    assert run_graphs(captured.reference, captured.ranks, pair.checks).agree
