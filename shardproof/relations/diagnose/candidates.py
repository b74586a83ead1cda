"""Too few candidates: a rank keeps fewer than k of its shard's largest values before the top k
over all ranks' candidates is taken (top-k sampling over vocab-parallel logits), found at the top k
that keeps them. A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.rules.topk import TOPK, call_of, candidates, short_parts
from shardproof.report.terms import line_of


class TopCandidates:
    """The top k of the ranks' top candidates, where some rank kept fewer than k."""

    def _too_few_candidates(self, rank: int, chain: list[Node]) -> Finding | None:
        for other in sorted(range(len(self.ranks)), key=lambda r: r != rank):
            graph, terms, end = self.ranks[other], self.run.ranks[other], self.counterpart(other, chain[-1])
            if end is None:
                continue
            tops = [n for n in graph.ancestors(end) if n.op == TOPK]
            for node in tops:
                call = call_of(self.r, terms[node.id])
                parts = candidates(self.r, call.x, call.dim) if call is not None else None
                short = {p.term: p for p in short_parts(parts or [], call.k)} if call is not None else {}
                kept = next((n for n in tops if terms[n.id] in short), None) if short else None
                if kept is not None:
                    part = short[terms[kept.id]]
                    return Finding(
                        "discrepancy",
                        "too few candidates",
                        f"too few candidates: rank {other} keeps the top {part.call.k} of dim {call.dim}'s indices "
                        f"[{part.lo}:{part.hi}), but the top {call.k} over all ranks may take up to "
                        f"{min(call.k, part.hi - part.lo)} of them",
                        [(other, kept), (other, node)],
                        fix=f"keep the top {call.k} of each rank's shard at {line_of(kept)}",
                    )
        return None
