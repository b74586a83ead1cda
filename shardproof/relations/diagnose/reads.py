"""What a collective's operands hold against what it does with them: a MAX over shares of a sum (or
a SUM of partial maxima), and buffers read before anything wrote them (the collective that should
fill a `torch.empty` output is missing). A part of `Diagnoser`.
"""

from __future__ import annotations

import math
from fractions import Fraction

from shardproof.ir.graph import Graph, Node
from shardproof.relations.diagnose.agreement import LAYOUT_OPS, PIECES
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.execute import reduce_op
from shardproof.report.terms import line_of, placement, value_name

# terms that keep their operands' elements: what they read, the result holds
_KEEPING = {"lin", "slice", "bcast", "repeat", "cat", "view", "permute", "expand", "convert", *PIECES}
_NOT_COMPUTING = {"leaf", "const", "call", *LAYOUT_OPS}
REDUCE_OP_NAMES = {"sum": "SUM", "mean": "AVG", "max": "MAX", "min": "MIN", "prod": "PRODUCT"}


def _unused_like(graph: Graph, buffers: list[Node], world_size: int) -> Node | None:
    """The value the program computes (in its own code) and never uses, of the dtype of one of the
    buffers and as many elements as it or as one rank's part of it (an all-gather's input), else
    as all ranks' parts (a reduce-scatter's): the value a deleted collective or copy would have put
    there. The last computed before the buffer is allocated (the value a helper was handed to
    gather, a whole unread branch before it), else the first after. Ops that only move data are
    passed over: the value is where it was computed."""
    live, todo = set(graph.outputs), list(graph.outputs)
    while todo:
        for i in graph[todo.pop()].inputs:
            if i not in live:
                live.add(i)
                todo.append(i)
    unread = [n for n in graph.nodes if n.id not in live and n.loc is not None and n.op not in _NOT_COMPUTING]

    allocated = min(b.id for b in buffers)

    def first_of(factors: tuple[Fraction, ...]) -> Node | None:
        wanted = {(math.prod(b.shape) * f, b.dtype) for b in buffers for f in factors}
        fitting = [n for n in unread if (math.prod(n.shape), n.dtype) in wanted]
        before = [n for n in fitting if n.id < allocated]
        return before[-1] if before else next(iter(fitting), None)

    return first_of((Fraction(1), Fraction(1, world_size))) or first_of((Fraction(world_size),))


def _written_into(graph: Graph, buffer: Node) -> bool:
    """Whether the program writes anything into `buffer`: an op that moves its elements (a copy
    into a slice of it is a cat of its slices and the data) also takes other data."""
    moved = {buffer.id}
    for node in graph.nodes[buffer.id + 1:]:
        if node.op in LAYOUT_OPS and any(i in moved for i in node.inputs):
            if any(i not in moved for i in node.inputs):
                return True
            moved.add(node.id)
    return False


def _same_call(graph: Graph, node: Node, other: Graph) -> Node | None:
    """`node`, a collective of `graph`, on `other`: the call of its op over its group that comes as
    many calls later (ranks of different pipeline stages run different ops between them)."""
    def calls(g: Graph) -> list[Node]:
        return [n for n in g.nodes if n.op == node.op and n.attrs[-1] == node.attrs[-1]]

    k, theirs = calls(graph).index(node), calls(other)
    return theirs[k] if k < len(theirs) else None


