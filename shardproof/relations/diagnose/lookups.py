"""Masked lookups whose mask disagrees with the shard they read: a rank looks up rows [lo, hi) of a
vocab-parallel table but lets another range of ids through its mask (an off-by-one `<=`, a wrong
offset). Summed over ranks, the ids the ranges overlap at are counted twice (at a clamped, wrong
row) and those they leave out never: overlapping shards, found at the mask's line, or at the
loader's slice where the mask holds the rank's own ids (in either reading of a one-sided test) and
the table is another rank's rows. A mask that fits the rows, with the ids it passes renumbered into
the shard by other arithmetic than ids - lo (`lo - ids`, `ids - hi`), reads the wrong rows of the
rank's own shard: a wrong layout, found where that arithmetic is computed, not at the lookup that
uses it. A part of `Diagnoser`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.rules.lookups import unshaped
from shardproof.relations.rules.masks import inside_range, is_shift_of, outside_range, range_masks
from shardproof.report.terms import describe, line_of

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

def _own(rank: int, span: tuple[int, int], size: int) -> bool:
    """`span` is chunk `rank` of [0, size) cut into chunks of its width."""
    lo, hi = span
    return hi > lo and size % (hi - lo) == 0 and lo == rank * (hi - lo)


# lookups: the table operand and the axis it is read along
_TABLE_AXIS = {"embedding": lambda node: 0, "gather": lambda node: node.attrs[0]}


class MaskedLookups:
    """A lookup into a region of a reference table, masked to another range of ids or read at ids
    renumbered wrongly."""

    def _mismatched_lookup_mask(self, rank: int, chain: list[Node]) -> Finding | None:
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for lookup in (n for n in chain if n.op in _TABLE_AXIS):
            axis = _TABLE_AXIS[lookup.op](lookup)
            root, box = self.r.as_region(terms[lookup.inputs[0]])
            rows = box[axis]
            if root == terms[lookup.inputs[0]] or not self.region_of_reference(root):
                continue
            renumbered = self._misnumbered_ids(rank, lookup, root, rows)
            if renumbered is not None:
                return renumbered
            size = self.r.shape(root)[axis]
            for user in (n for n in chain if n.id > lookup.id):
                masks = range_masks(self.r, terms[user.id])
                fitting = {mask for mask, (_, lo, hi, _) in masks if (lo, hi) == rows}  # (one test of a bound reads both ways)
                unfit = [(mask, (lo, hi)) for mask, (_, lo, hi, _) in masks if mask not in fitting]
                if not unfit or not self._reads(graph, user, lookup):
                    continue
                own = next((ids for _, ids in unfit if _own(rank, ids, size)), None)
                if own is not None and not _own(rank, rows, size):  # the table is the wrong shard
                    cut = self._loader_slice(rank, graph[lookup.inputs[0]], unnatural=True)
                    if cut is not None:
                        return self._table_finding(rank, cut, lookup, root, rows, own)
                mask, ids = unfit[0]
                culprit = next((n for n in graph.nodes if terms[n.id] == mask), user)
                return self._mask_finding(rank, culprit, lookup, root, axis, rows, ids)
        return None

    def _misnumbered_ids(self, rank: int, lookup: Node, root: int, rows: tuple[int, int]) -> Finding | None:
        """The lookup's index is `where(ids outside [lo, hi), c, x)` (perhaps clamped, reshaped) for
        the rows [lo, hi) it reads, but x is not ids - lo where the mask passes ids: found at the
        earliest op computing x (the renumbering's arithmetic), else at the lookup."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        index = terms[lookup.inputs[1]]
        chosen = _masked_choice(self.r, index)
        if chosen is None:
            return None
        cond, kept = chosen
        for ids, lo, hi, inside in _readings(self.r, cond):
            if (lo, hi) != rows:
                continue
            assumed = {cond: self.r.const(("full", inside), self.r.shape(cond), "bool")}
            if is_shift_of(self.r, unshaped(self.r, index), ids, lo, hi, assumed):
                return None
            x = kept[inside]
            culprit = next((n for n in graph.ancestors(lookup) if n.op not in ("leaf", "const") and terms[n.id] == x),
                           lookup)
            table, local = describe(self.r.u, root, 1), "the ids" if lo == 0 else f"the ids less {lo}"
            message = (
                f"wrong layout: on rank {rank}, the mask passes ids [{lo}:{hi}), the rows [{lo}:{hi}) of `{table}` "
                f"it holds, but the lookup reads them at `{describe(self.r.u, x, 2)}`, not at their rows in the "
                f"shard ({local}): the ids are renumbered wrongly at {line_of(culprit)}"
            )
            return Finding("discrepancy", "wrong layout", message, [(rank, culprit), (rank, lookup)],
                           fix=f"look the rows up at {local} at {line_of(culprit)}")
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


def _masked_choice(r: Rules, index: int) -> tuple[int, tuple[int, int]] | None:
    """(the condition, (the value where it is false, where it is true)) of the `where` an index
    is, through reshapes and a clamp (a max or min with a number)."""
    term = r.u[index]
    if term.op in ("bcast", "view"):
        return _masked_choice(r, term.args[0])
    if term.op in ("maximum", "minimum"):
        varying = [a for a in term.args if r.full_value(a) is None]
        return _masked_choice(r, varying[0]) if len(varying) == 1 else None
    if term.op != "where":
        return None
    cond, when_true, when_false = term.args
    return cond, (when_false, when_true)


def _readings(r: Rules, cond: int) -> list[tuple[int, int, int, bool]]:
    """(ids, lo, hi, whether the condition holds for ids in [lo, hi)) of each way `cond` reads as a
    range test."""
    found = []
    for test, inside in ((outside_range, False), (inside_range, True)):
        tested = test(r, cond)
        if tested is not None:
            found.append((*tested, inside))
    return found
