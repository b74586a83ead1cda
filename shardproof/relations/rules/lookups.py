"""Lookups: embedding and gather read a table at ids. One rank's lookup into its shard of a
vocab-parallel table, with ids shifted and masked to the shard, is a piece of the reference's lookup.
"""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

from shardproof.relations.assume import rebuild
from shardproof.relations.layout import Box
from shardproof.relations.rules.elementwise import elementwise
from shardproof.relations.rules.flash_backward import vanishes
from shardproof.relations.rules.masks import assuming, is_shift_of, outside_range
from shardproof.relations.rules.slots import whole_where
from shardproof.relations.rules.topk import pick_of_top

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def embedding(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """Rows of a table at ids: slices of the table's columns or of the ids move out; linear in a
    table that holds a partial sum (a rank's rows of its partial expert outputs are its share of the
    rows of the whole, as DTensor keeps `x[idx]` of a `Partial` operand partial)."""
    weight, ids = args
    root_w, box_w = r.as_region(weight)
    if root_w != weight and box_w[0] == (0, r.shape(root_w)[0]):
        global_shape = shape[:-1] + (r.shape(root_w)[1],)
        return r.slice(r.build(op, (root_w, ids), attrs, global_shape, dtype), tuple((0, s) for s in shape[:-1]) + (box_w[1],))
    root_i, box_i = r.as_region(ids)
    if root_i != ids:
        global_shape = r.shape(root_i) + shape[-1:]
        return r.slice(r.build(op, (weight, root_i), attrs, global_shape, dtype), box_i + ((0, shape[-1]),))
    table = r.u[weight]
    if table.op == "piece" or (table.op == "lin" and any(r.op(a) == "piece" for a in table.args)):
        return r._map_linear(weight, lambda t: r.build(op, (t, ids), attrs, shape, dtype), shape)
    return r.literal(op, args, attrs, shape, dtype)


def where(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    cond, when_true, when_false = (args[0], *(_promoted(r, a, dtype) for a in args[1:]))
    known = r.full_value(cond)
    if isinstance(known, bool):
        return when_true if known else when_false
    when_true, when_false = assuming(r, when_true, cond, True), assuming(r, when_false, cond, False)
    if when_true == when_false:
        return when_true
    if r.full_value(when_true) == 0 and vanishes(r, when_false, cond):
        return when_false  # masked_fill's backward of probabilities the mask already zeroes
    chosen = r.full_value(cond)
    if chosen is not None:
        return when_true if chosen else when_false
    masked = _masked_lookup(r, cond, when_true, when_false)
    if masked is None and r.full_value(when_false) == 0:
        negated = r.build("logical_not", (cond,), (), shape, r.u[cond].dtype)
        masked = _masked_lookup(r, negated, when_false, when_true)
    if masked is not None:
        return masked
    renumbered = whole_where(r, cond, when_true, when_false)
    if renumbered is not None:  # a rank's lookups renumbered into its rows, read where the mask keeps them
        return r.build(op, (cond, *renumbered), attrs, shape, dtype)
    for value, zero in ((when_true, when_false), (when_false, when_true)):
        if r.full_value(zero) != 0:
            continue
        branches = (lambda t: (t, zero)) if value == when_true else (lambda t: (zero, t))
        inner, factor = r.common_factor(value)
        if factor != 1:  # a scale moves out (a rank's gradient scaled by its share of the loss, the reference's by the whole)
            return r.scale(r.build(op, (cond, *branches(inner)), attrs, shape, dtype), factor)
        if r.op(value) == "piece":  # linear in the kept value: a partial sum stays one
            return r._map_linear(value, lambda t: r.build(op, (cond, *branches(t)), attrs, shape, dtype), shape)
        parts = r.exposed_cat(value)  # and so cut where the value is, seen through a broadcast or permute
        if parts is not None and parts != value:
            return elementwise(r, op, (cond, *branches(parts)), attrs, shape, dtype)
    return elementwise(r, op, (cond, when_true, when_false), attrs, shape, dtype)


def _promoted(r: Rules, branch: int, dtype: str) -> int:
    """A constant branch of a `where` in the output's dtype, as torch promotes it: where(m, x, 0)
    is one term whether its 0 came as an int or a float."""
    value = r.full_value(branch)
    if value is None or r.u[branch].dtype == dtype or isinstance(value, bool) != (dtype == "bool"):
        return branch
    return r.const(("full", value), r.shape(branch), dtype)


def gather(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """gather(x, dim, index) is linear in x, constant where x is broadcast along dim, and acts
    elementwise along the other dims (slices there, and any slice of the index, move out)."""
    x, index = args
    (dim,) = attrs
    moved = _gather_regions(r, x, index, dim, attrs, dtype)
    if moved is not None:  # rows of a wider lookup (a chunk of the sequence), a rank's one included
        return moved
    if _local_lookup(r, x, index, dim):
        # one rank's lookup into its shard of the table: kept whole, so the mask that zeroes the
        # entries other ranks own can make it a piece (see _masked_lookup)
        return r.literal(op, args, attrs, shape, dtype)
    x = r.piece_of_cat(x) or x  # a join of shares, read as one
    term = r.u[x]
    if term.op in ("lin", "piece"):
        return r._map_linear(x, lambda t: r.build(op, (t, index), attrs, shape, dtype), shape)
    if term.op == "full":
        return r.literal("full", (), term.attrs, shape, dtype)
    if r.full_value(index) == 0:  # every entry read at position 0 along dim
        first = r.slice(x, tuple((0, 1) if d == dim else (0, n) for d, n in enumerate(shape)))
        return r.expand(first, shape)
    if term.op == "bcast" and dim not in term.attrs[0]:
        placed = term.attrs[0]
        return r.bcast(r.slice(term.args[0], tuple((0, shape[d]) for d in placed)), shape, placed)
    moved = None
    for pick in (_pick_of_largest_max, pick_of_top):
        moved = pick(r, x, index, dim, shape) if moved is None else moved
    return moved if moved is not None else r.literal(op, args, attrs, shape, dtype)


def _pick_of_largest_max(r: Rules, x: int, index: int, dim: int, shape: tuple[int, ...]) -> int | None:
    """gather(stack(a_1, ..., a_n), dim, argmax(stack(m_1, ..., m_n), dim, keepdim)), where m_i is
    the max and a_i the position of the max over the indices [lo_i, hi_i) of one axis (`max_piece`,
    `arg_piece`), the ranges following each other in the stack's order: the position of the max over
    their union. The first part holding the largest max holds its first position, as torch's
    argmax takes the first (greedy sampling over vocab-parallel logits)."""
    if shape[dim] != 1:
        return None
    kept = r.u[index]  # the argmax with its dim kept: a view, or a broadcast into a size-1 dim
    others = tuple(d for d in range(len(shape)) if d != dim)
    unsqueezed = kept.op == "view" or (kept.op == "bcast" and kept.attrs[0] == others)
    picker = r.u[kept.args[0]] if unsqueezed else kept
    if picker.op != "argmax" or picker.attrs != ((dim,), False) or picker.shape != tuple(shape[d] for d in others):
        return None
    maxes, positions = _stacked(r, picker.args[0], dim), _stacked(r, x, dim)
    if maxes is None or positions is None or len(maxes) != len(positions):
        return None
    pairs = [(r.u[m], r.u[a]) for m, a in zip(maxes, positions)]
    if any(m.op != "max_piece" or a.op != "arg_piece" or m.attrs != a.attrs for m, a in pairs):
        return None
    (first_max, first_position), ends = pairs[0], [(m.attrs[1], m.attrs[2]) for m, _ in pairs]
    if any(m.args != first_max.args or a.args != first_position.args for m, a in pairs[1:]):
        return None
    if any(hi != lo for (_, hi), (lo, _) in zip(ends, ends[1:])) or not _position_of(r, first_position.args[0], first_max.args[0]):
        return None
    axis, _, _, size = first_max.attrs
    return r.view(r.arg_piece(first_position.args[0], axis, ends[0][0], ends[-1][1], size), shape)


def _stacked(r: Rules, t: int, dim: int) -> list[int] | None:
    """The parts of `t` stacked along `dim`, or None: a cat of one-deep parts along it, or a cat
    of equal parts along `dim` viewed with one dim inserted there (an all-gather into a flat tensor)."""
    term = r.u[t]
    if term.op == "cat" and term.attrs[0] == dim and all(r.shape(p)[dim] == 1 for p in term.args):
        return list(term.args)
    inner = r.u[term.args[0]] if term.op == "view" else None
    if inner is None or inner.op != "cat" or inner.attrs[0] != dim or len({r.shape(p) for p in inner.args}) != 1:
        return None
    part = r.shape(inner.args[0])
    return list(inner.args) if term.shape == part[:dim] + (len(inner.args),) + part[dim:] else None


def _position_of(r: Rules, position: int, peak: int) -> bool:
    """Whether `position` is the argmax whose max is `peak`, both moved by the same layout ops."""
    p, m = r.u[position], r.u[peak]
    if p.op == "argmax" and m.op == "amax":
        return p.args == m.args and p.attrs == m.attrs
    return (p.op == m.op and p.attrs == m.attrs and p.shape == m.shape and len(p.args) == len(m.args) == 1
            and _position_of(r, p.args[0], m.args[0]))


def _local_lookup(r: Rules, table: int, index: int, dim: int) -> bool:
    """A lookup into the [lo, hi) shard of a table along `dim` with ids - lo, masked to the shard
    (where) or clamped to it."""
    masked_index = r.u[unshaped(r, index)]
    if masked_index.op == "where":
        return _share_lookup(r, table, index, dim, masked_index.args[0]) is not None
    root, box = r.as_region(table)
    lo, hi = box[dim]
    if root == table or (lo, hi) == (0, r.shape(root)[dim]):
        return False
    shifted = unbroadcast(r, index)
    ids = _shifted_ids(r, shifted, lo)
    return ids is not None and r.shape(ids) == r.shape(shifted) and is_shift_of(r, shifted, ids, lo, hi, {})


def _gather_regions(r: Rules, x: int, index: int, dim: int, attrs: tuple, dtype: str) -> int | None:
    """gather(X[b], dim, I[b']) = gather(X, dim, I)[b'] when b leaves dim whole and b, b' agree on
    the other dims (where x and index have one shape)."""
    x_shape, index_shape = r.shape(x), r.shape(index)
    if any(a != b for d, (a, b) in enumerate(zip(x_shape, index_shape)) if d != dim):
        return None
    for t, other_size in ((x, index_shape[dim]), (index, x_shape[dim])):
        for root, box in r.regions(t):
            if root == t or (t == x and box[dim] != (0, r.shape(root)[dim])):
                continue
            region = (box, r.shape(root))
            other = _whole_along(dim, other_size, *region)
            (x_box, x_global), (out_box, out_global) = (region, other) if t == x else (other, region)
            whole_x, whole_index = r.region_like(x, x_box, x_global), r.region_like(index, out_box, out_global)
            if whole_x is not None and whole_index is not None:
                return r.slice(r.build("gather", (whole_x, whole_index), attrs, out_global, dtype), out_box)
    return None


def _whole_along(dim: int, size: int, box: Box, shape: tuple[int, ...]) -> tuple[Box, tuple[int, ...]]:
    """The region `box` of `shape` with dim `dim` replaced by all of a dim of `size`."""
    return (
        tuple((0, size) if d == dim else b for d, b in enumerate(box)),
        tuple(size if d == dim else s for d, s in enumerate(shape)),
    )


# Lookups: ops that read entries of a table (operand 0) along an axis at the ids in operand 1.
_LOOKUP_AXIS: dict[str, Callable[[tuple], int]] = {"embedding": lambda attrs: 0, "gather": lambda attrs: attrs[0]}


def _masked_lookup(r: Rules, cond: int, when_true: int, when_false: int) -> int | None:
    """where(ids outside [lo,hi), 0, lookup(T[lo:hi], ids - lo)) is the [lo,hi) piece of lookup(T, ids).

    That is the vocab-parallel embedding, and the target-logit lookup of vocab-parallel cross
    entropy: each rank looks up the entries it owns along the lookup axis and zeroes the rest; the
    sum over ranks is the full lookup when the ranges tile the table (and the ids index it).
    """
    if r.full_value(when_true) != 0:
        return None
    lookup = r.u[when_false]
    if lookup.op == "view":  # where commutes with reshapes: mask the lookup before them
        inner = lookup.args[0]
        inner_shape = r.shape(inner)
        found = _masked_lookup(r, r.view(cond, inner_shape), r.view(when_true, inner_shape), inner)
        return None if found is None else r.view(found, lookup.shape)
    if lookup.op not in _LOOKUP_AXIS:
        return None
    table, index = lookup.args
    axis = _LOOKUP_AXIS[lookup.op](lookup.attrs)
    share = _share_lookup(r, table, index, axis, cond)
    if share is None:
        return None
    root, ids, lo, hi = share
    index_term = r.u[index]
    expanded = index_term.op == "bcast" and r.shape(index_term.args[0]) == r.shape(ids)
    whole_index = r.bcast(ids, index_term.shape, index_term.attrs[0]) if expanded else r.view(ids, index_term.shape)
    whole = r.build(lookup.op, (root, whole_index), lookup.attrs, lookup.shape, lookup.dtype)
    return r.piece(whole, ("lookup", axis, root, whole_index), lo, hi, r.shape(root)[axis])


def _share_lookup(r: Rules, table: int, index: int, axis: int, mask: int) -> tuple[int, int, int, int] | None:
    """(root, ids, lo, hi) when `table` is the [lo, hi) region of `root` along the lookup `axis`
    (whole elsewhere), `mask` is `ids outside [lo, hi)` and `index` is ids - lo wherever the mask is
    false: one rank's lookup into its shard of a vocab-parallel table."""
    root, box = r.as_region(table)
    if any(b != (0, s) for d, (b, s) in enumerate(zip(box, r.shape(root))) if d != axis):
        return None
    lo, hi = box[axis]
    outside_mask = unshaped(r, mask)
    outside = outside_range(r, outside_mask)
    if outside is None or outside[1:] != (lo, hi):
        return None
    ids, shifted = outside[0], unshaped(r, index)
    assumed = {outside_mask: r.const(("full", False), r.shape(outside_mask), "bool")}
    if r.shape(ids) != r.shape(shifted) or not is_shift_of(r, shifted, ids, lo, hi, assumed):
        return None
    return root, ids, lo, hi


def unshaped(r: Rules, t: int) -> int:
    """`t` without the broadcasts and reshapes around it."""
    term = r.u[t]
    return unshaped(r, term.args[0]) if term.op in ("bcast", "view") else t


def unbroadcast(r: Rules, t: int) -> int:
    term = r.u[t]
    return term.args[0] if term.op == "bcast" else t


def _shifted_ids(r: Rules, index: int, lo: int) -> int | None:
    """The ids of an index spelled ids - lo (perhaps clamped to the shard, perhaps reshaped)."""
    term = r.u[index]
    if term.op in ("bcast", "view"):
        return _shifted_ids(r, term.args[0], lo)
    if term.op in ("maximum", "minimum"):
        varying = [a for a in term.args if r.full_value(a) is None]
        return _shifted_ids(r, varying[0], lo) if len(varying) == 1 else None
    if term.op == "lin" and len(term.args) == 2:
        for (t, c), (k, kc) in itertools.permutations(zip(term.args, term.attrs[0])):
            if c == 1 and r.full_value(k) is not None and r.full_value(k) * kc == -lo:
                return t
    return index if lo == 0 else None  # ids - 0 is ids
