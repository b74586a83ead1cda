"""Lock-step execution of rank graphs over process sub-groups (2-D meshes)."""

from __future__ import annotations

from fractions import Fraction

import pytest

from shardproof.ir.graph import Graph
from shardproof.relations.execute import CollectiveMismatch, execute

TP = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
DP = {0: (0, 2), 1: (1, 3), 2: (0, 2), 3: (1, 3)}


def _rank(rank: int, groups: list[dict[int, tuple[int, ...]]]) -> Graph:
    """Rank `rank` reads its own leaf, then all-reduces it over each group in turn."""
    graph = Graph(rank=rank)
    value = graph.add("leaf", (), (f"input:{rank}",), (2,), "float32", "x")
    for group in groups:
        value = graph.add("all_reduce", (value,), ("sum", group[rank]), (2,), "float32", "reduce")
    graph.outputs = [value]
    return graph


def test_tensor_then_data_parallel_reductions_interleave() -> None:
    """Rank 0 reaches its DP all-reduce while rank 2 still waits in its TP one: the TP group of
    ranks 2 and 3 goes first, then the DP groups; every rank ends with the sum of all four."""
    run = execute(Graph(), [_rank(r, [TP, DP]) for r in range(4)])
    leaves = sorted(run.rules.leaf(f"input:{r}", (2,), "float32") for r in range(4))
    everything = run.rules.lin([(t, Fraction(1)) for t in leaves])
    assert [terms[-1] for terms in run.ranks] == [everything] * 4


def test_a_cycle_of_waiting_groups_is_a_mismatch() -> None:
    """Each rank waits for a peer that waits in another group: real ranks would hang."""
    orders = {0: [DP, TP], 1: [TP, DP], 2: [TP, DP], 3: [DP, TP]}
    with pytest.raises(CollectiveMismatch, match="rank 0 calls all_reduce over ranks \\[0, 2\\]"):
        execute(Graph(), [_rank(r, orders[r]) for r in range(4)])


def test_one_collective_for_tensors_of_other_shapes_is_a_mismatch() -> None:
    """Rank 1 all-gathers a tensor twice as wide as rank 0's: a real run fails, however the
    concatenation would read."""
    graphs = []
    for rank, width in enumerate((2, 4)):
        graph = Graph(rank=rank)
        value = graph.add("leaf", (), (f"input:{rank}",), (width,), "float32", "x")
        graph.outputs = [graph.add("all_gather", (value,), (0, (0, 1)), (2 * width,), "float32", "gathered")]
        graphs.append(graph)
    with pytest.raises(CollectiveMismatch, match=r"rank 0 calls all_gather over ranks \[0, 1\] for a tensor of shape "
                                                 r"\(4,\) but rank 1 calls all_gather over ranks \[0, 1\] for a tensor of shape \(8,\)"):
        execute(Graph(), graphs)
