"""Overlapping shards: a sum over ranks of contractions in which a rank cut one operand at another
offset than the other, so that over the ranks that operand's shards overlap and leave a gap. The
sum then never reads the elements in the gap, on which the reference's sum depends: it differs
from the reference's for almost all weights, a structural fault. A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.agreement import LAYOUT_OPS
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.shards import cutting, own_chunk
from shardproof.relations.layout import full_box
from shardproof.report.terms import line_of

Span = tuple[int, int]
OPERANDS = ("first", "second")


class OverlappingShards:
    """Contractions whose operands are cut at different offsets, summed over ranks."""

    def _misaligned_contraction(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first op of the disagreeing chain contracts two regions of the reference's operands
        over different ranges, and a sum over ranks further down the chain adds it up."""
        first = chain[0]
        if first.op != "matmul":
            return None
        contraction = self._contraction(self.run.ranks[rank][first.id])
        if contraction is None:
            return None
        roots, spans, size = contraction
        if spans[0] == spans[1]:
            return None
        collective = next((n for n in chain if _sums_over_ranks(n)), None)
        if collective is None:
            return None
        covered = self._covered(self.run.ranks[rank][collective.id], roots)
        faults = [_faults(operand, size) for operand in covered]
        if sorted(map(bool, faults)) != [False, True]:
            return None  # one operand's shards tile the axis (every rank's part was read), the other's do not
        wrong = 0 if faults[0] else 1
        culprit = self._cut(rank, self.ranks[rank][first.inputs[wrong]])
        message = (
            f"wrong layout (overlapping shards): on rank {rank}, `{first.op}` contracts [{spans[0][0]}:{spans[0][1]}) of "
            f"its first operand with [{spans[1][0]}:{spans[1][1]}) of its second, out of {size}; summed over ranks "
            f"{list(collective.attrs[-1])} by `{collective.op}`, the ranks' shards of its {OPERANDS[wrong]} operand "
            f"{faults[wrong]}"
        )
        if culprit is not None:
            message += f": {cutting(self.ranks[rank], culprit, rank)}"
        sites = [(rank, culprit)] if culprit is not None else []
        cut = culprit if culprit is not None else first
        return Finding("discrepancy", "overlapping shards", message, sites + [(rank, first), (rank, collective)],
                       fix=f"make rank {rank} take its own chunk of its {OPERANDS[wrong]} operand at {line_of(cut)}")

    def _overlapping_gather(self, rank: int, chain: list[Node]) -> Finding | None:
        """An all-gather before the divergence whose members hold regions of one tensor that
        overlap and leave gaps along the dim they differ in (a rank's slice at a wrong offset,
        gathered; every member's the same region), or that tile it out of the members' order:
        found at the slice that cut the part that is not its member's own chunk."""
        graph = self.ranks[rank]
        for gather in (n for n in graph.ancestors(chain[0]) if n.op == "all_gather"):
            term = self.r.u[self.run.ranks[rank][gather.id]]
            regions = [self.r.as_region(p) for p in term.args] if term.op == "cat" else []
            if len({root for root, _ in regions}) != 1:
                continue
            boxes = [box for _, box in regions]
            differing = [d for d in range(len(boxes[0])) if len({b[d] for b in boxes}) > 1]
            if not differing and len(boxes) > 1 and boxes[0] != full_box(self.r.shape(regions[0][0])):
                differing = [term.attrs[0]]  # every member holds the same region: they overlap along the gathered dim
            if len(differing) != 1:
                continue
            dim, size = differing[0], self.r.shape(regions[0][0])[differing[0]]
            overlapping = _faults([b[dim] for b in boxes], size)
            faults = overlapping or _out_of_order([b[dim] for b in boxes])
            if not faults:
                continue
            kind = "overlapping shards" if overlapping else "wrong layout"
            for position, member in enumerate(gather.attrs[-1]):
                lo, hi = boxes[position][dim]
                culprit = self._slice_at(member, gather, (lo, hi)) or self._input_cut(member, gather)
                if culprit is not None and lo != position * (hi - lo):
                    parts = ", ".join(f"[{b[dim][0]}:{b[dim][1]})" for b in boxes)
                    own = f"[{position * (hi - lo)}:{(position + 1) * (hi - lo)})"
                    return Finding(
                        "discrepancy", kind,
                        f"wrong layout{' (overlapping shards)' if overlapping else ''}: `all_gather` over ranks {list(gather.attrs[-1])} joins parts {parts} "
                        f"of a dim of size {size}, which {faults}: rank {member} cuts its part at [{lo}:{hi}), not at its "
                        f"own chunk {own}",
                        [(member, culprit), (rank, gather)],
                        fix=f"make rank {member} take its own chunk at {line_of(culprit)}",
                    )
        return None

    def _input_cut(self, rank: int, gather: Node) -> Node | None:
        """The loader's (or `shard_input`'s) cut of another chunk than the rank's own that `rank`'s
        part of `gather` is computed from."""
        own = self.counterpart(rank, gather)
        return None if own is None else self._loader_slice(rank, self.ranks[rank][own.inputs[0]], unnatural=True)

    def _slice_at(self, rank: int, gather: Node, span: Span) -> Node | None:
        """The slice on `rank` that cut [lo:hi) of the part it contributes to `gather`."""
        own = self.counterpart(rank, gather)
        if own is None:
            return None
        graph = self.ranks[rank]
        return next((n for n in graph.ancestors(graph[own.inputs[0]]) if n.op == "slice" and tuple(n.attrs[1:]) == span), None)

    def _cut(self, rank: int, operand: Node) -> Node | None:
        """The slice that cut this rank's operand at the wrong offset: the one it is a layout of
        (a runtime slice, or the loader's), else the loader slice of another chunk than the rank's
        own among those it is computed from (an activation of a wrongly cut weight)."""
        graph = self.ranks[rank]
        node = operand
        while node.op in LAYOUT_OPS and node.op != "slice":
            node = graph[node.inputs[0]]
        if node.op == "slice":
            return None if own_chunk(node, rank) else node
        return self._loader_slice(rank, operand, unnatural=True)

    def _contraction(self, t: int) -> tuple[tuple[int, int], tuple[Span, Span], int] | None:
        """A matmul (or a multiple of one: a mean's backward scales it) of regions of two tensors
        (their roots), the spans of the contracted axis each region covers, and that axis' size;
        None for anything else."""
        term = self.r.u[t]
        if term.op == "lin" and len(term.args) == 1:
            term = self.r.u[term.args[0]]
        if term.op != "matmul":
            return None
        (ra, box_a), (rb, box_b) = (self.r.as_region(a) for a in term.args)
        size = self.r.shape(ra)[-1]
        if (ra, rb) == term.args or len(box_b) < 2 or size != self.r.shape(rb)[-2]:
            return None
        return (ra, rb), (box_a[-1], box_b[-2]), size

    def _covered(self, t: int, roots: tuple[int, int]) -> tuple[list[Span], list[Span]]:
        """Per operand, the spans of the contracted axis that the parts of the sum `t` cover, over
        contractions of the same two roots: a piece covers its range in both operands."""
        term = self.r.u[t]
        covered: tuple[list[Span], list[Span]] = ([], [])
        for part in term.args if term.op == "lin" else (t,):
            p = self.r.u[part]
            if p.op == "piece" and p.attrs[0][0] == "matmul" and self.r.u[p.attrs[0][1]].args == roots:
                spans = ((p.attrs[1], p.attrs[2]),) * 2
            else:
                contraction = self._contraction(part)
                if contraction is None or contraction[0] != roots:
                    continue
                spans = contraction[1]
            for operand, span in zip(covered, spans):
                operand.append(span)
        return covered


def _sums_over_ranks(node: Node) -> bool:
    return node.op == "reduce_scatter" or (node.op == "all_reduce" and node.attrs[0] == "sum")


def _out_of_order(spans: list[Span]) -> str:
    """Spans that tile their dim in another order than their members' (rank i's part at i)."""
    return "" if spans == sorted(spans) else "hold every part once but out of the members' order"


def _faults(spans: list[Span], size: int) -> str:
    """How the spans fail to cover [0, size) exactly once: where they overlap, what they leave out;
    empty when they tile it."""
    overlaps, gaps, reached = [], [], 0
    for lo, hi in sorted(spans):
        if lo > reached:
            gaps.append((reached, lo))
        elif lo < reached:
            overlaps.append((lo, min(hi, reached)))
        reached = max(reached, hi)
    if reached < size:
        gaps.append((reached, size))
    said = [what + ", ".join(f"[{lo}:{hi})" for lo, hi in found) for what, found in (("overlap at ", overlaps), ("leave out ", gaps)) if found]
    return " and ".join(said)
