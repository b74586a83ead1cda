"""Masked lookups whose mask disagrees with the shard they read: a rank looks up rows [lo, hi) of a
vocab-parallel table but lets another range of ids through its mask (an off-by-one `<=`, a wrong
offset). Summed over ranks, the ids the ranges overlap at are counted twice (at a clamped, wrong
row) and those they leave out never: overlapping shards, found at the mask's line, or at the
loader's slice where the mask holds the rank's own ids and the table is another rank's rows. A part
of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.rules.masks import range_masks
from shardproof.report.terms import describe, line_of

def _own(rank: int, span: tuple[int, int], size: int) -> bool:
    """`span` is chunk `rank` of [0, size) cut into chunks of its width."""
    lo, hi = span
    return hi > lo and size % (hi - lo) == 0 and lo == rank * (hi - lo)


# lookups: the table operand and the axis it is read along
_TABLE_AXIS = {"embedding": lambda node: 0, "gather": lambda node: node.attrs[0]}


class MaskedLookups:
    """A lookup into a region of a reference table, masked to another range of ids."""

    def _mismatched_lookup_mask(self, rank: int, chain: list[Node]) -> Finding | None:
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for lookup in (n for n in chain if n.op in _TABLE_AXIS):
            axis = _TABLE_AXIS[lookup.op](lookup)
            root, box = self.r.as_region(terms[lookup.inputs[0]])
            rows = box[axis]
            if root == terms[lookup.inputs[0]] or not self.region_of_reference(root):
                continue
            for user in (n for n in chain if n.id > lookup.id):
                masks = range_masks(self.r, terms[user.id])
                fitting = {mask for mask, (_, lo, hi, _) in masks if (lo, hi) == rows}  # (one test of a bound reads both ways)
                for mask, (_, lo, hi, _) in masks:
                    if mask in fitting or not self._reads(graph, user, lookup):
                        continue
                    size = self.r.shape(root)[axis]
                    if _own(rank, (lo, hi), size) and not _own(rank, rows, size):  # the table is the wrong shard
                        cut = self._loader_slice(rank, graph[lookup.inputs[0]], unnatural=True)
                        if cut is not None:
                            return self._table_finding(rank, cut, lookup, root, rows, (lo, hi))
                    culprit = next((n for n in graph.nodes if terms[n.id] == mask), user)
                    return self._mask_finding(rank, culprit, lookup, root, axis, rows, (lo, hi))
        return None

    def _table_finding(self, rank: int, cut: Node, lookup: Node, root: int, rows: tuple[int, int],
                       ids: tuple[int, int]) -> Finding:
        table = describe(self.r.u, root, 1)
        message = (
            f"overlapping shards: on rank {rank}, a lookup masked to its own ids [{ids[0]}:{ids[1]}) reads rows "
            f"[{rows[0]}:{rows[1]}) of `{table}`: the checkpoint loader cut another rank's shard of it"
        )
        return Finding("discrepancy", "overlapping shards", message, [(rank, cut), (rank, lookup)],
                       fix=f"cut rows [{ids[0]}:{ids[1]}) of `{table}` for rank {rank} at {line_of(cut)}")

    def _reads(self, graph, user: Node, lookup: Node) -> bool:
        return lookup.id in {n.id for n in graph.ancestors(user)}

    def _mask_finding(self, rank: int, mask: Node, lookup: Node, root: int, axis: int, rows: tuple[int, int],
                      ids: tuple[int, int]) -> Finding:
        (lo, hi), (id_lo, id_hi) = rows, ids
        beyond = [f"[{a}:{b})" for a, b in ((id_lo, min(id_hi, lo)), (max(id_lo, hi), id_hi)) if a < b]
        missed = [f"[{a}:{b})" for a, b in ((lo, min(hi, id_lo)), (max(lo, id_hi), hi)) if a < b]
        table = describe(self.r.u, root, 1)
        said = [f"ids {', '.join(beyond)} belong to rows other ranks hold, so they are counted twice" if beyond else "",
                f"ids {', '.join(missed)} of its own rows are masked out, so no rank counts them" if missed else ""]
        message = (
            f"overlapping shards: on rank {rank}, the mask lets ids [{id_lo}:{id_hi}) through to a lookup into rows "
            f"[{lo}:{hi}) of `{table}`: " + "; ".join(s for s in said if s)
        )
        return Finding("discrepancy", "overlapping shards", message, [(rank, mask), (rank, lookup)],
                       fix=f"mask ids to [{lo}:{hi}), the rows rank {rank} holds, at {line_of(mask)}")
