"""Collectives: a sum over ranks whose parts overlap or leave gaps, that is counted wrong, or that
reduces over too few ranks. A part of `Diagnoser`.
"""

from __future__ import annotations

from fractions import Fraction

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.reads import REDUCE_OP_NAMES
from shardproof.relations.execute import reduce_op
from shardproof.relations.diagnose.shards import own_chunk
from shardproof.report.terms import describe, line_of, value_name


class CollectiveFaults:
    """Divergences at a collective."""

    def _at_collective(self, rank: int, node: Node) -> Finding:
        narrow = self._wrong_group(rank, node) or self._wrong_reduce_op(rank, node)
        if narrow is not None:
            return narrow
        parts = self._lin_parts(self.run.ranks[rank][node.id])
        pieces = [(a, c) for a, c in parts if self.r.u[a].op == "piece"]
        if pieces:
            return self._uneven_pieces(rank, node, pieces)
        miscounted = self._miscounted(parts)
        if miscounted is not None:
            extra, have, want = miscounted
            repeated = self._double_reduction(rank, node)
            if repeated is not None:
                return repeated
            factor = have / want
            counted = f"after `{node.op}` the term {describe(self.r.u, extra, 2)} is counted {have} times where " \
                      f"the reference counts it {want} times"
            if factor == len(node.attrs[-1]) and self._held_whole(rank, node, extra):
                culprit = self._introducing(rank, node, lambda x: extra in self._lin_args(x))
                message = f"double counting (x{factor}): {counted}: it is added on every rank before the sum over ranks"
                return Finding("discrepancy", "double counting", message, [(rank, culprit), (rank, node)], scale=factor,
                               fix=f"add `{describe(self.r.u, extra, 2)}` after the `{node.op}` at {line_of(node)}, or on one rank only")
            other_op = self._other_reduce_op(rank, node, factor, counted)
            if other_op is not None:
                return other_op
            scaling = self._scaling_origin(rank, node)
            culprit = scaling[0] if scaling else self._introducing(rank, node, lambda x: extra in self._lin_args(x))
            where = f": each rank's share is scaled by {scaling[1]} here" if scaling else ""
            return Finding("discrepancy", "wrong scale", f"wrong scale (x{factor}): {counted}{where}",
                           [(rank, culprit), (rank, node)], scale=factor,
                           fix=f"scale {value_name(culprit)} by {want / have} more at {line_of(culprit)}, so that "
                           f"the term counts {want} times after the `{node.op}`")
        return self._wrong_axis_finding(rank, node) or self._unexplained(rank, node)

    def _other_reduce_op(self, rank: int, node: Node, factor: Fraction, counted: str) -> Finding | None:
        """A sum over ranks off by exactly its group's size, which the other of SUM and AVG makes
        right: the reduce op is the word to change, not the scale of every rank's share."""
        if node.op not in ("all_reduce", "reduce_scatter"):
            return None
        size, have = len(node.attrs[-1]), reduce_op(node)
        needed = {("sum", Fraction(size)): "mean", ("mean", Fraction(1, size)): "sum"}.get((have, factor))
        if needed is None:
            return None
        have, needed = REDUCE_OP_NAMES[have], REDUCE_OP_NAMES[needed]
        return Finding(
            "discrepancy",
            "wrong reduce op",
            f"wrong reduce op (x{factor}): {counted}: `{node.op}` over ranks {list(node.attrs[-1])} reduces with "
            f"ReduceOp.{have}; with ReduceOp.{needed} it gives the reference's value",
            [(rank, node)],
            scale=factor,
            fix=f"reduce with ReduceOp.{needed}, not ReduceOp.{have}, at {line_of(node)}",
        )

    def _uneven_pieces(self, rank: int, node: Node, pieces: list[tuple[int, Fraction]]) -> Finding:
        ranges = sorted((self.r.u[p].attrs[1], self.r.u[p].attrs[2], c) for p, c in pieces)
        size = self.r.u[pieces[0][0]].attrs[3]
        covered = ", ".join(f"[{lo}:{hi})" + (f" x{c}" if c != 1 else "") for lo, hi, c in ranges)
        overlapping = any(c != 1 for _, _, c in ranges) or any(a[1] > b[0] for a, b in zip(ranges, ranges[1:]))
        upstream = None if overlapping else self._reduced_too_late(rank, node)
        if upstream is not None:  # a gap the ranks outside the group fill: their shares' all-reduce is missing
            return upstream
        group = node.attrs[-1]
        origin = self._piece_origin(rank, node)
        culprit = self._slice_source(node.id, ranges) or (rank, origin if origin is not None else node)
        kind = "overlapping shards" if overlapping else "missing reduction"
        return Finding(
            "discrepancy",
            kind,
            f"wrong layout ({kind}): `{node.op}` over ranks {list(group)} adds up parts {covered} of a sum over "
            f"an axis of size {size}; the parts must cover it exactly once (a rank holds the wrong shard)",
            [culprit, (rank, node)],
            fix=f"make each rank take its own shard (chunk `rank`, once each) at {line_of(culprit[1])}",
        )

    def _wrong_group(self, rank: int, node: Node) -> Finding | None:
        """A reducing collective whose sum stays partial over its group but adds up once the same
        collective's inputs on the other ranks join: it reduces over too few ranks (unless the
        all-reduce the shares missed belongs upstream: upstream.py)."""
        if node.op not in ("all_reduce", "reduce_scatter"):
            return None
        k = [n.id for n in self.ranks[rank].nodes if n.op in ("all_reduce", "reduce_scatter")].index(node.id)
        inputs = {}  # each rank's input to its k-th reduction
        for graph in self.ranks:
            reductions = [n for n in graph.nodes if n.op in ("all_reduce", "reduce_scatter")]
            if k < len(reductions):
                inputs[graph.rank] = self.run.ranks[graph.rank][reductions[k].inputs[0]]
        group = list(node.attrs[-1])
        others = sorted(set(inputs) - set(group))
        mine = self.r.lin([(inputs[s], Fraction(1)) for s in group if s in inputs])
        everyone = self.r.lin([(t, Fraction(1)) for t in inputs.values()])
        if not others or not self.partial(mine) or self.partial(everyone):
            return None
        return self._reduced_too_late(rank, node) or Finding(
            "discrepancy",
            "wrong group",
            f"wrong group: `{node.op}` over ranks {group} adds up only part of a sum; ranks {others} hold the other "
            f"shares (reduce over ranks {sorted(group + others)})",
            [(rank, node)],
            fix=f"reduce over ranks {sorted(group + others)}, not {group}, at {line_of(node)}",
        )

    def _slice_source(self, node_id: int, ranges: list[tuple[int, int, Fraction]]) -> tuple[int, Node] | None:
        """The loader slice, on a rank whose share is not its own, that picked a summed part."""
        for rank, graph in enumerate(self.ranks):
            for ancestor in graph.ancestors(graph[node_id]):
                if ancestor.op != "slice" or graph[ancestor.inputs[0]].op != "leaf":
                    continue
                _, lo, hi = ancestor.attrs
                if any((l, h) == (lo, hi) for l, h, _ in ranges) and not own_chunk(ancestor, rank):
                    return rank, ancestor
        return None
