"""Hand lowerings of `ir/from_fx.py` compute what torch computes (each lowered graph run on real values)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardproof.ir.from_fx import Lowerer
from shardproof.ir.run import run_graph


@pytest.mark.parametrize("spelling", ["index_select", "index"])
@pytest.mark.parametrize("rows", [[1, 0], [3, 2, 1, 0], [2, 3, 0, 1], [0, 0, 2], [3, 1], [2]])
def test_rows_picked_at_constant_indices_lower_to_slices_of_the_rows(rows: list[int], spelling: str) -> None:
    """The ranks' blocks of an all-gathered tensor put back in order by a constant permutation
    (`x.index_select(1, idx)` or `x[:, idx]`): a cat of slices, one per run of consecutive rows, and
    no open op left."""
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    index = torch.tensor(rows)
    pick = (lambda t: t.index_select(1, index)) if spelling == "index_select" else (lambda t: t[:, index])
    program = make_fx(lambda t: pick(t) * 2)(x)
    graph = Lowerer(program, ["x"], lambda node: None, [], lambda group: (), None).run()
    assert not any(node.op.startswith("aten.") for node in graph.nodes)
    (lowered,) = run_graph(graph, {"x": x})
    torch.testing.assert_close(lowered, pick(x) * 2)


@pytest.mark.parametrize("shape", [(5,), (5, 3), (5, 3, 2)])
def test_rows_at_integer_ids_lower_to_an_embedding_of_the_rows_flattened(shape: tuple[int, ...]) -> None:
    """`x[ids]` (a stack of expert weights read per routing slot): an embedding of x's rows, with
    whatever trailing dims they have, and no open op left."""
    x = torch.randn(*shape, dtype=torch.float64)
    ids = torch.tensor([[4, 0], [2, 2], [1, 3]])
    program = make_fx(lambda t, i: t[i] * 2)(x, ids)
    graph = Lowerer(program, ["x", "ids"], lambda node: None, [], lambda group: (), None).run()
    assert "embedding" in {node.op for node in graph.nodes}
    assert not any(node.op.startswith("aten.") for node in graph.nodes)
    (lowered,) = run_graph(graph, {"x": x, "ids": ids})
    torch.testing.assert_close(lowered, x[ids] * 2)
