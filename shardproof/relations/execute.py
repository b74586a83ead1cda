"""Run the reference graph and all rank graphs symbolically into one universe of terms.

Ranks run in lock-step: each advances to its next collective, then the collective is resolved
for its whole group at once with its exact meaning (all_reduce = sum of the group's terms,
all_gather = concatenation in group order, reduce_scatter = this rank's chunk of the sum; a MAX
reduction is the elementwise max of the group's terms; all_to_all = the concatenation of the
pieces every member sends this rank, ir/all_to_all.py). A recv receives the term its sender sent
(relations/messages.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from shardproof.ir.all_to_all import mismatched_splits, pieces
from shardproof.ir.graph import BOUND_LEAF_PREFIX, Graph, Node
from shardproof.ir.ops import OPS, waits_for_peers
from shardproof.relations.layout import box_along
from shardproof.relations.messages import Mailbox
from shardproof.relations.mismatch import CollectiveMismatch
from shardproof.relations.rules import Rules


@dataclass
class Execution:
    rules: Rules
    reference: list[int]  # term of each reference node
    ranks: list[list[int]]  # term of each node, per rank


def execute(reference: Graph, ranks: list[Graph], rules: Rules | None = None) -> Execution:
    """Rank leaves named `reference-output:<i>` stand for the reference's output i (see steps.py)."""
    rules = rules or Rules()
    ref_terms = _run_local(rules, reference, [], 0, len(reference.nodes))
    rules.reference_size = len(rules.u)
    bound = {f"{BOUND_LEAF_PREFIX}{i}": ref_terms[out] for i, out in enumerate(reference.outputs)}
    rank_terms: list[list[int]] = [[] for _ in ranks]
    cursors = [0] * len(ranks)
    mailbox = Mailbox()
    while True:
        for r, graph in enumerate(ranks):
            stop = _next_collective(graph, cursors[r])
            rank_terms[r] = _run_local(rules, graph, rank_terms[r], cursors[r], stop, bound)
            cursors[r] = stop
        pending = [r for r, g in enumerate(ranks) if cursors[r] < len(g.nodes)]
        if not pending:
            mailbox.check_delivered()
            return Execution(rules, ref_terms, rank_terms)
        resolve_collective(rules, ranks, rank_terms, cursors, pending, mailbox)


def _next_collective(graph: Graph, start: int) -> int:
    for i in range(start, len(graph.nodes)):
        if waits_for_peers(graph.nodes[i].op):
            return i
    return len(graph.nodes)


def _run_local(
    rules: Rules, graph: Graph, terms: list[int], start: int, stop: int, bound: dict[str, int] | None = None
) -> list[int]:
    for node in graph.nodes[start:stop]:
        terms.append(term_of(rules, node, terms, graph.rank, bound or {}))
    return terms


def term_of(rules: Rules, node: Node, terms: list[int], rank: int | None, bound: dict[str, int]) -> int:
    if node.op == "leaf":
        name = node.attrs[0]
        return bound[name] if name in bound else rules.leaf(name, node.shape, node.dtype)
    if node.op == "const":
        spec = node.attrs[0]
        if spec[0] == "empty":  # contents never read: unique, so it can match nothing
            return rules.literal("empty", (), (rank, node.id), node.shape, node.dtype)
        return rules.const(spec, node.shape, node.dtype)
    args = tuple(terms[i] for i in node.inputs)
    if OPS[node.op].kind == "collective" and len(node.attrs[-1]) == 1:
        return args[0]  # over a group of one rank (the reference's world of one): the value itself
    if OPS[node.op].kind == "random":  # a random draw equals nothing, not even the same draw elsewhere
        return rules.literal(node.op, args, (rank, node.id), node.shape, node.dtype)
    return rules.build(node.op, args, node.attrs, node.shape, node.dtype)


