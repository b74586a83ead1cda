"""A reduction over too few ranks, or one missing upstream: which to name. A part of `Diagnoser`.

A sum over ranks that a collective leaves partial (its group lacks ranks holding shares) is fixed
either by widening its group or by the all-reduce the shares missed where they were made. When the
shares went through further computation on the way (a tensor-parallel input gradient through the
norm's backward into its weight's gradient, then the data-parallel all-reduce of every gradient),
the collective is right for what it reduces and the missing all-reduce belongs where they were
made: the program's own tensor-parallel reduction, deleted. Only the site and the kind's wording
change; the partial sum found is the same.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.agreement import LAYOUT_OPS
from shardproof.relations.diagnose.finding import Finding
from shardproof.report.terms import line_of, placement, value_name


class UpstreamReductions:
    """A partial sum that reaches a collective of too narrow a group after further computation."""

    def _reduced_too_late(self, rank: int, collective: Node) -> Finding | None:
        """The missing all-reduce where the shares reaching `collective` (a reduction over too few
        ranks) were made, when they were computed with after that (not only moved, scaled by a
        number or added up) and the collective's group lacks ranks holding them."""
        graph = self.ranks[rank]
        operand = graph[collective.inputs[0]]
        point = self._reduction_point(rank, operand)
        if point is None:
            return None
        group = list(collective.attrs[-1])
        holders = self._reduction_group(rank, point)
        after = [n for n in self._partial_chain(rank, operand) if n.id > point.id]
        if len(holders) < 2 or set(holders) <= set(group) or not any(self._computes_with(rank, n) for n in after):
            return None
        kind = self.partial_kind([self.run.ranks[rank][point.id]])
        origin = self._piece_origin(rank, operand)
        made = [point] + ([origin] if origin is not None and origin.id != point.id else [])
        return Finding(
            "discrepancy",
            "missing reduction",
            f"missing reduction: {value_name(point)} at {line_of(point)} is a {kind} (`{placement(kind)}`: each of "
            f"ranks {holders} holds only its share) that is computed with unreduced; `{collective.op}` over ranks "
            f"{group} at {line_of(collective)} adds up only part of what it became",
            [*((rank, n) for n in made), (rank, collective)],
            op=point.op,
            fix=self._reduction_fix(rank, operand, kind),
        )

    def _computes_with(self, rank: int, node: Node) -> bool:
        """Whether `node` combines a partial value with another value held whole that is no constant."""
        if node.op in LAYOUT_OPS:
            return False
        terms, graph = self.run.ranks[rank], self.ranks[rank]
        return any(not self.partial(terms[i]) and graph[i].op != "const" for i in node.inputs)
