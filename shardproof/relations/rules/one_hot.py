"""One-hot writes: scatters of one entry per row normalize to a one-hot scatter_add, which absorbs
factors constant along its dim; a rank's one-hot of the ids in its vocab range is a slice of the
reference's one-hot.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from shardproof.relations.assume import rebuild
from shardproof.relations.rules.blocks import of_blocks
from shardproof.relations.rules.masks import is_shift_of, range_masks
from shardproof.relations.rules.slots import row_masked
from shardproof.relations.rules.values import FLOAT_DTYPES, is_finite_number

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def scatter(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """Writes of one entry per row along `dim` (the index has size 1 there). Normal form: a one-hot
    scatter_add(0, dim, index, values). A write into x is x plus the one-hot of the change; a rank's
    one-hot of the ids in its range [lo, hi) is the [lo, hi) slice of the one-hot over the axis."""
    base, index, src = args
    (dim,) = attrs
    values = r.u[src]
    if values.op == "lin" and len(values.args) == 1 and dtype in FLOAT_DTYPES and r.full_value(base) == 0:
        # into zeros, a write is linear in its values, whichever entries it writes: the scale moves
        # outside (a rank's gradient of its own mean, rescaled by an average over ranks later)
        return r.scale(r.build(op, (base, index, values.args[0]), attrs, shape, dtype), values.attrs[0][0])
    if values.op == "piece" and r.full_value(base) == 0:  # and so a share of a sum stays one (each
        # target takes the entry at the same position on every rank)
        return r._map_linear(src, lambda t: r.build(op, (base, index, t), attrs, shape, dtype), shape)
    rows = of_blocks(r, args, shape, lambda wholes, blocks, cut, whole_shape: r.build(op, wholes, attrs, whole_shape, dtype)
                     if len(blocks) == 3 and cut != dim else None)  # each line across `dim` written from its own
    if rows is not None:
        return rows
    if r.shape(index)[dim] != 1:
        return r.literal(op, args, attrs, shape, dtype)
    zeros = r.literal("full", (), (0.0 if dtype in FLOAT_DTYPES else 0,), shape, dtype)
    if r.full_value(base) != 0:
        change = src
        if op == "scatter":
            here = r.build("gather", (base, index), attrs, r.shape(index), dtype)
            change = r.lin([(src, Fraction(1)), (here, Fraction(-1))])
        one_hot = r.build("scatter_add", (zeros, index, change), attrs, shape, dtype)
        return r.lin([(base, Fraction(1)), (one_hot, Fraction(1))])
    if r.full_value(src) == 0:
        return zeros
    constant = r.full_value(src)
    if values.op == "lin" and len(values.args) == 1:  # linear in the values: scale outside
        return r.scale(r.build("scatter_add", (zeros, index, values.args[0]), attrs, shape, dtype), values.attrs[0][0])
    if is_finite_number(constant) and constant != 1 and dtype in FLOAT_DTYPES:
        ones = r.literal("full", (), (1.0,), r.shape(src), dtype)
        return r.scale(r.build("scatter_add", (zeros, index, ones), attrs, shape, dtype), constant)
    local = _local_one_hot(r, index, src, dim, shape, dtype) or _region_of_one_hot(r, index, src, dim, shape, dtype)
    if local is not None:
        return local
    if r.reference_size is None:
        r.reference_one_hots.setdefault((dim, index), set()).add(shape[dim])
    return r.literal("scatter_add", (zeros, index, src), attrs, shape, dtype)


def _local_one_hot(r: Rules, index: int, src: int, dim: int, shape, dtype) -> int | None:
    """scatter_add(0, dim, I, S) on a rank owning [lo, hi) of the axis, where S is zero for ids
    outside [lo, hi) and I is ids - lo inside it: the [lo, hi) slice of scatter_add(0, dim, ids, S')
    with S' the values inside, over the axis width the reference wrote such a one-hot with. In the
    reference, [lo, hi) covering the whole axis (the same masked code run on one rank) gives that
    one-hot itself: ids outside the axis write nothing either way."""
    for mask, (ids, lo, hi, outside) in range_masks(r, src):
        if hi - lo != shape[dim] or r.u[ids].shape and math.prod(r.shape(ids)) != math.prod(r.shape(index)):
            continue
        true, false = (r.const(("full", v), r.shape(mask), "bool") for v in (True, False))
        inside, beyond = (false, true) if outside else (true, false)
        if r.full_value(rebuild(r, src, {mask: beyond}, {})) != 0 or not is_shift_of(r, index, ids, lo, hi, {mask: inside}):
            continue
        whole_index = r.view(ids, r.shape(index))
        if (lo, hi) == (0, shape[dim]) and r.reference_size is None:
            widths = [hi]
        else:
            widths = sorted(w for w in r.reference_one_hots.get((dim, whole_index), ()) if w >= hi)
        if not widths:
            continue
        whole_shape = tuple(widths[0] if d == dim else n for d, n in enumerate(shape))
        zeros = r.literal("full", (), (0.0 if dtype in FLOAT_DTYPES else 0,), whole_shape, dtype)
        values = rebuild(r, src, {mask: inside}, {})
        whole = r.build("scatter_add", (zeros, whole_index, values), (dim,), whole_shape, dtype)
        return r.slice(whole, tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(shape)))
    return None


def _region_of_one_hot(r: Rules, index: int, src: int, dim: int, shape, dtype) -> int | None:
    """scatter_add(0, dim, I[box], S[box]) = scatter_add(0, dim, I, S)[box] where the box takes all
    of `dim`: a scatter along `dim` writes each of the other positions on its own (a microbatch's
    rows of the one-hot of its token ids are those rows of the batch's). Constant values fit any box."""
    whole_index, box = r.as_region(index)
    if whole_index == index or box[dim] != (0, r.shape(whole_index)[dim]):
        return None
    whole_shape = tuple(n if d == dim else r.shape(whole_index)[d] for d, n in enumerate(shape))
    if r.u[src].op == "full":
        values = r.literal("full", (), r.u[src].attrs, r.shape(whole_index), dtype)
    else:
        values = r.region_like(src, box, r.shape(whole_index))
        if values is None:
            return None
    zeros = r.literal("full", (), (0.0 if dtype in FLOAT_DTYPES else 0,), whole_shape, dtype)
    whole = r.build("scatter_add", (zeros, whole_index, values), (dim,), whole_shape, dtype)
    return r.slice(whole, tuple((0, n) if d == dim else box[d] for d, n in enumerate(shape)))


def is_one_hot(r: Rules, t: int) -> bool:
    term = r.u[t]
    return term.op == "scatter_add" and r.full_value(term.args[0]) == 0


def _constant_along(r: Rules, t: int, dim: int) -> bool:
    term = r.u[t]
    return term.op == "full" or (term.op == "bcast" and dim not in term.attrs[0])


def one_hot_times(r: Rules, a: int, factor: int, attrs, shape, dtype) -> int | None:
    """A one-hot (or a sum with one) times a factor that is constant along its dim: the factor
    moves into the written values, onto each term of the sum."""
    term = r.u[a]
    hots = [t for t in (term.args if term.op == "lin" else (a,)) if is_one_hot(r, t)]
    if not hots or not all(_constant_along(r, factor, r.u[h].attrs[0]) for h in hots):
        return None
    if term.op == "lin":
        return r.lin([(r.build("mul", (t, factor), attrs, shape, dtype), c) for t, c in zip(term.args, term.attrs[0])])
    zeros, index, src = term.args
    row = r.slice(factor, tuple((0, n) for n in r.shape(index)))
    return r.build("scatter_add", (zeros, index, r.build("mul", (src, row), attrs, r.shape(src), dtype)), term.attrs, shape, dtype)


def masked_rows_into_one_hot(r: Rules, a: int, b: int, attrs, shape, dtype) -> int | None:
    """onehot^T @ rows(b), b's rows masked (zero where a mask per row is false, b perhaps reshaped
    from (tokens..., width)): the mask moves into the one-hot's values, (onehot * m)^T @ b', so a
    rank's one-hot of the ids in its vocabulary range is a slice of the reference's (torchtitan's
    vocab-parallel embedding scales its rows by a float mask, so its gradient is masked so)."""
    hot_t = r.u[a]
    transposed = hot_t.op == "permute" and hot_t.attrs[0] == (1, 0)
    if hot_t.op == "view" and r.shape(hot_t.args[0]) == hot_t.shape[::-1] and hot_t.shape[0] == 1:
        transposed = True  # a one-hot of one column transposed is that column as a row
    if not transposed or not is_one_hot(r, hot_t.args[0]) or r.u[hot_t.args[0]].attrs[0] != 1:
        return None
    masked = _row_masked(r, b) or row_masked(r, b)
    if masked is None:
        return None
    keep, rows = masked
    zeros, index, src = r.u[hot_t.args[0]].args
    kept = r.build("where", (r.view(keep, r.shape(src)), src, r.const(("full", 0.0), r.shape(src), r.u[src].dtype)), (),
                   r.shape(src), r.u[src].dtype)
    hot = r.build("scatter_add", (zeros, index, kept), (1,), r.shape(hot_t.args[0]), hot_t.dtype)
    return r.build("matmul", (r.permute(hot, (1, 0)), rows), attrs, shape, dtype)


def _row_masked(r: Rules, t: int) -> tuple[int, int] | None:
    """(m, x) with t the (count, width) rows of where(m broadcast along the trailing dims, x, 0),
    m holding one flag per row (count of them); or of where(m, 0, x), with m negated."""
    term = r.u[t]
    count = term.shape[0]
    inner = r.u[term.args[0]] if term.op == "view" else term
    if inner.op != "where" or len(term.shape) != 2:
        return None
    cond, when_true, when_false = inner.args
    if r.full_value(when_false) == 0:
        keep, x = cond, when_true
    elif r.full_value(when_true) == 0:
        keep, x = r.build("logical_not", (cond,), (), r.shape(cond), "bool"), when_false
    else:
        return None
    flag = r.u[keep]
    if flag.op != "bcast":
        return None
    per_row = flag.args[0]
    if flag.attrs[0] != tuple(range(len(r.shape(per_row)))) or math.prod(r.shape(per_row)) != count:
        return None
    return r.view(per_row, (count, 1)), r.view(x, term.shape)
