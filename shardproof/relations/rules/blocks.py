"""Ops computed block by block along one dim: on the same rows of their operands, the op is those
rows of the op on the wholes (op(X[rows]) = op(X)[rows]), where the op's law says so. Which ops
and operands may be blocks is the caller's: DTensor's strategies for open ops (`open_linear.py`),
the dims other than the written one for scatter (`one_hot.py`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from shardproof.relations.layout import box_along

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

_SHARES = ("piece", "max_piece", "arg_piece", "top_piece")

# (operands as wholes, which of them are blocks, the dim, the output's whole shape) -> the op on them, or None
WholeOp = Callable[[tuple[int, ...], frozenset[int], int, tuple[int, ...]], "int | None"]


def of_blocks(r: Rules, args: tuple[int, ...], shape: tuple[int, ...], whole_op: WholeOp, of_reference: bool = False) -> int | None:
    """The op's rows [lo, hi) of `whole_op` on the wholes, where an operand is rows [lo, hi) of a
    whole along one dim (cut nowhere else) and the output has as many rows there; every operand
    that is the same rows of a whole stands for it, the others are read as they are.
    `of_reference`: only rows of a whole the reference computed (where other laws of the op
    would otherwise meet the rows as they are)."""
    for a in args:
        root, box = r.as_region(a)
        cut = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, r.shape(root)[d])]
        if root == a or len(cut) != 1 or of_reference and not r.in_reference(root):
            continue
        dim, (lo, hi) = cut[0], box[cut[0]]
        size = r.shape(root)[dim]
        if len(shape) <= dim or shape[dim] != hi - lo:
            continue
        wholes, blocks = [], set()
        for i, b in enumerate(args):
            b_shape = r.shape(b)
            whole = r.region_like(b, box_along(b_shape, dim, lo, hi), _resized(b_shape, dim, size)) \
                if len(b_shape) > dim and b_shape[dim] == hi - lo else None
            if whole is not None:
                blocks.add(i)
            wholes.append(b if whole is None else whole)
        if any(r.op(w) in _SHARES for w in wholes):  # one rank's share of a sum or top k: no value of its own
            continue
        found = whole_op(tuple(wholes), frozenset(blocks), dim, _resized(shape, dim, size))
        if found is not None:
            return r.slice(found, box_along(shape, dim, lo, hi))
    return None


def _resized(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    return shape[:dim] + (size,) + shape[dim + 1 :]
