"""Ranks whose programs are one trace: a graph with symbolic ints, valid where its guards hold.

Tracing every rank's Python costs the same per rank (a 126-layer loader and forward: ~0.25 s), so
world size 64 cost 8x world size 8. A `RankClass` is the trace of one rank with the rank kept
symbolic (capture/symbolic_rank): every rank whose guards hold runs exactly that program with its
own offsets, and gets its graph by evaluating them (`at`), in milliseconds. A rank whose guards
fail (a bug on rank 3 only: `if rank == 3`) is traced again and starts a class of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Sequence, overload

from shardproof.ir.graph import Graph, Node
from shardproof.ir.rank_expr import Guard, at_rank, mentions_rank
from shardproof.partition.templates import Template


@dataclass(eq=False)
class RankClass:
    graph: Graph  # traced at one rank, symbolic ints in its attrs (and in its templates')
    guards: frozenset[Guard]
    _symbolic: set[int] | None = field(default=None, repr=False)
    _templates: dict[tuple[int, int], Template] = field(default_factory=dict, repr=False)
    _known: dict[int, bool] = field(default_factory=dict, repr=False)  # template id -> mentions the rank

    def covers(self, rank: int) -> bool:
        return all(guard.holds(rank) for guard in self.guards)

    def at(self, rank: int) -> Graph:
        """The graph of `rank` (which the class covers); its nodes are evaluated when read."""
        return Graph(_RankNodes(self, rank), list(self.graph.outputs), rank, structure=self)

    @property
    def symbolic(self) -> set[int]:
        """Ids of the graph's nodes that depend on the rank."""
        if self._symbolic is None:
            self._symbolic = {node.id for node in self.graph.nodes if self._mentions(node)}
        return self._symbolic

    def node_at(self, node: Node, rank: int) -> Node:
        if node.op == "call":
            return replace(node, attrs=(self._template_at(node.attrs[0], rank), *node.attrs[1:]))
        return replace(node, attrs=at_rank(node.attrs, rank))

    def _template_at(self, template: Template, rank: int) -> Template:
        key = (id(template), rank)
        if key not in self._templates:
            body = template.graph
            nodes = [self.node_at(n, rank) if self._mentions(n) else n for n in body.nodes]
            graph = Graph(nodes, list(body.outputs), rank)
            self._templates[key] = Template(template.module, graph, template.site, template.gradient_of)
        return self._templates[key]

    def _mentions(self, node: Node) -> bool:
        """Whether the node's attrs depend on the rank, directly or in the template it calls."""
        if node.op != "call":
            return mentions_rank(node.attrs)
        template = node.attrs[0]
        if id(template) not in self._known:
            self._known[id(template)] = any(self._mentions(n) for n in template.graph.nodes)
        return self._known[id(template)]


class _RankNodes(Sequence[Node]):
    """A rank's nodes: the class's, with those that depend on the rank evaluated on first read
    (64 ranks of a 126-layer model would otherwise copy a million nodes)."""

    def __init__(self, owner: RankClass, rank: int):
        self.owner, self.rank = owner, rank
        self.base = owner.graph.nodes
        self.evaluated: dict[int, Node] = {}

    def __len__(self) -> int:
        return len(self.base)

    @overload
    def __getitem__(self, index: int) -> Node: ...
    @overload
    def __getitem__(self, index: slice) -> list[Node]: ...

    def __getitem__(self, index: int | slice) -> Node | list[Node]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self.base)))]
        node = self.base[index]
        if node.id not in self.owner.symbolic:
            return node
        if node.id not in self.evaluated:
            self.evaluated[node.id] = self.owner.node_at(node, self.rank)
        return self.evaluated[node.id]

    def __iter__(self) -> Iterator[Node]:
        return (self[i] for i in range(len(self.base)))

