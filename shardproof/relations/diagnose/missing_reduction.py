"""Missing reductions: a partial sum (or max) over ranks that reaches an op or an output without its
all-reduce, and the op that created it. A part of `Diagnoser`.
"""

from __future__ import annotations

from fractions import Fraction

from shardproof.ir.graph import Node
from shardproof.ir.ops import OPS
from shardproof.relations.diagnose.agreement import LAYOUT_OPS, PIECES
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.shards import cutting
from shardproof.report.terms import line_of, placement, value_name


class MissingReductions:
    """Partial sums reaching an op or an output unreduced."""

    def _partial_inputs(self, rank: int, node: Node) -> list[int]:
        """The terms of `node`'s operands that are partial sums (or maxes) over ranks: their pieces
        are shares that the other ranks complete, not the pieces of a contraction this rank got
        wrong by itself (its operands paired differently from the reference's)."""
        terms = self.run.ranks[rank]
        return [terms[i] for i in node.inputs if self.partial(terms[i]) and self._completed_over_ranks(i)]

    def _completed_over_ranks(self, node_id: int) -> bool:
        """Whether the ranks' values at `node_id`, summed (or, for max pieces, maxed), hold no
        piece; true where the ranks' programs differ there (nothing to combine: the pieces are
        taken as shares)."""
        held = []
        for graph in self.ranks:
            if node_id >= len(graph.nodes) or graph[node_id].op != self.ranks[0][node_id].op:
                return True
            held.append(self.run.ranks[graph.rank][node_id])
        if self.partial_kind(held) == "partial max":
            return not self.partial(self.r.maximum(held))
        return not self.partial(self.r.lin([(t, Fraction(1)) for t in held]))

    def _unreduced_output(self, rank: int, node: Node) -> Finding:
        """A partial sum reaches an output: where did it miss its reduction? Added to a sum that was
        already reduced (a micro-batch accumulated after the all-reduce), reduced only as a copy the
        program then drops (the all-reduce ran on another buffer), or never reduced at all."""
        let_in = self._share_let_in(rank, node)
        if let_in is not None:
            return let_in
        joined = self._added_after_reduction(rank, node)
        if joined is not None:
            join, collective = joined
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction: this rank's share of a sum is added to a value already reduced by `{collective.op}` "
                f"over ranks {list(collective.attrs[-1])}; the other ranks' shares of it never arrive",
                [(rank, join), (rank, collective)],
                fix=f"add this share before the `{collective.op}` at {line_of(collective)}, so that it is reduced with the rest",
            )
        for collective in reversed(self._partial_chain(rank, node)):
            narrow = self._wrong_group(rank, collective)
            if narrow is not None:
                return narrow
        copy = self._reduced_copy(rank, node)
        if copy is not None:
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction (wrong buffer): `{copy.op}` over ranks {list(copy.attrs[-1])} reduces a copy of this "
                "value and its result is never used; the value used is each rank's own share",
                [(rank, copy)],
                fix=f"use the result of the `{copy.op}` at {line_of(copy)} (or reduce the used tensor in place)",
            )
        dropped = self._dropped_share(rank, node)
        if dropped is not None:
            return dropped
        wrong_shard = self._wrong_shard_summed(rank, node)
        if wrong_shard is not None:
            return wrong_shard
        kind = self.partial_kind([self.run.ranks[rank][node.id]])
        return Finding(
            "discrepancy",
            "missing reduction",
            f"missing reduction: the output is still a {kind} (`{placement(kind)}`: each rank holds only its share); "
            "it needs an all-reduce",
            self._reduction_sites(rank, node),
            fix=self._reduction_fix(rank, node, kind),
        )

    def _share_let_in(self, rank: int, node: Node) -> Finding | None:
        """A reduction on the way to `node` whose result holds shares of a sum over ranks that its
        input on this rank holds none of: another rank of its group added its share of a sum over
        other ranks before that sum was reduced (a tied embedding's copies all-reduced after the
        distributed optimizer's reduce-scatter left each copy reduced on another rank). The
        reduction is in the wrong place."""
        terms = self.run.ranks[rank]
        for n in sorted(self.ranks[rank].ancestors(node), key=lambda n: n.id):
            if n.op not in ("all_reduce", "reduce_scatter"):
                continue
            mine = set().union(*(self._shares(terms[i]) for i in n.inputs))
            if not self._shares(terms[n.id]) - mine:
                continue
            group = list(n.attrs[-1])
            sharers = [(s, peer, theirs) for s in group if s != rank for peer in [self._same_reduction(rank, n, s)]
                       if peer is not None for theirs in [self._shares(self.run.ranks[s][peer.inputs[0]]) - mine] if theirs]
            if not sharers:
                continue
            sharer, peer, theirs = sharers[0]
            over = [g.rank for g in self.ranks if self._makes_shares(g.rank, theirs)]
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction: `{n.op}` over ranks {group} adds rank {sharer}'s share of a sum over ranks {over} "
                "before that sum is reduced: the result holds an unreduced share",
                [(rank, n), (sharer, peer)],
                fix=f"reduce over ranks {over} after the `{n.op}` at {line_of(n)}, not before it (or complete rank "
                    f"{sharer}'s share before it)",
            )
        return None

    def _makes_shares(self, rank: int, sums: set[int]) -> bool:
        """Rank `rank` computes a share of one of `sums` itself, before any collective hands it one."""
        graph, terms, received = self.ranks[rank], self.run.ranks[rank], set()
        for n in graph.nodes:
            if OPS[n.op].kind == "collective" or any(i in received for i in n.inputs):
                received.add(n.id)
            elif self._shares(terms[n.id]) & sums:
                return True
        return False

    def _shares(self, t: int) -> set[int]:
        """The sums over ranks that `t` holds a share of, also in any part of a cat (a flat buffer)."""
        term = self.r.u[t]
        return set().union(*(self._shares(a) for a in term.args)) if term.op == "cat" else self._summed(t)

    def _same_reduction(self, rank: int, node: Node, other: int) -> Node | None:
        """Rank `other`'s reduction that `node` (of `rank`) meets: the k-th over the same group on each."""
        group = node.attrs[-1]
        mine = [n.id for n in self.ranks[rank].nodes if n.op == node.op and n.attrs[-1] == group]
        theirs = [n for n in self.ranks[other].nodes if n.op == node.op and n.attrs[-1] == group]
        k = mine.index(node.id)
        return theirs[k] if k < len(theirs) else None

    def _wrong_shard_summed(self, rank: int, node: Node) -> Finding | None:
        """A share of a sum over ranks made from a shard the loader (or `shard_input`) cut at another
        chunk than the rank's own: the ranks' shares overlap and leave a gap, so the sum stays
        partial whatever reduces it. The fault is the cut, not a missing reduction."""
        origin = self._piece_origin(rank, node) or node
        wrong = self._wrong_cut(rank, origin, summed=True)
        if wrong is None:
            return None
        other, cut = wrong
        return Finding(
            "discrepancy",
            "overlapping shards",
            f"overlapping shards: {cutting(self.ranks[other], cut, other)}, so the ranks' shares of the sum over "
            f"ranks made at {line_of(origin)} overlap and leave a gap: no reduction completes it",
            [(other, cut), (rank, origin)],
            fix=f"make rank {other} take its own chunk at {line_of(cut)}",
        )

    def _added_after_reduction(self, rank: int, node: Node) -> tuple[Node, Node] | None:
        """The first `add` on the way to `node` of a partial sum that went through a collective and
        one that never did, with that collective."""
        chain = self._partial_chain(rank, node)
        on_chain = {n.id for n in chain}
        reduced_by: dict[int, Node] = {}
        for n in chain:
            if OPS[n.op].kind == "collective":
                reduced_by[n.id] = n
                continue
            ins = [i for i in n.inputs if i in on_chain]
            done = [reduced_by[i] for i in ins if i in reduced_by]
            if done:
                reduced_by[n.id] = done[0]
                if n.op == "add" and len(done) < len(ins):
                    return n, done[0]
        return None

    def _dropped_share(self, rank: int, node: Node) -> Finding | None:
        """This rank computes other shares of the sum it returns, which never reach it: not a
        reduction over ranks but an accumulation over its own steps (a pipeline stage's
        microbatches) that starts again. Blamed on the zeros it restarts from where the program
        makes them, else on the share kept."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        wholes = self._summed(terms[node.id])
        used = {n.id for n in graph.ancestors(node)}
        kept = {terms[i] for i in used}
        share = next((n for n in graph.nodes if n.id not in used and n.op not in LAYOUT_OPS and terms[n.id] not in kept
                      and self._summed(terms[n.id]) & wholes), None)
        if not wholes or share is None:
            return None
        restart = next((graph[i] for n in graph.ancestors(node) if n.op == "add" for i in n.inputs
                        if graph[i].op == "const" and self.r.full_value(terms[i]) == 0), None)
        origin = restart or self._piece_origin(rank, node) or node
        where = f" from the zeros made at {line_of(restart)}" if restart is not None else ""
        return Finding(
            "discrepancy",
            "missing reduction",
            f"missing reduction (dropped shares): this rank computes other shares of this sum (at {line_of(share)}"
            f"{' in the backward' if share.loc is not None and share.loc.backward else ''}) but never adds them to "
            f"it: an accumulation over its own steps (microbatches?) starts again{where}",
            [(rank, origin), (rank, share)],
            fix=f"keep accumulating across the steps: do not reset the accumulator{' at ' + line_of(restart) if restart else ''} "
                "between them",
        )

    def _reduced_copy(self, rank: int, node: Node) -> Node | None:
        """A collective whose input is a value on the way to `node` but whose result never reaches it."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        chain_terms = {terms[n.id] for n in self._partial_chain(rank, node)}
        used = {n.id for n in graph.ancestors(node)}
        for n in graph.nodes:
            if OPS[n.op].kind == "collective" and n.id not in used and terms[n.inputs[0]] in chain_terms:
                return n
        return None

    def _reduction_fix(self, rank: int, node: Node, kind: str, consumer: Node | None = None) -> str:
        """"all-reduce `y` over ranks [0, 1] after line 31": the value to reduce where it is made,
        over the ranks holding shares of the same sum (or max), before the op that needs it whole."""
        origin = self._reduction_point(rank, node) or node
        group = self._reduction_group(rank, origin)
        over = f" over ranks {group}" if len(group) > 1 else ""
        how = " with op=ReduceOp.MAX" if kind == "partial max" else ""
        handed = self._after_backward(rank, origin, node)
        if handed is not None:
            return f"all-reduce {value_name(origin)}{how}{over} after the backward call at {line_of(handed)}, " \
                   "before the step uses it"
        before = ""
        if consumer is not None and line_of(consumer) != line_of(origin):
            before = f", before `{consumer.op}` at {line_of(consumer)} uses it"
        return f"all-reduce {value_name(origin)}{how}{over} after {line_of(origin)}{before}"

    def _reduction_group(self, rank: int, node: Node) -> list[int]:
        """The ranks whose value at `node` holds a share of the same sum (or max) as this rank's:
        read at the same node of every rank whose program has the same op there."""
        mine = self._summed(self.run.ranks[rank][node.id])
        return [g.rank for g in self.ranks if node.id < len(g.nodes) and g[node.id].op == node.op
                and mine & self._summed(self.run.ranks[g.rank][node.id])]

    def _summed(self, t: int) -> set[int]:
        """The sums (or maxes) over ranks that `t` holds a share of."""
        term = self.r.u[t]
        if term.op in PIECES:
            return {term.args[0]}
        if term.op in ("lin", "slice", "bcast", "repeat"):
            return set().union(*(self._summed(a) for a in term.args))
        return set()

    def _reduction_sites(self, rank: int, node: Node) -> list[tuple[int, Node]]:
        """Where the all-reduce belongs (after the last op that only combines shares; for a gradient
        handed over unreduced, after the backward call: grad_sync.py) and where the shares are made;
        `node` if neither shows."""
        point, origin = self._reduction_point(rank, node), self._piece_origin(rank, node)
        found = [n for n in (point, origin) if n is not None]
        sites = [(rank, n) for n in found if n is found[0] or n.id != found[0].id] or [(rank, node)]
        handed = self._after_backward(rank, point, node) if point is not None else None
        return sites if handed is None else [(rank, handed), *sites]

    def _reduction_point(self, rank: int, node: Node) -> Node | None:
        """The last op on the way from where the shares reaching `node` are made that only adds
        shares up (gradient accumulation: adding a micro-batch's share to the running one, which may
        start at zero): the all-reduce goes after it. Another op making shares (the next
        micro-batch's) is passed over; moving a share is no reason to move the all-reduce."""
        terms = self.run.ranks[rank]
        chain = [n for n in self._partial_chain(rank, node) if n.op not in LAYOUT_OPS]
        point = chain[0] if chain else None
        for n in chain[1:]:
            if not any(self.partial(terms[i]) for i in n.inputs):
                continue
            if n.op not in ("add", "sum") or not all(self.partial(terms[i]) or self.r.full_value(terms[i]) == 0
                                                      for i in n.inputs):
                break
            point = n
        return point

    def _piece_origin(self, rank: int, node: Node) -> Node | None:
        """The op where the partial sum that reaches `node` unreduced was created (a contraction or
        reduction over a shard): the earliest op of the chain of partial values ending at `node`.
        Partial values reduced on the way (a row-parallel matmul before its all-reduce) are not it."""
        origins = [n for n in self._partial_chain(rank, node) if n.op not in LAYOUT_OPS]
        return origins[0] if origins else None

    def _partial_chain(self, rank: int, node: Node) -> list[Node]:
        """`node` and the ops whose partial values flow into it, in execution order."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        chain, stack = {node.id}, [node]
        while stack:
            for i in stack.pop().inputs:
                if i not in chain and self.partial(terms[i]):
                    chain.add(i)
                    stack.append(graph[i])
        return [graph[i] for i in sorted(chain)]
