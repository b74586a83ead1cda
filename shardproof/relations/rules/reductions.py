"""Reductions and softmax: a sum or max over a sliced axis is a piece of the whole one; log-softmax
is spelled as its max-shifted decomposition, with the log and exp rules that meet it, so a
vocab-parallel cross entropy meets the reference's op for op.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

from shardproof.ir.aten_ops import leading_dims, output_shape, reduced_dims
from shardproof.relations.layout import reshape_groups
from shardproof.relations.rules.elementwise import elementwise
from shardproof.relations.rules import flash_backward, masked_keys
from shardproof.relations.rules.linear import LinearRules
from shardproof.relations.rules.lookups import unbroadcast
from shardproof.relations.rules.one_hot import is_one_hot
from shardproof.relations.rules.online_softmax import log_of_sum_exp
from shardproof.relations.rules.values import FLOAT_DTYPES, is_finite_number, real

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def reduce(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    dims, keepdim = attrs
    x = args[0]
    root_shape = r.shape(r.as_region(x)[0])
    ones = [d for d in dims if root_shape[d] == 1]  # not a one-wide shard of a larger sum: that stays a piece
    if op == "argmax" and ones and not keepdim:
        return r.literal("full", (), (0,), shape, dtype)  # the only position there is
    if ones and not keepdim:  # reducing a size-1 dim only drops it, from the whole the region is cut from
        root, box = r.as_region(x)
        kept = [d for d in range(len(box)) if d not in ones]
        squeezed = r.slice(r.view(root, tuple(root_shape[d] for d in kept)), tuple(box[d] for d in kept))
        rest = tuple(d - sum(o < d for o in ones) for d in dims if d not in ones)
        return r.build(op, (squeezed,), (rest, False), shape, dtype) if rest else squeezed
    if keepdim:
        inner_shape = tuple(s for d, s in enumerate(r.shape(x)) if d not in dims)
        return r.view(r.build(op, (x,), (dims, False), inner_shape, dtype), shape)
    term = r.u[x]
    if op == "sum" and dims == (len(term.shape) - 1,):
        moved = flash_backward.row_dot(r, x, shape, dtype)
        if moved is not None:
            return moved
    filled = r.full_value(x)
    if op in _SPLIT_REDUCTIONS and is_finite_number(filled) and dtype in FLOAT_DTYPES:
        # a constant's sum is the value times the count (the sum of the smoothing term of a label-
        # smoothed loss's gradient over the vocab), its max the value
        constant = r.literal("full", (), (filled,), shape, dtype)
        return r.scale(constant, math.prod(term.shape[d] for d in dims)) if op == "sum" else constant
    if op == "sum" and is_one_hot(r, x) and term.attrs[0] in dims:
        return r.build("sum", (term.args[2],), attrs, shape, dtype)  # one entry per row: the written values
    if op in ("sum", "amax") and term.op == "view":
        unviewed = _reduce_through_view(r, op, term.args[0], term.shape, dims, shape, dtype)
        if unviewed is not None:
            return unviewed
    if op in ("sum", "amax") and term.op == "matmul" and r.op(term.args[0]) == "view" and len(r.shape(term.args[1])) == 2:
        # rows reshaped into a product with one matrix are the product's rows reshaped (the normal
        # form keeps such a reshape inside the product): reduced as that reshape is
        rows = r.u[term.args[0]].args[0]
        if r.shape(rows)[-1] == r.shape(term.args[0])[-1]:
            product = r.build("matmul", (rows, term.args[1]), term.attrs, r.shape(rows)[:-1] + term.shape[-1:], term.dtype)
            unviewed = _reduce_through_view(r, op, product, term.shape, dims, shape, dtype)
            if unviewed is not None:
                return unviewed
    if op == "sum" and term.op in ("lin", "piece"):
        return r._map_linear(x, lambda t: r.build(op, (t,), attrs, shape, dtype), shape)
    if op in _SPLIT_REDUCTIONS and term.op == "bcast" and term.dtype == real(dtype):
        return _reduce_copies(r, op, x, dims, shape, dtype)
    if op == "sum" and term.op == "cat" and term.attrs[0] in dims:  # a sum over the joined dim adds the parts' sums
        return r.lin([(r.build(op, (p,), attrs, shape, dtype), Fraction(1)) for p in term.args])
    if term.op == "cat" and term.attrs[0] not in dims:  # reducing along the joined dim joins the parts' reductions
        joined = term.attrs[0]
        parts = [r.build(op, (p,), attrs, tuple(n for d, n in enumerate(r.shape(p)) if d not in dims), dtype) for p in term.args]
        return r.cat(parts, joined - sum(d < joined for d in dims))
    root, box = r.as_region(x)
    if root != x:
        reduced_restricted = [d for d in dims if box[d] != (0, r.shape(root)[d])]
        kept_box = tuple(b for d, b in enumerate(box) if d not in dims)
        global_out = tuple(s for d, s in enumerate(r.shape(root)) if d not in dims)
        if not reduced_restricted:
            return r.slice(r.build(op, (root,), attrs, global_out, dtype), kept_box)
        if (op in _SPLIT_REDUCTIONS or op == "argmax") and len(reduced_restricted) == 1:
            d = reduced_restricted[0]
            size = r.shape(root)[d]
            whole_d = r.slice(root, tuple((0, size) if k == d else b for k, b in enumerate(box)))
            total = r.build(op, (whole_d,), attrs, shape, dtype)
            lo, hi = box[d]
            if op == "argmax":  # a position within the shard: the max's position over the shard, less its start
                offset = r.literal("full", (), (lo,), shape, dtype)
                return r.lin([(r.arg_piece(total, ("amax", d, root), lo, hi, size), Fraction(1)), (offset, Fraction(-1))])
            return _SPLIT_REDUCTIONS[op](r, total, (op, d, root), lo, hi, size)
    return r.literal(op, (x,), attrs, shape, dtype)


# A reduction over part of an axis is a part of the reduction over all of it: a piece of a sum,
# a max piece of a max.
_SPLIT_REDUCTIONS: dict[str, Callable[..., int]] = {"sum": LinearRules.piece, "amax": LinearRules.max_piece}


def _reduce_copies(r: Rules, op: str, x: int, dims: tuple[int, ...], shape, dtype) -> int:
    """Reducing a broadcast reduces its base over the reduced base dims (a bias summed over the
    hidden dim is one number for every token, however many tokens a rank holds) and copies of
    one value over the reduced broadcast dims: a sum over them is the value times their count,
    a max over them is the value."""
    term = r.u[x]
    base, placed = term.args[0], term.attrs[0]
    base_dims = tuple(i for i, d in enumerate(placed) if d in dims)
    kept = [(i, d) for i, d in enumerate(placed) if d not in dims]
    inner_shape = tuple(r.shape(base)[i] for i, _ in kept)
    inner = r.build(op, (base,), (base_dims, False), inner_shape, dtype) if base_dims else base
    out = r.bcast(inner, shape, tuple(d - sum(1 for c in dims if c < d) for _, d in kept))
    copies = math.prod(term.shape[d] for d in dims if d not in placed)
    return r.scale(out, copies) if op == "sum" else out


def _reduce_through_view(
    r: Rules, op: str, source: int, viewed: tuple[int, ...], dims: tuple[int, ...], shape: tuple[int, ...], dtype: str
) -> int | None:
    """Reducing whole groups of a reshape of `source` to `viewed` reduces the source over those
    groups' source dims: summing a flattened (b*s, h) over its rows sums (b, s, h) over b and s."""
    groups = reshape_groups(r.shape(source), viewed)
    if groups is None:
        return None
    reduced, source_dims = set(dims), []
    for gi, gj in groups:
        if gj and set(gj) <= reduced:
            source_dims.extend(gi)
        elif reduced & set(gj):
            return None
    source_dims = [d for d in source_dims if r.shape(source)[d] != 1]
    if not source_dims:  # only size-1 dims reduced
        return r.view(source, shape)
    kept = tuple(n for d, n in enumerate(r.shape(source)) if d not in source_dims)
    return r.view(r.build(op, (source,), (tuple(sorted(source_dims)), False), kept, dtype), shape)


