"""ir/check.py: a node against its operands, by its op's meta kernel; collectives and constants by their meaning."""

from __future__ import annotations

import pytest

from shardproof.ir.aten_ops import Operand
from shardproof.ir.check import Inconsistent, check_node
from shardproof.ir.graph import Graph


def _graph(*shapes: tuple[int, ...]) -> Graph:
    graph = Graph()
    for i, shape in enumerate(shapes):
        graph.add("leaf", (), (f"x{i}",), shape, "float32", f"x{i}")
    return graph


@pytest.mark.parametrize(
    "op, inputs, attrs, shape",
    [
        ("matmul", (0, 1), (), (2, 4)),
        ("view", (0,), ((6,),), (6,)),
        ("all_gather", (0,), (0, (0, 1)), (4, 3)),
        ("reduce_scatter", (0,), (0, "sum", (0, 1)), (1, 3)),
        ("all_reduce", (0,), ("sum", (0, 1)), (2, 3)),
        ("aten.cumsum.default", (0,), ((Operand(0), 1), (), ()), (2, 3)),
    ],
)
def test_consistent_nodes_pass(op: str, inputs: tuple, attrs: tuple, shape: tuple) -> None:
    graph = _graph((2, 3), (3, 4))
    check_node(graph, graph[graph.add(op, inputs, attrs, shape, "float32", "y")])


@pytest.mark.parametrize(
    "op, inputs, attrs, shape, expected",
    [
        ("matmul", (0, 1), (), (2, 5), "shape [2, 4], as `matmul` computes from [2, 3], [3, 4], not [2, 5]"),
        ("matmul", (0, 0), (), (2, 3), "operands that `matmul` accepts, but [2, 3], [2, 3] do not fit"),
        ("view", (0,), ((7,),), (7,), "operands that `view` accepts"),
        ("exp", (0, 1), (), (2, 3), "1 operand for `exp`, not 2"),
        ("all_gather", (0,), (0, (0, 1)), (2, 3), "shape [4, 3], as `all_gather` computes"),
        ("reduce_scatter", (1,), (0, "sum", (0, 1, 2, 3, 4, 5)), (1, 4), "dim 0 of [3, 4] divisible by the 6 ranks"),
        ("const", (), (("values", (1.0, 2.0)),), (3,), "3 values for a constant of shape [3], not 2"),
    ],
)
def test_a_node_its_operands_do_not_fit_is_inconsistent(op: str, inputs: tuple, attrs: tuple, shape: tuple, expected: str) -> None:
    graph = _graph((2, 3), (3, 4))
    node = graph[graph.add(op, inputs, attrs, shape, "float32", "y")]
    with pytest.raises(Inconsistent) as err:
        check_node(graph, node)
    assert str(err.value).startswith(expected), str(err.value)
