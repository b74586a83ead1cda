"""Other shares: a rank's output that is, term for term, another rank's share of the reference
output the claim cuts over the ranks (a loader that hands a rank another's rows, rows routed back
to the wrong rank). Nothing along the way need disagree: every op computes regions of the
reference's, so no first divergence shows; only the output's place does. A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.programs import Output
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.input_cuts import claimed_share, claimed_spans, spans_text
from shardproof.report.terms import line_of, value_name

Shared = tuple[Output, int]  # a claim that cuts a reference output over all ranks, and that output's term


class OtherShares:
    """Outputs that are another rank's share of the claimed reference output."""

    def _other_share(self, mismatched_outputs: list[tuple[int, int]], shared: Shared | None) -> Finding | None:
        """The first mismatched output whose normal form is the share the claim gives another rank."""
        if shared is None or shared[0][0] not in ("shard", "zigzag"):
            return None
        (kind, dim, *_), whole = shared
        shape, n = self.r.shape(whole), len(self.ranks)
        dim %= len(shape)
        shares = [claimed_spans(kind, shape[dim], rank, n) for rank in range(n)]
        if None in shares:
            return None
        held = {claimed_share(self.r, whole, kind, dim, rank, n): rank for rank in range(n)}
        for rank, index in mismatched_outputs:
            node = self.ranks[rank][self.ranks[rank].outputs[index]]
            other = held.get(self.run.ranks[rank][node.id])
            if other is None or other == rank:
                continue
            claimed = "Shard" if kind == "shard" else "zigzag"
            return Finding(
                "discrepancy", "wrong layout",
                f"wrong layout: {value_name(node)} on rank {rank} is rank {other}'s share of the reference's output "
                f"({spans_text(shares[other])} of dim {dim}), where the output is claimed as {claimed}({dim}): rank {rank}'s "
                f"{spans_text(shares[rank])}",
                [(rank, node)],
                fix=f"make rank {rank} compute its own share ({spans_text(shares[rank])} of dim {dim}) by {line_of(node)}",
            )
        return None
