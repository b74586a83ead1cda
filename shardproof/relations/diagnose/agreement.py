"""What counts as still agreeing with the reference: terms built from its values by regions and
linear structure alone, and the ops and terms that only move elements. Shared by the diagnoser and
by the partitioned execution, which stops at the first call whose outputs no longer agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.relations.rules.online_softmax import partial_result_of

if TYPE_CHECKING:
    from shardproof.relations.rules import Rules


PIECES = {"piece", "max_piece", "arg_piece", "top_piece"}  # one rank's part of a sum (or max, its position, a top k) over ranks
STRUCTURAL = {"slice", "cat", "bcast", "repeat", "lin", "full", "const", *PIECES}
LAYOUT_OPS = {"view", "permute", "slice", "expand", "convert", "cat"}
LAYOUT_TERMS = {"view", "permute", "slice", "bcast", "repeat"}  # normal-form terms that only move elements


def unreduced(rules: Rules, t: int) -> set[tuple]:
    """The pieces (kind, axis and range) that `t` holds without their sum (or max) over ranks."""
    term = rules.u[t]
    if term.op in PIECES:
        return {(term.op, term.attrs)}
    if term.op in ("lin", "slice", "bcast", "repeat"):
        return set().union(*(unreduced(rules, a) for a in term.args))
    return set()


def grounded(rules: Rules, t: int, memo: dict[int, bool], moved: bool = False) -> bool:
    """Built from reference values by regions and linear structure only, or from constants alone
    (a causal mask from a rank's positions, the same whatever the weights), or a partial result of
    an online softmax over such values (a block's attention or log-sum-exp: as a piece is of a
    sum, it is a part of the whole's before the merge): still agreeing. With `moved`, values whose
    elements are only moved (a parameter flattened into a buffer, a flat shard read back with a
    parameter's shape) agree too: a move changes no number, so the fault is where moved values
    meet an op that computes. Without it, such a move is where a wrong layout shows (shards
    concatenated along one dim, then reshaped), which the diagnoser looks for first."""
    if t not in memo:
        term = rules.u[t]
        inputs = term.args if term.op in STRUCTURAL else partial_result_of(rules, t)
        if moved and term.op in LAYOUT_TERMS:
            inputs = term.args[:1]
        memo[t] = rules.in_reference(t) or rules.of_constants(t) or (
            inputs is not None and all(grounded(rules, a, memo, moved) for a in inputs))
    return memo[t]
