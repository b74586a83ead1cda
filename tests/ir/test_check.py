"""ir/check.py: a node against its operands, by its op's meta kernel; collectives and constants by their meaning;
elementwise ops and `cat` by the shapes torch computes for them, without loading torch._dynamo."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

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
        ("add", (0, 1), (), (2, 3), "operands that `add` accepts, but [2, 3], [3, 4] do not broadcast"),
        ("cat", (0, 1), (0,), (5, 3), "operands that `cat` accepts, but [2, 3], [3, 4] differ in other dims than 0"),
        ("mul", (0, 0), (), (2, 1), "shape [2, 3], as `mul` computes"),
    ],
)
def test_a_node_its_operands_do_not_fit_is_inconsistent(op: str, inputs: tuple, attrs: tuple, shape: tuple, expected: str) -> None:
    graph = _graph((2, 3), (3, 4))
    node = graph[graph.add(op, inputs, attrs, shape, "float32", "y")]
    with pytest.raises(Inconsistent) as err:
        check_node(graph, node)
    assert str(err.value).startswith(expected), str(err.value)


SHAPES = [((2, 3), (3, 1, 3)), ((4, 1), (1, 5)), ((), (2, 2)), ((3,), (3,))]


@pytest.mark.parametrize("a, b", SHAPES)
@pytest.mark.parametrize("op", ["add", "lt", "aten.pow.Tensor_Tensor"])
def test_elementwise_shapes_are_what_torch_computes(a: tuple, b: tuple, op: str) -> None:
    expected = tuple(torch.pow(torch.ones(a), torch.ones(b)).shape)
    graph = _graph(a, b)
    attrs = ((Operand(0), Operand(1)), (), ()) if op.startswith("aten.") else ()
    check_node(graph, graph[graph.add(op, (0, 1), attrs, expected, "float32", "y")])


@pytest.mark.parametrize("a, b, dim", [((2, 3), (4, 3), 0), ((2, 3), (2, 1), 1), ((1, 2, 3), (1, 2, 0), 2)])
def test_cat_shapes_are_what_torch_computes(a: tuple, b: tuple, dim: int) -> None:
    graph = _graph(a, b)
    check_node(graph, graph[graph.add("cat", (0, 1), (dim,), tuple(torch.cat([torch.ones(a), torch.ones(b)], dim).shape), "float32", "y")])


def test_checking_elementwise_ops_and_cat_leaves_torch_dynamo_unloaded() -> None:
    """Their meta kernels are Python references whose first call imports torch._dynamo (seconds)."""
    code = (
        "import sys; from test_check import _graph; from shardproof.ir.check import check_node\n"
        "g = _graph((2, 3), (2, 3))\n"
        "for op, attrs in (('add', ()), ('exp', ()), ('cat', (0,))):\n"
        "    check_node(g, g[g.add(op, (0, 1) if op != 'exp' else (0,), attrs, (4, 3) if op == 'cat' else (2, 3), 'float32', 'y')])\n"
        "print('torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=__file__.rsplit("/", 1)[0])
    assert done.stdout.strip() == "False", done.stderr