class CollectiveOperands:
    """Divergences explained by what a collective or an op is handed."""

    def _misreduced(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first reduction of the chain whose op does not combine the parts it holds: found
        wherever it stands, since the ops before it may disagree only for want of a rule (a
        flattened gradient buffer's view)."""
        return next((found for node in chain if (found := self._wrong_reduce_op(rank, node)) is not None), None)

    def _wrong_reduce_op(self, rank: int, node: Node) -> Finding | None:
        """A reduction whose op does not combine the parts its inputs hold: shares of a sum need
        SUM (or AVG, a scaled sum), partial maxima need MAX."""
        if node.op not in ("all_reduce", "reduce_scatter"):
            return None
        held = self._held({self.run.ranks[rank][node.inputs[0]]}, set(PIECES))
        op = REDUCE_OP_NAMES.get(reduce_op(node), reduce_op(node).upper())
        if "piece" in held and op not in ("SUM", "AVG"):
            kind, whole, needed = "partial sum", "sum", "SUM"
        elif held == {"max_piece"} and op != "MAX":
            kind, whole, needed = "partial max", "maximum", "MAX"
        else:
            return self._summed_in_reference(rank, node, op)
        value = value_name(self.ranks[rank][node.inputs[0]])
        return Finding(
            "discrepancy",
            "wrong reduce op",
            f"wrong reduce op: `{node.op}` over ranks {list(node.attrs[-1])} combines {value}, each rank's share of "
            f"a {whole} over ranks (`{placement(kind)}`), with ReduceOp.{op}; the shares make the reference's "
            f"value only with ReduceOp.{needed}",
            [(rank, node)],
            op=node.op,
            fix=f"reduce {value} with ReduceOp.{needed}, not ReduceOp.{op}, at {line_of(node)}",
        )

    def _summed_in_reference(self, rank: int, node: Node, op: str) -> Finding | None:
        """An all-reduce by another op than SUM of values whose sum over its group is a value the
        reference computes (the two copies of a tied weight's gradient, each made whole on its own
        rank): the parts are terms of that sum, not shares of a maximum."""
        if node.op != "all_reduce" or op in ("SUM", "AVG") or self.region_of_reference(self.run.ranks[rank][node.id]):
            return None
        parts = [_same_call(self.ranks[rank], node, self.ranks[member]) for member in node.attrs[-1]]
        if any(p is None for p in parts):
            return None
        total = self.r.lin([(self.run.ranks[m][p.inputs[0]], Fraction(1)) for m, p in zip(node.attrs[-1], parts)])
        if not self.r.in_reference(total):
            return None
        value = value_name(self.ranks[rank][node.inputs[0]])
        return Finding(
            "discrepancy",
            "wrong reduce op",
            f"wrong reduce op: `{node.op}` over ranks {list(node.attrs[-1])} combines {value} with ReduceOp.{op}, but "
            f"the ranks' values of it are the terms of a sum the reference computes: only ReduceOp.SUM gives it",
            [(rank, node)],
            op=node.op,
            fix=f"reduce {value} with ReduceOp.SUM, not ReduceOp.{op}, at {line_of(node)}",
        )

    def _uninitialised_read(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first op of the chain whose operand holds elements of a buffer nobody wrote."""
        for node in chain:
            for i in node.inputs:
                found = self._unwritten(rank, i, f"`{node.op}` on rank {rank} reads", node)
                if found is not None:
                    return found
        return None

    def _unwritten_output(self, rank: int, node: Node) -> Finding | None:
        """An output that is (a view of) a buffer nobody wrote: the caller reads it."""
        return self._unwritten(rank, node.id, f"the output of rank {rank} holds", None)

    def _unwritten(self, rank: int, value: int, reading: str, reader: Node | None) -> Finding | None:
        """Sites: the value left unread that should fill the buffer; then, when nothing is written
        into the buffer at all, its allocation, where the fill belongs (`full = x.new_empty(...)`
        then the all-gather into it, in a helper whose caller reads the result: the reader may be
        far off), and the reader; else the reader first (the copies that leave part of it
        unwritten are there)."""
        graph = self.ranks[rank]
        empty = self._held({self.run.ranks[rank][value]}, {"empty"}, found_terms=True)
        if not empty:
            return None
        buffers = [graph[self.r.u[t].attrs[1]] for t in sorted(empty)]
        buffer, source = buffers[0], _unused_like(graph, buffers, len(self.ranks))
        read, made = [] if reader is None else [(rank, reader)], [(rank, buffer)]
        said = "" if source is None else f"; {value_name(source)} ({line_of(source)}), of its size or a " \
            "rank's part of it (or all ranks' parts), is computed and never read: probably what should fill it"
        return Finding(
            "discrepancy",
            "uninitialised memory read",
            f"uninitialised memory read: {reading} elements of {value_name(buffer)}, allocated empty at "
            f"{line_of(buffer)}, that nothing wrote: the collective or copy that should fill it is missing{said}",
            [*([] if source is None else [(rank, source)]), *(read + made if _written_into(graph, buffer) else made + read)],
            op=(reader or buffer).op,
            fix=f"fill {value_name(buffer)} (the collective or copy into it"
                f"{'' if source is None else ' from ' + value_name(source)})"
                f"{'' if reader is None else ' before ' + line_of(reader)}",
        )

    def _held(self, todo: set[int], wanted: set[str], found_terms: bool = False) -> set:
        """The ops among `wanted` found in the terms whose elements `todo` keeps (term ids with
        `found_terms`, else op names)."""
        seen, found = set(), set()
        while todo:
            t = todo.pop()
            seen.add(t)
            term = self.r.u[t]
            if term.op in wanted:
                found.add(t if found_terms else term.op)
            elif term.op in _KEEPING:
                todo |= set(term.args) - seen
        return found
