"""Facts about a structure are computed once for all the graphs that share it, and graphs made alike
from them (cut after a call, calls expanded) share a structure of their own."""

from __future__ import annotations

from shardproof.ir.graph import Graph
from shardproof.partition.structure import derived, structural


class _Shape:
    """A structure token, as a rank class is one."""


def _graph(structure: object | None) -> Graph:
    graph = Graph(structure=structure)
    graph.add("leaf", (), ("x",), (2,), "float32", "x")
    return graph


def test_a_fact_is_computed_once_per_structure_and_every_time_without_one() -> None:
    computed: list[int] = []

    def count_nodes(graph: Graph) -> int:
        computed.append(1)
        return len(graph.nodes)

    shared = _Shape()
    assert [structural(_graph(shared), "nodes", count_nodes) for _ in range(3)] == [1, 1, 1]
    assert len(computed) == 1
    assert [structural(_graph(None), "nodes", count_nodes) for _ in range(2)] == [1, 1]
    assert len(computed) == 3


def test_the_same_change_to_one_structure_gives_one_derived_structure() -> None:
    shared, other = _Shape(), _Shape()
    assert derived(shared, ("through", 3)) is derived(shared, ("through", 3))
    assert derived(shared, ("through", 3)) is not derived(shared, ("through", 4))
    assert derived(shared, ("through", 3)) is not derived(other, ("through", 3))
    assert derived(None, ("through", 3)) is None
