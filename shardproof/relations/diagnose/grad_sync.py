"""Where a gradient's missing reduction belongs in the user's training step. A part of `Diagnoser`.

A gradient that autograd leaves as each rank's share (a sequence-parallel norm's weight, a tied
weight's two copies) is synced by the step after `backward()` returns: a grad-sync helper the step
calls all-reduces it before the optimizer reads it. When that sync is missing, the line to change is
in the step, not the forward line whose backward formula made the share, nor the line where the
optimizer next reads it. So such a finding names, first:
- the `backward()` call that hands the share over, when the share leaves autograd's formulas
  unreduced (later ops of the backward computing with it would make it the model's fault instead);
- the line of the step's gradient sync the share goes through without the ranks holding the rest of
  its sum (the sync helper's line, one call in from the step), when there is one;
- else the step's last op accumulating it (`main_grad.add_(p.grad)`), after which the sync goes.
"""

from __future__ import annotations

from dataclasses import replace

from shardproof.ir.graph import Node
from shardproof.ir.ops import OPS
from shardproof.relations.diagnose.agreement import LAYOUT_OPS


class GradientSync:
    def _after_backward(self, rank: int, point: Node, consumer: Node) -> Node | None:
        """`point` (an op of a backward formula making shares of a sum) seen at the `backward()`
        call that ran it, when its shares reach `consumer` only through moves and additions of
        shares outside any backward formula: a gradient handed over unreduced. None otherwise."""
        loc = point.loc
        if loc is None or not loc.backward or not loc.calls:
            return None
        for n in self._partial_chain(rank, consumer):
            if n.id <= point.id or n.op in LAYOUT_OPS:
                continue
            if n.loc is not None and n.loc.backward or n.op != "add" and n is not consumer:
                return None
        return replace(point, loc=replace(loc.calls[-1], backward=True, calls=loc.calls[:-1]))

    def _step_sync(self, rank: int, start: Node, node: Node, holders: set[int]) -> Node:
        """Where the sum over ranks of the shares of a gradient `start` makes on their way to `node`
        belongs: at the first collective on the way whose group lacks some of `holders` (the ranks
        holding the rest of the sum), seen at the sync helper's line; else at the last op after
        `start` that only adds them up with zeros (a flat gradient buffer's `main_grad.add_(p.grad)`).
        `start` itself when it is no gradient (no backward formula made it)."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        if not any(n.loc is not None and n.loc.backward for n in graph.ancestors(start)):
            return start
        between = {n.id for n in graph.ancestors(node)}
        on_way, point = {start.id}, start
        for n in graph.nodes[start.id + 1 : node.id + 1]:
            if n.id not in between or not any(i in on_way for i in n.inputs):
                continue
            if self.r.full_value(terms[n.id]) == 0:
                continue  # a part of a buffer the shares never reached (its zeros)
            on_way.add(n.id)
            if OPS[n.op].kind == "collective":
                return self._helper_site(n) if not holders <= set(n.attrs[-1]) else point
            if n.op in LAYOUT_OPS:
                continue
            if n.op != "add" or not all(i in on_way or self.r.full_value(terms[i]) == 0 for i in n.inputs):
                return point
            point = n
        return point

    @staticmethod
    def _helper_site(node: Node) -> Node:
        """`node` at the line of the helper the step calls that issues it (one call in from the
        step: `optimizer.reduce_scatter_grads()` in `finalize_model_grads`), where a reduction the
        sync lacks goes beside it; at its own line when the step issues it itself."""
        loc = node.loc
        if loc is None or not loc.calls:
            return node
        frames = [*loc.calls, loc]
        return replace(node, loc=replace(frames[1], calls=tuple(frames[:1])))
