"""Outputs that are the reference's sum but for some terms. Every op on the way only moved or
combined agreeing values, so no op diverges by itself; the outputs name the fault:
- a term from the wrong place: one term is another region of the reference's values than the
  reference's (an optimizer's decayed weight taken from another parameter's slot of a flat buffer);
- a sum split over ranks: each rank holds some of the sum's terms and the ranks together hold all
  of them once (the two copies of a tied weight, each updated with its own gradient): the sum over
  ranks is missing. A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.ir.ops import OPS
from shardproof.relations.diagnose.finding import Finding
from shardproof.report.terms import describe, line_of, region, value_name


class MisplacedTerms:
    def _misplaced_term(self, rank: int, node: Node, wanted: int | None) -> Finding | None:
        """The one term of `node`'s sum that differs from the reference's sum `wanted`, with the
        same coefficient and shape, both regions of reference values: the rank's is the wrong one."""
        if wanted is None:
            return None
        have, want = dict(self._lin_parts(self.run.ranks[rank][node.id])), dict(self._lin_parts(wanted))
        extra = [(t, c) for t, c in have.items() if want.get(t) != c]
        missing = [(t, c) for t, c in want.items() if have.get(t) != c]
        if len(extra) != 1 or len(missing) != 1 or len(have) < 2:
            return None
        (got, c), (should, d) = extra[0], missing[0]
        if c != d or self.r.shape(got) != self.r.shape(should) or not all(map(self.region_of_reference, (got, should))):
            return None
        culprit = self._introducing(rank, node, lambda t: got == t or got in self._lin_args(t))
        added = [describe(self.r.u, self.r.lin([(t, c)]), 3) for t in (got, should)]
        return Finding(
            "discrepancy",
            "wrong layout",
            f"wrong layout: on rank {rank}, {value_name(node)} adds {added[0]} where the reference adds {added[1]}, "
            "its other terms the same: that term comes from the wrong place",
            [(rank, culprit), (rank, node)],
            fix=f"make {value_name(culprit)} at {line_of(culprit)} take {describe(self.r.u, should, 2)}",
            regions=[region(self.r, f"rank {rank}", got), region(self.r, "reference", should)],
        )


    def _split_sum(self, rank: int, node: Node, wanted: int | None) -> Finding | None:
        """`node`'s sum holds only terms of the reference's sum `wanted`, some missing, and outputs
        of other ranks made of that sum's terms too hold the missing ones (a tied weight's other
        copy): the sum over ranks of their parts is missing."""
        if wanted is None:
            return None
        want = dict(self._lin_parts(wanted))
        have = dict(self._lin_parts(self.run.ranks[rank][node.id]))
        if len(want) < 2 or any(want.get(t) != c for t, c in have.items()) or len(have) == len(want):
            return None
        elsewhere: dict[int, set[int]] = {}  # rank -> the terms of the sum its outputs made of some of them hold
        for graph in self.ranks:
            for output in graph.outputs if graph.rank != rank else ():
                theirs = dict(self._lin_parts(self.run.ranks[graph.rank][output]))
                if theirs != want and all(want.get(t) == c for t, c in theirs.items()):
                    elsewhere.setdefault(graph.rank, set()).update(theirs)
        held = set().union(*elsewhere.values())
        mine = sorted(set(have) - held)
        if not set(want) - set(have) <= held or not mine:
            return None
        culprit = self._introducing(rank, node, lambda t: any(a == t or a in self._lin_args(t) for a in mine))
        over = sorted({rank, *elsewhere})
        sync = self._step_sync(rank, culprit, node, set(over))
        if OPS[sync.op].kind == "collective":
            fix = f"sum {value_name(culprit)} over ranks {over} (an all-reduce) before the `{sync.op}` at {line_of(sync)}"
        elif sync is not culprit:
            fix = f"sum {value_name(culprit)} over ranks {over} (an all-reduce) after {line_of(sync)}"
        else:
            fix = f"sum {value_name(culprit)} over ranks {over} (an all-reduce) before it is used"
        return Finding(
            "discrepancy",
            "missing reduction",
            f"missing reduction: on rank {rank}, {value_name(node)} holds {describe(self.r.u, mine[0], 2)}"
            f"{' and more' if len(mine) > 1 else ''} of the terms of the reference's sum but not the others, which "
            f"ranks {sorted(elsewhere)} hold: the reference's value is the sum of the ranks' parts, which no "
            "collective takes",
            [(rank, sync), (rank, culprit), (rank, node)] if sync is not culprit else [(rank, culprit), (rank, node)],
            fix=fix,
        )
