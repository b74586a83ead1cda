"""Positions used along another dim than the one they were found along: an argmax (or argmin)
over dim d yields positions in [0, size of d); a gather (`take_along_dim`) that picks with them
along another dim reads positions of an axis they do not index (the ranks' stack of candidates
read along the vocabulary, say). A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.report.terms import line_of, value_name

ARG_REDUCTIONS = ("argmax", "argmin")
_CARRYING = {"expand", "view", "slice", "convert", "aten.remainder.Scalar"}  # keep an index's values (take_along_dim's wrap)


class IndexAxes:
    def _index_along_other_dim(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first gather of the chain whose index is an argmax over another dim, kept (keepdim)."""
        graph = self.ranks[rank]
        for node in chain:
            if node.op != "gather":
                continue
            source = graph[node.inputs[1]]
            while source.op in _CARRYING:
                source = graph[source.inputs[0]]
            if source.op not in ARG_REDUCTIONS or len(source.attrs[0]) != 1 or not source.attrs[1]:
                continue
            ndim = len(source.shape)
            found, used = source.attrs[0][0] % ndim, node.attrs[0] % ndim
            if found == used:
                continue
            positions = value_name(source)
            return Finding(
                "discrepancy",
                "wrong layout",
                f"wrong layout: `{node.op}` at {line_of(node)} picks along dim {used} with {positions}, positions the "
                f"`{source.op}` at {line_of(source)} found along dim {found}: they index another axis",
                [(rank, node), (rank, source)],
                op=node.op,
                fix=f"pick along dim {found}, the dim the positions were found along, at {line_of(node)}",
            )
        return None
