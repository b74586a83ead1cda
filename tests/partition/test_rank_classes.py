"""A rank class's graph at a rank: the nodes that depend on the rank evaluated there (in templates
too), every other node the class's own, read lazily."""

from __future__ import annotations

from shardproof.ir.graph import Graph
from shardproof.ir.rank_expr import RankExpr, recording
from shardproof.partition.rank_classes import RankClass
from shardproof.partition.templates import Template


def _class() -> RankClass:
    with recording() as guards:
        rank = RankExpr.symbol(0)
        offset = rank * 4
        body = Graph()
        arg = body.add("leaf", (), ("arg:0",), (16,), "float32", "arg")
        body.add("slice", (arg,), (0, offset, offset + 4), (4,), "float32", "piece")
        body.outputs = [1]
        template = Template("part", body)
        graph = Graph()
        x = graph.add("leaf", (), ("state:w",), (16,), "float32", "w")
        graph.add("slice", (x,), (0, offset, offset + 4), (4,), "float32", "shard")
        graph.add("call", (x,), (template, 0, "part"), (4,), "float32", "call")
        graph.add("neg", (1,), (), (4,), "float32", "neg")
        graph.outputs = [3]
        assert rank < 4  # a guard: the class covers ranks 0..3
    return RankClass(graph, frozenset(guards))


def test_a_rank_reads_its_offsets_and_shares_the_rest() -> None:
    cls = _class()
    assert [cls.covers(r) for r in range(6)] == [True] * 4 + [False] * 2
    for rank in range(4):
        graph = cls.at(rank)
        assert graph.rank == rank and graph.structure is cls
        assert graph.nodes[1].attrs == (0, 4 * rank, 4 * rank + 4)
        assert graph.nodes[2].attrs[0].graph.nodes[1].attrs == (0, 4 * rank, 4 * rank + 4), "in the template too"
        assert graph.nodes[0] is cls.graph.nodes[0] and graph.nodes[3] is cls.graph.nodes[3], "not copied"
        assert [n.op for n in graph.nodes] == ["leaf", "slice", "call", "neg"]
    assert cls.at(2).nodes[2].attrs[0] is cls.at(2).nodes[2].attrs[0], "one template per rank"
