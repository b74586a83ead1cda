"""Layouts: the shape rule shared with `shardproof verify`'s default loader, and cutting real
tensors the way the IR cuts them."""

from __future__ import annotations

import torch

from shardproof.ir.build import GraphBuilder
from shardproof.ir.graph import Graph
from shardproof.ir.run import run_graph
from shardproof.layouts import Layout, cut, plain_layout, take


def test_shapes_alone_give_a_replica_or_a_plain_chunk_or_nothing() -> None:
    assert plain_layout((4, 8), (4, 8), 2) == Layout("replicate")
    assert plain_layout((4, 8), (4, 2), 4) == Layout("shard", 1, (0, 8))
    assert plain_layout((12,), (3,), 2, (1, 2)) == Layout("shard", 0, (0, 12), (1, 2))
    assert plain_layout((4, 8), (2, 4), 2) is None  # two dims differ
    assert plain_layout((4, 8), (4, 3), 2) is None  # not a world-size fraction


def test_take_cuts_a_tensor_as_the_ir_does() -> None:
    full = torch.randn(6, 12, dtype=torch.float64)
    for layout in (Layout("replicate"), Layout("shard", 1, (0, 12)), Layout("shard", 1, (0, 8, 10, 12)), Layout("shard", 0, (0, 6), (1, 3))):
        for rank in range(2):
            graph = Graph()
            b = GraphBuilder(graph)
            leaf = graph.add("leaf", (), ("x",), full.shape, "float64", "x")
            graph.outputs = [cut(b, leaf, layout, rank, 2)]
            (want,) = run_graph(graph, {"x": full})
            torch.testing.assert_close(take(full, layout, rank, 2), want)
    assert torch.equal(take(full, Layout("shard", 1, (0, 12)), 1, 2), full.chunk(2, 1)[1])


def test_blocks_cut_into_fewer_chunks_than_ranks_are_replicated_over_consecutive_ranks() -> None:
    """QKV [0:8) [8:10) [10:12) over 4 ranks, q in 4 chunks, k and v in 2: rank r holds q chunk r
    and kv chunk r // 2, and the layout fits the rank's 4 columns only."""
    layout = Layout("shard", 1, (0, 8, 10, 12), parts=(4, 2, 2))
    assert [layout.regions(r, 4) for r in range(4)] == [
        [(0, 2), (8, 9), (10, 11)], [(2, 4), (8, 9), (10, 11)], [(4, 6), (9, 10), (11, 12)], [(6, 8), (9, 10), (11, 12)],
    ]
    assert layout.fits((3, 12), (3, 4), 4) and not layout.fits((3, 12), (3, 3), 4)
    assert "cut in [4, 2, 2] chunks" in layout.describe()
