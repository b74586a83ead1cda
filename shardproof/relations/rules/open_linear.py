"""Open ops with no law of their own: congruence, and linearity where DTensor's strategies show it.

An op torch tags with nothing we read (`opaque`, ir/aten_ops.py) is equal to the reference's where
its arguments are (congruence). Where one operand is a partial sum or a combination of terms and
DTensor's sharding propagation keeps a `Partial(sum)` operand partial (`ir/sharding_laws.py`),
the op maps through the sum: a rank's row gather of its partial expert outputs is its share of
the gather of the whole. A buffer the op overwrites entirely is no argument (`writes.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.ir.sharding_laws import linear_in
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
    return r.literal(op, args, attrs, shape, dtype)
