"""Facts about a graph that depend only on its structure: computed once for all the ranks of a
rank class (partition/rank_classes), whose graphs differ only in the attrs of some nodes.

At world size 64 a per-rank scan of a 126-layer program (its calls, its collectives) costs as much
as the proof of its one distinct layer."""

from __future__ import annotations

from typing import Any, Callable, Hashable, TypeVar
from weakref import WeakKeyDictionary

from shardproof.ir.graph import Graph

T = TypeVar("T")
_FACTS: WeakKeyDictionary[Any, dict[Hashable, Any]] = WeakKeyDictionary()


def structural(graph: Graph, fact: Hashable, compute: Callable[[Graph], T]) -> T:
    """`compute(graph)`, which must read only ops, inputs and shapes, once per structure."""
    if graph.structure is None:
        return compute(graph)
    facts = _FACTS.setdefault(graph.structure, {})
    if fact not in facts:
        facts[fact] = compute(graph)
    return facts[fact]