def resolve_collective(
    rules: Rules, ranks: list[Graph], terms: list[list[int]], cursors: list[int], pending: list[int], mailbox: Mailbox
) -> None:
    """Move ranks past their sends and the recvs whose messages have come, or else resolve one
    collective that every member of its group has reached. Ranks outside the group may wait at
    collectives of other groups (a 2-D mesh interleaves its TP and DP groups); when no group is
    complete and no message comes, the ranks would hang."""
    if mailbox.progress(ranks, terms, cursors, pending):
        return
    for first in pending:
        node = ranks[first].nodes[cursors[first]]
        group = _group_of(node)
        members = [(r, _waiting_at(ranks, cursors, r)) for r in group]
        if OPS[node.op].kind == "p2p" or any(n is None or _group_of(n) != group or OPS[n.op].kind == "p2p" for _, n in members):
            continue
        mismatched = [(r, n) for r, n in members if n.op != node.op or (n.shape != node.shape and n.op != "all_to_all")]
        if mismatched:
            raise _mismatch(first, node, mismatched, _sizes_part(ranks, (first, node), mismatched))
        if node.op == "all_to_all":
            _check_splits(members)
        _exchange(rules, ranks, terms, cursors, group)
        return
    stuck = mailbox.waiting_recv(ranks, cursors, pending)
    if stuck is not None:
        raise stuck
    first = pending[0]
    node = ranks[first].nodes[cursors[first]]
    waiting = [(r, _waiting_at(ranks, cursors, r)) for r in _group_of(node)]
    raise _mismatch(first, node, [(r, n) for r, n in waiting if n is None or _group_of(n) != _group_of(node)])


def _waiting_at(ranks: list[Graph], cursors: list[int], rank: int) -> Node | None:
    """The collective `rank` waits at; None once it has finished (or is no rank at all)."""
    if rank >= len(ranks) or cursors[rank] >= len(ranks[rank].nodes):
        return None
    return ranks[rank].nodes[cursors[rank]]


def _sizes_part(ranks: list[Graph], mine: tuple[int, Node], others: list[tuple[int, Node]]) -> list[tuple[int, Node]]:
    """Where the ranks' tensors for one collective first take other shapes: from the collective,
    back through ops alike on both ranks, along an operand whose shapes differ, to the op whose
    operands agree but whose results do not (a loader's slice of another length, say), or to ops
    that differ (a slice of the whole on one rank is no op at all): the first of the two with a line."""
    (r1, a), (r2, b) = mine, next(((r, n) for r, n in others if n.op == mine[1].op and n.shape != mine[1].shape), mine)
    while a.op == b.op and len(a.inputs) == len(b.inputs):
        parting = [(ranks[r1][i], ranks[r2][j]) for i, j in zip(a.inputs, b.inputs) if ranks[r1][i].shape != ranks[r2][j].shape]
        if not parting:
            break
        a, b = parting[0]
    if a is mine[1]:
        return []
    return [pair for pair in ((r2, b), (r1, a)) if pair[1].loc is not None][:1]


def _mismatch(first: int, node: Node, others: list[tuple[int, Node | None]],
              parted: list[tuple[int, Node]] | None = None) -> CollectiveMismatch:
    def doing(n: Node | None) -> str:
        if n is None:
            return "has finished"
        if n.op == "call":  # a repeated module's call (shardproof.partition), collectives inside
            return f"calls module {n.attrs[2]}"
        return f"calls {n.op} over ranks {list(_group_of(n))}{shaped(n)}"

    def shaped(n: Node) -> str:  # tensors of other shapes: a real run fails or reads past their ends
        return f" for a tensor of shape {tuple(n.shape)}" if any(o and o.op == n.op and o.shape != n.shape
                                                                   for _, o in [(first, node), *others]) else ""

    where = ""
    if parted:
        (r, b), = parted
        where = f"; the shapes part at `{b.op}` at line {b.loc.line} of {b.loc.file.rsplit('/', 1)[-1]}, " \
                f"of shape {tuple(b.shape)} on rank {r}"
    return CollectiveMismatch(
        f"rank {first} calls {node.op} over ranks {list(_group_of(node))}{shaped(node)} but "
        + ", ".join(f"rank {r} {doing(n)}" for r, n in others) + where,
        (parted or []) + [(first, node)] + [(r, n) for r, n in others if n is not None],
    )


