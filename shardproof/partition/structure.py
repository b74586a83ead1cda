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
_DERIVED: WeakKeyDictionary[Any, dict[Hashable, "Derived"]] = WeakKeyDictionary()


class Derived:
    """The structure of graphs made from graphs of one structure by one change (cut after a call,
    some calls expanded): the graphs made alike from a rank class's still share their structure."""


def derived(structure: Any, change: Hashable) -> Derived | None:
    if structure is None:
        return None
    return _DERIVED.setdefault(structure, {}).setdefault(change, Derived())


def structural(graph: Graph, fact: Hashable, compute: Callable[[Graph], T]) -> T:
    """`compute(graph)`, which must read only ops, inputs and shapes, once per structure."""
    if graph.structure is None:
        return compute(graph)
    facts = _FACTS.setdefault(graph.structure, {})
    if fact not in facts:
        facts[fact] = compute(graph)
    return facts[fact]
