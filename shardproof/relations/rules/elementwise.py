"""Elementwise ops: they commute with slices, concatenations, broadcasts and reshapes of all their
operands, and fold on constants where that is exact. The fallback of the more specific rules.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

import torch

from shardproof.ir.aten_ops import argument, overload
from shardproof.ir.ops import run_op
from shardproof.relations.assume import decided_bound, interval
from shardproof.relations.layout import box_along, box_shape
from shardproof.relations.rules.regions import cat_bounds

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


# Ops whose value on constants is exact in floating point: folding them changes no value.
_EXACT_ON_CONSTANTS = {"abs", "maximum", "minimum", "logical_not", "logical_and", "logical_or", "lt", "le", "gt", "ge",
                       "eq", "ne", "convert"}


def elementwise(r: Rules, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
    """Elementwise ops commute with slices, concatenation and broadcasting of all their operands."""
    values = [r.full_value(a) for a in args]
    folded = None if None in values else _folded(op, values, attrs)
    if folded is not None:
        return r.const(("full", folded), shape, dtype)
    bound = decided_bound(r, op, args, {}) if op in ("maximum", "minimum") and len(args) == 2 else None
    if bound is not None and r.shape(bound) == shape:  # a clamp the values' range never reaches
        return bound
    for a in args:
        for root, box in r.regions(a):
            if root == a:
                continue
            global_shape = r.shape(root)
            roots = [r.region_like(b, box, global_shape) for b in args]
            if None not in roots:
                return r.slice(r.build(op, tuple(roots), attrs, global_shape, dtype), box)
    for a in args:
        # a cat; or, computed from constants alone, one seen through broadcasts (a causal mask's rows
        # `positions[:, None]` of a rank holding several chunks of the sequence)
        exposed = a if r.u[a].op == "cat" else r.exposed_cat(a) if r.of_constants(a) else None
        if exposed is not None:
            dim, bounds = r.u[exposed].attrs[0], cat_bounds(r, exposed)
            parts = []
            for lo, hi in bounds:
                box = box_along(shape, dim, lo, hi)
                sub = tuple(r.slice(b, box) for b in args)
                parts.append(r.build(op, sub, attrs, box_shape(box), dtype))
            return r.cat(parts, dim)
    bases = [r.u[a] for a in args]
    if bases and all(b.op == "bcast" for b in bases) and len({b.attrs[0] for b in bases}) == 1:
        dims = bases[0].attrs[0]
        inner = r.build(op, tuple(b.args[0] for b in bases), attrs, tuple(shape[d] for d in dims), dtype)
        return r.bcast(inner, shape, dims)
    for a in args:
        source = viewed_from(r, a)
        inner = [unview(r, b, source) for b in args] if source is not None else [None]
        if None not in inner:
            return r.view(r.build(op, tuple(inner), attrs, source, dtype), shape)
    if op in _COMMUTATIVE:
        args = tuple(sorted(args))  # a * b and b * a are one term
    return r.literal(op, args, attrs, shape, dtype)


def _folded(op: str, values: list, attrs: tuple) -> object | None:
    """The op's value on constant operands where it is exact: ops exact in floating point (lerp's
    `|weight| >= 0.5` on a constant weight), and a square root that squares back to its operand
    (Adam's `sqrt(v)` of zero padding, whose update is then exactly zero)."""
    if op not in _EXACT_ON_CONSTANTS and op != "sqrt":
        return None
    value = run_op(op, [torch.tensor(float(v) if isinstance(v, Fraction) else v) for v in values], attrs).item()
    if op == "sqrt" and not (math.isfinite(value) and Fraction(value) ** 2 == Fraction(values[0])):
        return None
    return value


_COMMUTATIVE = {"mul", "maximum", "minimum", "logical_and", "logical_or", "eq", "ne"}


def viewed_from(r: Rules, t: int) -> tuple[int, ...] | None:
    """The shape `t` was reshaped from, if its normal form is a view (inside lin and piece)."""
    term = r.u[t]
    if term.op == "view":
        return r.shape(term.args[0])
    if term.op in ("lin", "piece"):
        return next((found for a in term.args if (found := viewed_from(r, a)) is not None), None)
    if term.op == "slice" and _last_dim_only(r, term):
        found = viewed_from(r, term.args[0])
        return None if found is None else found[:-1] + term.shape[-1:]
    return None


def _last_dim_only(r: Rules, term) -> bool:
    """A slice that cuts only the last dim (which a reshape of the rows keeps)."""
    box = term.attrs[0]
    return all((lo, hi) == (0, n) for (lo, hi), n in zip(box[:-1], r.shape(term.args[0])[:-1]))


def unview(r: Rules, t: int, shape: tuple[int, ...]) -> int | None:
    """A term X of `shape` with view(X) == t, if the normal form shows one."""
    term = r.u[t]
    if term.op == "view" and r.shape(term.args[0]) == shape:
        return term.args[0]
    if term.op == "full":
        return r.literal("full", (), term.attrs, shape, term.dtype)
    if term.op == "slice" and _last_dim_only(r, term):
        root = term.args[0]
        inner = unview(r, root, shape[:-1] + r.shape(root)[-1:])
        return None if inner is None else r.slice(inner, tuple((0, n) for n in shape[:-1]) + term.attrs[0][-1:])
    if term.op == "matmul" and len(r.shape(term.args[1])) == 2:  # rows reshaped into a product with one matrix
        rows = unview(r, term.args[0], shape[:-1] + r.shape(term.args[0])[-1:])
        return None if rows is None else r.build("matmul", (rows, term.args[1]), term.attrs, shape, term.dtype)
    if term.op == "bcast":  # a base spanning trailing dims the reshape keeps, broadcast over the rest
        dims, n = term.attrs[0], len(term.attrs[0])
        if dims == tuple(range(len(term.shape) - n, len(term.shape))) and term.shape[len(term.shape) - n :] == shape[len(shape) - n :]:
            return r.bcast(term.args[0], shape, tuple(range(len(shape) - n, len(shape))))
        return None
    if term.op in ("lin", "piece"):
        inner = [unview(r, a, shape) for a in term.args]
        if None in inner:
            return None
        if term.op == "lin":
            return r.lin(list(zip(inner, term.attrs[0])))
        return r.piece(inner[0], *term.attrs)
    return None


def unary(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    if op == "neg":
        return r.scale(args[0], -1)
    return elementwise(r, op, args, attrs, shape, dtype)


def add(r: Rules, args, attrs, shape, dtype) -> int:
    return r.lin([(args[0], Fraction(1)), (args[1], Fraction(1))])


def remainder(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """x % n is x where x lies in [0, n): torch.take_along_dim wraps its indices so, and an argmax's
    positions lie there."""
    divisor = argument(overload(op), attrs, "other")
    bounds = interval(r, args[0], {})
    if isinstance(divisor, int) and bounds is not None and bounds[0] >= 0 and bounds[1] < divisor:
        return args[0]
    return elementwise(r, op, args, attrs, shape, dtype)