def _check_splits(members: list[tuple[int, Node]]) -> None:
    """Every member of an all_to_all receives pieces of the sizes sent to it."""
    nodes = [n for _, n in members]
    found = mismatched_splits([n.attrs[1] for n in nodes], [n.attrs[0] for n in nodes])
    if found is None:
        return
    (receiver, into), (sender, sent) = members[found[0]], members[found[1]]
    expects = into.attrs[0][found[1]] if len(into.attrs[0]) > found[1] else "no"
    sends = sent.attrs[1][found[0]] if len(sent.attrs[1]) > found[0] else "no"
    raise CollectiveMismatch(
        f"rank {receiver} calls all_to_all over ranks {list(into.attrs[-1])} expecting {expects} row(s) from rank {sender} "
        f"(output splits {list(into.attrs[0])}), but rank {sender} sends it {sends} (input splits {list(sent.attrs[1])}): "
        "a real run fails, hangs or reads the wrong rows. The output splits on rank p must be, in order, what every "
        "rank's input splits send rank p", [(receiver, into), (sender, sent)])


def _exchange(rules: Rules, ranks: list[Graph], terms: list[list[int]], cursors: list[int], group: tuple[int, ...]) -> None:
    members = [ranks[r].nodes[cursors[r]] for r in group]
    inputs = [terms[r][node.inputs[0]] for r, node in zip(group, members)]
    combined: dict[tuple, int] = {}  # (op, attrs) -> the group's combined term: built once, not once per member
    for position, (r, local) in enumerate(zip(group, members)):
        if local.op == "all_to_all":
            terms[r].append(_received(rules, local, members, inputs, position))
        else:
            key = (local.op, local.attrs, local.shape)
            if key not in combined:
                combined[key] = _combined(rules, local, inputs)
            terms[r].append(_share(rules, local, combined[key], position))
        cursors[r] += 1


def _received(rules: Rules, node: Node, members: list[Node], inputs: list[int], position: int) -> int:
    """What the member at `position` receives by an all_to_all: the pieces of every member's input
    sent to it, in group order (a piece of no rows is none)."""
    parts = [rules.slice(inputs[j], box_along(rules.shape(inputs[j]), 0, start, end))
             for j, start, end in pieces([m.attrs[1] for m in members], position) if end > start]
    return rules.cat(parts, 0) if parts else rules.const(("full", 0), node.shape, node.dtype)


def _group_of(node: Node) -> tuple[int, ...]:
    """The ranks of a collective's group (none for a call, which is not a collective)."""
    return () if node.op == "call" else tuple(node.attrs[-1])


_REDUCTIONS = ("max", "sum", "mean")  # others are kept as an opaque term over the group's inputs


def _combined(rules: Rules, node: Node, inputs: list[int]) -> int:
    """What the group's members' inputs combine to: their concatenation, or their reduction."""
    n = len(inputs)
    if node.op == "all_gather":
        return rules.cat(inputs, node.attrs[0])
    op = reduce_op(node)
    if op == "max":
        return rules.maximum(inputs)
    if op in ("sum", "mean"):
        weight = Fraction(1, n) if op == "mean" else Fraction(1)
        return rules.lin([(t, weight) for t in inputs])
    return rules.literal(f"all_reduce_{op}", tuple(inputs), (), node.shape, node.dtype)


def reduce_op(node: Node) -> str:
    """A reducing collective's op: sum, mean, max, ..."""
    return node.attrs[0] if node.op == "all_reduce" else node.attrs[1]


def _share(rules: Rules, node: Node, combined: int, position: int) -> int:
    """The member at `position`'s result: all of it, or its chunk of a reduce-scatter."""
    if node.op != "reduce_scatter" or reduce_op(node) not in _REDUCTIONS:
        return combined
    dim = node.attrs[0]
    size = node.shape[dim]
    return rules.slice(combined, box_along(rules.shape(combined), dim, position * size, (position + 1) * size))
