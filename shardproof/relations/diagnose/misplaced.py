"""A term from the wrong place: a rank's output is the reference's sum term for term but one, and
that one is another region of the reference's values than the reference's (an optimizer's decayed
weight taken from another parameter's slot of a flat buffer). Every op on the way only moved or
combined agreeing values, so no op diverges by itself; the output names the fault. A part of
`Diagnoser`.
"""

from __future__ import annotations

from fractions import Fraction

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.report.terms import describe, line_of, region, value_name


class MisplacedTerms:
    def _misplaced_term(self, rank: int, node: Node, wanted: int | None) -> Finding | None:
        """The one term of `node`'s sum that differs from the reference's sum `wanted`, with the
        same coefficient and shape, both regions of reference values: the rank's is the wrong one."""
        if wanted is None:
            return None
        have, want = _parts(self.r, self.run.ranks[rank][node.id]), _parts(self.r, wanted)
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


def _parts(r, t: int) -> dict[int, Fraction]:
    term = r.u[t]
    return dict(zip(term.args, term.attrs[0])) if term.op == "lin" else {t: Fraction(1)}
