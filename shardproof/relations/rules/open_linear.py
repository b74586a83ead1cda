"""Open ops with no law of their own: congruence, and linearity where DTensor's strategies show it.

An op torch tags with nothing we read (`opaque`, ir/aten_ops.py) is equal to the reference's where
its arguments are (congruence). Where one operand is a partial sum or a combination of terms and
DTensor's sharding propagation keeps a `Partial(sum)` operand partial (`ir/sharding_laws.py`),
the op maps through the sum: a rank's row gather of its partial expert outputs is its share of
the gather of the whole. Where operands are blocks of tensors along one dim and DTensor's
strategies keep that dim sharded, the op on the blocks is the block of the op on the wholes (a
rank's tokens' top-k experts are those tokens' rows of every token's). A buffer the op
overwrites entirely is no argument (`writes.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.ir.sharding_laws import blockwise_along, linear_in
from shardproof.relations.rules.blocks import of_blocks
from shardproof.relations.rules.writes import overwritten

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def opaque(r: Rules, op: str, args: tuple[int, ...], attrs, shape: tuple[int, ...], dtype: str) -> int:
    args = overwritten(r, op, args, attrs)
    inputs = tuple((r.shape(a), r.u[a].dtype) for a in args)
    zeros = frozenset(i for i, a in enumerate(args) if r.full_value(a) == 0)  # a sum of zeros: partial too
    for i, a in enumerate(args):
        if r.op(a) in ("lin", "piece") and linear_in(op, attrs, inputs, zeros | {i}):
            return r._map_linear(a, lambda t: r.build(op, args[:i] + (t,) + args[i + 1 :], attrs, shape, dtype), shape)
    blocked = by_blocks(r, op, args, attrs, shape, dtype)
    return blocked if blocked is not None else r.literal(op, args, attrs, shape, dtype)


def by_blocks(r: Rules, op: str, args: tuple[int, ...], attrs, shape: tuple[int, ...], dtype: str,
              of_reference: bool = False) -> int | None:
    """op on the same rows of its operands as those rows of op on the wholes, where DTensor's
    strategies keep the rows' dim sharded through op (`rules/blocks.py`)."""
    inputs_of = lambda wholes: tuple((r.shape(w), r.u[w].dtype) for w in wholes)  # noqa: E731
    return of_blocks(r, args, shape, lambda wholes, blocks, dim, whole_shape: r.build(op, wholes, attrs, whole_shape, dtype)
                     if blockwise_along(op, attrs, inputs_of(wholes), blocks, dim) else None, of_reference)
