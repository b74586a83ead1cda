"""Ranks whose programs are one trace: a graph with symbolic ints, valid where its guards hold.

Tracing every rank's Python costs the same per rank (a 126-layer loader and forward: ~0.25 s), so
world size 64 cost 8x world size 8. A `RankClass` is the trace of one rank with the rank kept
symbolic (capture/symbolic_rank): every rank whose guards hold runs exactly that program with its
own offsets, and gets its graph by evaluating them (`at`), in milliseconds. A rank whose guards
fail (a bug on rank 3 only: `if rank == 3`) is traced again and starts a class of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from shardproof.ir.graph import Graph, Node
from shardproof.ir.rank_expr import Guard, at_rank, mentions_rank
from shardproof.partition.templates import Template


@dataclass
class RankClass:
    graph: Graph  # traced at one rank, symbolic ints in its attrs (and in its templates')
    guards: frozenset[Guard]
    _symbolic: list[int] | None = field(default=None, repr=False)  # ids of nodes to evaluate per rank
    _templates: dict[tuple[int, int], Template] = field(default_factory=dict, repr=False)
    _known: dict[int, bool] = field(default_factory=dict, repr=False)  # template id -> mentions the rank

    def covers(self, rank: int) -> bool:
        return all(guard.holds(rank) for guard in self.guards)

    def at(self, rank: int) -> Graph:
        """The graph of `rank` (which the class covers)."""
        if self._symbolic is None:
            self._symbolic = _symbolic_nodes(self.graph, self._known)
        return self._graph_at(self.graph, self._symbolic, rank)

    def _graph_at(self, graph: Graph, symbolic: list[int], rank: int) -> Graph:
        nodes = list(graph.nodes)
        for i in symbolic:
            node = nodes[i]
            if node.op == "call":
                nodes[i] = replace(node, attrs=(self._template_at(node.attrs[0], rank), *node.attrs[1:]))
            else:
                nodes[i] = replace(node, attrs=at_rank(node.attrs, rank))
        return Graph(nodes, list(graph.outputs), rank)

    def _template_at(self, template: Template, rank: int) -> Template:
        key = (id(template), rank)
        if key not in self._templates:
            graph = self._graph_at(template.graph, _symbolic_nodes(template.graph, self._known), rank)
            self._templates[key] = Template(template.module, graph, template.site, template.gradient_of)
        return self._templates[key]


def _symbolic_nodes(graph: Graph, known: dict[int, bool]) -> list[int]:
    """Ids of the nodes whose attrs mention the rank, directly or in the template they call."""
    return [node.id for node in graph.nodes if _mentions(node, known)]


def _mentions(node: Node, known: dict[int, bool]) -> bool:
    if node.op != "call":
        return mentions_rank(node.attrs)
    template = node.attrs[0]
    if id(template) not in known:
        known[id(template)] = any(_mentions(n, known) for n in template.graph.nodes)
    return known[id(template)]
