"""Online-softmax merges that weigh a block wrongly: ring attention adds the blocks' attentions,
each weighted by exp(its log-sum-exp - L); the sum is the attention over all the blocks' keys only
when L is the log-sum-exp of every block merged (`rules/online_softmax.py`). A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.rules.online_softmax import LSE, in_key_order, weighted_block
from shardproof.report.terms import describe, line_of


class MergeWeights:
    def _misweighted_merge(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first sum of weighted block attentions in the chain whose weights do not all divide
        by the log-sum-exp of its blocks: the term weighed by another one is the culprit."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for node in chain:
            weighted = [(graph[i], weighted_block(self.r, terms[i])) for i in node.inputs] if node.op == "add" else []
            if len(weighted) < 2 or any(w is None for _, w in weighted):
                continue
            dim = weighted[0][1][2][1]
            whole = in_key_order(self.r, [scores for _, (scores, _, _) in weighted], dim)
            wrong = [(n, total) for n, (_, _, total) in weighted if total != (whole, dim)]
            if not wrong:
                continue
            culprit, (scores, _) = wrong[0]
            shape = self.r.shape(scores)[:dim] + self.r.shape(scores)[dim + 1 :]
            used = describe(self.r.u, self.r.build(LSE, (scores,), (dim,), shape, self.r.u[scores].dtype), 3)
            return Finding(
                "discrepancy",
                "wrong scale",
                f"wrong scale: a block's attention is weighed by exp(its log-sum-exp - {used}), where merging the "
                f"blocks' attentions needs exp(its log-sum-exp - the log-sum-exp of every block merged), "
                f"{describe(self.r.u, self.r.build(LSE, (whole,), (dim,), shape, self.r.u[whole].dtype), 3)}",
                [(rank, culprit), (rank, node)],
                op=culprit.op,
                fix=f"weigh each block by exp(its log-sum-exp - the merged log-sum-exp) at {line_of(culprit)}",
            )
        return None