def open_reduction(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """A reduction torch tags as one (`all`, `argmax`, `logsumexp`, `var`, ...; ir/aten_ops.py)
    reduces each fiber along its dims on its own, so it commutes with the layouts of the dims it
    keeps."""
    x = args[0]
    dims, keepdim = reduced_dims(op, attrs, len(r.shape(x)))
    kept = [d for d in range(len(r.shape(x))) if d not in dims]
    out_dims = {d: (d if keepdim else i) for i, d in enumerate(kept)}
    found = through_kept_dims(r, op, args, attrs, dtype, out_dims) if len(args) == 1 else None
    return found if found is not None else r.literal(op, args, attrs, shape, dtype)


def leading(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """A view reading each index of its input's leading dims on its own (a complex tensor as real
    pairs and back) commutes with the layouts of those dims."""
    out_dims = {d: d for d in range(leading_dims(op, len(r.shape(args[0]))))}
    found = through_kept_dims(r, op, args, attrs, dtype, out_dims)
    if found is not None:
        return found
    inner = r.u[args[0]]
    if inner.op in _TRAILING_INVERSES.get(op, ()) and r.shape(inner.args[0]) == shape:
        return inner.args[0]  # view_as_real(view_as_complex(x)) is x, and the other way round
    return r.literal(op, args, attrs, shape, dtype)


_TRAILING_INVERSES = {"aten.view_as_real.default": ("aten.view_as_complex.default",),
                      "aten.view_as_complex.default": ("aten.view_as_real.default",)}


def through_kept_dims(r: Rules, op: str, args, attrs, dtype: str, kept: dict[int, int]) -> int | None:
    """op(x) for x a region, or a concatenation, along dims the op keeps (input dim -> output dim),
    every other dim whole: that region or concatenation of op of the whole (its shape as torch's
    meta kernel gives it); None when x is neither."""
    x = args[0]

    def out_shape(t: int) -> tuple[int, ...]:
        return output_shape(op, attrs, ((r.shape(t), r.u[t].dtype),))

    root, box = r.as_region(x)
    if root != x and all(box[d] == (0, r.shape(root)[d]) for d in range(len(box)) if d not in kept):
        whole = out_shape(root)
        region = [(0, n) for n in whole]
        for d, o in kept.items():
            region[o] = box[d]
        return r.slice(r.build(op, (root,), attrs, whole, dtype), tuple(region))
    term = r.u[x]
    if term.op == "cat" and term.attrs[0] in kept:
        return r.cat([r.build(op, (p,), attrs, out_shape(p), dtype) for p in term.args], kept[term.attrs[0]])
    return None


def softmax(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    (dim,) = attrs
    x = args[0]
    root, box = r.as_region(x)
    if root != x and box[dim] == (0, r.shape(root)[dim]):
        return r.slice(r.build(op, (root,), attrs, r.shape(root), dtype), box)
    term = r.u[x]
    if term.op == "cat" and term.attrs[0] != dim:
        return r.cat([r.build(op, (p,), attrs, r.shape(p), dtype) for p in term.args], term.attrs[0])
    visible = masked_keys.visible_keys(r, x, dim)
    if visible is not None:  # the keys left by a mask hiding the rest of the row: the row's softmax there
        root, box = visible
        rows = r.slice(root, tuple((0, r.shape(root)[dim]) if d == dim else b for d, b in enumerate(box)))
        keys = tuple(box[d] if d == dim else (0, n) for d, n in enumerate(shape))
        return r.slice(r.build(op, (rows,), attrs, r.shape(rows), dtype), keys)
    return r.literal(op, (x,), attrs, shape, dtype)


def log_softmax(r: Rules, args, attrs, shape, dtype) -> int:
    """log_softmax(x) = (x - m) - log(sum(exp(x - m))), m = max(x) along the dim: the spelling a
    vocab-parallel cross entropy computes across ranks. The shift m cancels over the reals, but
    both sides compute it, so their terms meet op for op."""
    (dim,) = attrs
    x = args[0]
    row_shape = tuple(1 if d == dim else s for d, s in enumerate(shape))  # keepdim, then expand: as it is spelled
    over_dim = ((dim,), True)
    peak = r.expand(r.build("amax", (x,), over_dim, row_shape, dtype), shape)
    shifted = r.lin([(x, Fraction(1)), (peak, Fraction(-1))])
    total = r.build("sum", (r.build("exp", (shifted,), (), shape, dtype),), over_dim, row_shape, dtype)
    log_total = r.expand(r.build("log", (total,), (), row_shape, dtype), shape)
    return r.lin([(shifted, Fraction(1)), (log_total, Fraction(-1))])


def log(r: Rules, args, attrs, shape, dtype) -> int:
    """log(exp(a)) = a, and log(exp(a) / b) = a - log(b) wherever the left side is defined: the log
    of softmax probabilities (as cross entropy with label smoothing takes it) is a log-softmax."""
    x = r.u[args[0]]
    if x.op == "exp":
        return x.args[0]
    if x.op == "div" and r.op(x.args[0]) == "exp":
        exponent, divisor = r.u[x.args[0]].args[0], x.args[1]
        return r.lin([(exponent, Fraction(1)), (r.build("log", (divisor,), attrs, shape, dtype), Fraction(-1))])
    found = log_of_sum_exp(r, args[0], shape, dtype)
    return found if found is not None else elementwise(r, "log", args, attrs, shape, dtype)


def exp(r: Rules, args, attrs, shape, dtype) -> int:
    """exp(a - log b) = exp(a) / b (and exp(a + log b) = exp(a) * b): the exp of a log-softmax (its
    backward takes one) is the softmax exp(x - m) / sum(exp(x - m)) a vocab-parallel loss spells."""
    term = r.u[args[0]]
    if term.op == "lin":
        for i, (t, c) in enumerate(zip(term.args, term.attrs[0])):
            inner = r.u[unbroadcast(r, t)]
            if c in (1, -1) and inner.op == "log":
                base = inner.args[0] if t == unbroadcast(r, t) else r.bcast(inner.args[0], shape, r.u[t].attrs[0])
                rest = r.lin([(a, k) for j, (a, k) in enumerate(zip(term.args, term.attrs[0])) if j != i])
                power = r.build("exp", (rest,), attrs, shape, dtype)
                return r.build("div" if c == -1 else "mul", (power, base), (), shape, dtype)
    probs = flash_backward.probabilities(r, args[0], shape, dtype)
    return probs if probs is not None else elementwise(r, "exp", args, attrs, shape, dtype)
