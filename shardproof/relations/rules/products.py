"""Products: mul, div and matmul, linear in each real operand, so scales move out of them and pieces
distribute over them; matmul maps slices onto its free dims and a contraction over a sliced or
concatenated dim becomes pieces or a sum of contractions.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from shardproof.relations.layout import Box, box_along, full_box
from shardproof.relations.rules.elementwise import elementwise, unview, viewed_from
from shardproof.relations.rules.masks import times_mask
from shardproof.relations.rules.one_hot import masked_rows_into_one_hot, one_hot_times
from shardproof.relations.rules.regions import cat_bounds
from shardproof.relations.rules.slots import whole_under
from shardproof.relations.rules.values import FLOAT_DTYPES, is_finite_number

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def _bilinear(r: Rules, op: str, args, attrs, shape, dtype) -> int | None:
    """c*x (op) d*y = c*d * (x (op) y) for ops linear in each real operand (mul, matmul); not for
    integers, where a fractional scale truncates."""
    (x, c), (y, d) = (r.common_factor(a) for a in args)
    if c == 1 and d == 1:
        return None
    return r.scale(r.build(op, (x, y), attrs, shape, dtype), c * d)


def mul(r: Rules, args, attrs, shape, dtype) -> int:
    masked = times_mask(r, args, shape, dtype)
    if masked is not None:
        return masked
    for i, a in enumerate(args):
        value = r.full_value(a)
        if is_finite_number(value) and dtype in FLOAT_DTYPES:
            return r.scale(args[1 - i], value)
    scaled = _bilinear(r, "mul", args, attrs, shape, dtype)
    if scaled is not None:
        return scaled
    renumbered = _renumbered_lookups(r, "mul", args, attrs, shape, dtype)
    if renumbered is not None:
        return renumbered
    for i, a in enumerate(args):
        divisor = _reciprocal_of(r, a) if dtype in FLOAT_DTYPES else None
        if divisor is not None and r.shape(args[1 - i]) == shape:
            # x * (1/y) is x / y: compilers write a division either way (XLA's softmax gradient
            # divides on one side of a partition and multiplies by the reciprocal on the other)
            return r.build("div", (args[1 - i], divisor), (), shape, dtype)
    for i, a in enumerate(args):
        other = args[1 - i]
        if r.op(a) == "piece" and r.op(other) != "piece":
            return r._map_linear(a, lambda t: r.build("mul", (t, other), attrs, shape, dtype), shape)
    for i, a in enumerate(args):
        mask = _cast_mask(r, a)
        if mask is not None:  # x * float(m) = where(m, x, 0)
            zero = r.literal("full", (), (0.0,), shape, dtype)
            return r.build("where", (mask, args[1 - i], zero), (), shape, dtype)
    for i, a in enumerate(args):
        absorbed = one_hot_times(r, a, args[1 - i], attrs, shape, dtype)
        if absorbed is not None:
            return absorbed
    return elementwise(r, "mul", args, attrs, shape, dtype)


def _renumbered_lookups(r: Rules, op: str, args, attrs, shape, dtype) -> int | None:
    """A product slot by slot of a rank's lookups renumbered into its rows and a factor that
    vanishes on the slots outside them: the product with the lookups into the whole table."""
    for zeroed in range(len(args)):
        whole = whole_under(r, op, args, attrs, shape, zeroed)
        if whole is not None:
            return r.build(op, whole, attrs, shape, dtype)
    return None


def _reciprocal_of(r: Rules, t: int) -> int | None:
    """y where `t` is 1/y, perhaps reshaped or broadcast (then y reshaped or broadcast alike)."""
    term = r.u[t]
    if term.op in ("bcast", "view"):
        inner = _reciprocal_of(r, term.args[0])
        if inner is None:
            return None
        return r.bcast(inner, term.shape, term.attrs[0]) if term.op == "bcast" else r.view(inner, term.shape)
    if term.op == "div" and r.full_value(term.args[0]) == 1 and r.shape(term.args[1]) == term.shape:
        return term.args[1]
    return None


def _cast_mask(r: Rules, t: int) -> int | None:
    """The bool mask `t` is a number cast of, perhaps broadcast (torchtitan's vocab-parallel
    embedding scales its rows by `mask.unsqueeze(-1).to(dtype)`): bcast(float(m)) = float(bcast(m))."""
    term = r.u[t]
    if term.op == "bcast":
        inner = _cast_mask(r, term.args[0])
        return None if inner is None else r.bcast(inner, term.shape, term.attrs[0])
    if term.op == "convert" and r.u[term.args[0]].dtype == "bool":
        return term.args[0]
    return None


def div(r: Rules, args, attrs, shape, dtype) -> int:
    value = r.full_value(args[1])
    if is_finite_number(value) and value != 0 and dtype in FLOAT_DTYPES:
        return r.scale(args[0], Fraction(1) / Fraction(value))
    (x, c), (y, d) = (r.common_factor(a) for a in args)
    if c != 1 or d != 1:
        return r.scale(r.build("div", (x, y), attrs, shape, dtype), c / d)
    return elementwise(r, "div", args, attrs, shape, dtype)


def matmul(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    a, b = args
    if dtype in FLOAT_DTYPES and 0 in (r.full_value(a), r.full_value(b)):
        # zeros times anything: the zeros a slice's backward pads its gradient with, through a
        # column-parallel layer's input gradient, are one zero product, not one per weight shard
        return r.literal("full", (), (0.0,), shape, dtype)
    ta, tb = r.u[a], r.u[b]
    if tb.op == "bcast" and tb.attrs[0] == (len(shape) - 2, len(shape) - 1) and r.shape(a)[:-2] == shape[:-2]:
        # one matrix broadcast over the batch (einsum's bmm): the product with the matrix itself
        return r.build(op, (a, tb.args[0]), attrs, shape, dtype)
    if ta.op == "bcast" and ta.attrs[0] == (len(shape) - 2, len(shape) - 1) and len(r.shape(b)) == 2:
        # a matrix broadcast over a batch times one matrix: the product broadcast (bcast stays outside
        # compute ops), as einsum's bmm over a batch of one leaves a weight gradient
        product = r.build(op, (ta.args[0], b), attrs, shape[-2:], dtype)
        return r.bcast(product, shape, ta.attrs[0])
    if ta.op == "permute" and ta.attrs[0][-1] == len(ta.shape) - 1 and len(r.shape(b)) == 2:
        inner = ta.args[0]  # rows permuted, contraction dim in place: permute the product instead
        product = r.build(op, (inner, b), attrs, r.shape(inner)[:-1] + shape[-1:], dtype)
        return r.permute(product, ta.attrs[0])
    scaled = _bilinear(r, op, args, attrs, shape, dtype)
    if scaled is not None:
        return scaled
    renumbered = _renumbered_lookups(r, op, args, attrs, shape, dtype)
    if renumbered is not None:
        return renumbered
    for i, t in enumerate((a, b)):
        term = r.u[t]
        other = args[1 - i]
        if term.op == "piece" and r.op(other) != "piece":
            return r._map_linear(
                t, lambda x: r.build("matmul", (x, other) if i == 0 else (other, x), attrs, shape, dtype), shape
            )
    for i, t in enumerate((a, b)):
        exposed = _exposed_cat(r, t)
        if exposed is not None:
            return r.build("matmul", (exposed, b) if i == 0 else (a, exposed), attrs, shape, dtype)
    for i, t in enumerate((a, b)):
        term = r.u[t]
        free_dim = len(shape) - 2 + i
        if term.op == "cat" and term.attrs[0] == len(term.shape) - 2 + i:
            parts = []
            for p in term.args:
                pair = (p, b) if i == 0 else (a, p)
                out_shape = list(shape)
                out_shape[free_dim] = r.shape(p)[term.attrs[0]]
                parts.append(r.build("matmul", pair, attrs, tuple(out_shape), dtype))
            return r.cat(parts, free_dim)
    split = _split_contraction(r, a, b, attrs, shape, dtype)
    if split is not None:
        return split
    absorbed = masked_rows_into_one_hot(r, a, b, attrs, shape, dtype)
    if absorbed is not None:
        return absorbed
    per_batch = _flattened_contraction(r, a, b, attrs, shape, dtype)
    if per_batch is not None:
        return per_batch
    return _matmul_slices(r, a, b, attrs, shape, dtype)


def _flattened_contraction(r: Rules, a: int, b: int, attrs, shape, dtype) -> int | None:
    """g.view(n*s, k).T @ x.view(n*s, h), rows flattened from the same leading dims and contracted
    (a weight gradient of batch-first activations), is the sum over the leading dims of the
    per-row-group products g[i].T @ x[i]. A rank's sequence shard x[:, s0:s1] is then a range of
    each product's contraction, which no range of the flattened rows is. A batch of ones (einsum's
    bmm) is the matrices' product with its ones put back."""
    if len(shape) > 2 and all(n == 1 for n in shape[:-2]) and len(r.shape(a)) == len(r.shape(b)) == len(shape):
        a, b = _without_batch_ones(r, a), _without_batch_ones(r, b)
        source = viewed_from(r, b)
        if source is None or math.prod(source[:-2]) == 1:
            return None  # rows of one dim: no batch to sum over (the per-batch products have a batch of one)
        flat = _flattened_contraction(r, a, b, attrs, shape[-2:], dtype)
        return None if flat is None else r.view(flat, shape)
    if len(shape) != 2:
        return None
    source = viewed_from(r, b)
    if source is None or len(source) < 3 or source[-1] != shape[1]:
        return None
    rows = source[:-1]
    x, g = unview(r, b, source), unview(r, r.permute(a, (1, 0)), rows + (shape[0],))
    if x is None or g is None:
        return None
    lead = tuple(range(len(rows) - 1))
    g_t = r.permute(g, lead + (len(rows), len(rows) - 1))
    batched = r.build("matmul", (g_t, x), attrs, rows[:-1] + shape, dtype)
    return r.build("sum", (batched,), (lead, False), shape, dtype)


def _without_batch_ones(r: Rules, t: int) -> int:
    """A matrix over a batch of ones as the matrix: a permute that keeps the batch in place is the
    matrix's permute (einsum transposes its bmm's operands under a batch of one)."""
    term, k = r.u[t], len(r.shape(t)) - 2
    if term.op == "permute" and term.attrs[0][:k] == tuple(range(k)):
        inner = _without_batch_ones(r, term.args[0])
        return r.permute(inner, tuple(p - k for p in term.attrs[0][k:]))
    return r.view(t, r.shape(t)[k:])


def _exposed_cat(r: Rules, t: int) -> int | None:
    """A matmul operand that is a cat behind permutes, broadcasts and size-1 reshapes (`Rules.exposed_cat`),
    as that cat, when its cat dim is a matrix dim (free or contracted), which products split by."""
    if r.op(t) not in ("permute", "view", "bcast"):
        return None
    exposed = r.exposed_cat(t)
    if exposed is None or r.u[exposed].attrs[0] < len(r.shape(t)) - 2:
        return None
    return exposed


def _split_contraction(r: Rules, a: int, b: int, attrs, shape, dtype) -> int | None:
    """A contraction over a concatenation is the sum of the contractions over its parts:
    cat(a1, a2) @ cat(b1, b2) = a1 @ b1 + a2 @ b2 (an operand that is not a cat is sliced at the
    other's boundaries). Backward of a fused projection: the gradient of cat(gate, up) times the
    fused weight."""
    a_dim, b_dim = len(r.shape(a)) - 1, len(r.shape(b)) - 2
    ta, tb = r.u[a], r.u[b]
    a_cat = ta.op == "cat" and ta.attrs[0] == a_dim
    b_cat = tb.op == "cat" and tb.attrs[0] == b_dim
    if not (a_cat or b_cat):
        return None
    cats = [t for t, is_cat in ((a, a_cat), (b, b_cat)) if is_cat]
    cuts = sorted({0, r.shape(a)[a_dim]} | {end for t in cats for _, end in cat_bounds(r, t)})
    terms = []
    for lo, hi in zip(cuts, cuts[1:]):
        part_a = r.slice(a, box_along(r.shape(a), a_dim, lo, hi))
        part_b = r.slice(b, box_along(r.shape(b), b_dim, lo, hi))
        terms.append((r.build("matmul", (part_a, part_b), attrs, shape, dtype), Fraction(1)))
    return r.lin(terms)


def _matmul_slices(r: Rules, a: int, b: int, attrs, shape, dtype) -> int:
    """Slices on free dims move to the output; equal slices of the contracted dim make a piece."""
    ra, box_a = r.as_region(a)
    rb, box_b = r.as_region(b)
    if ra == a and rb == b:
        return r.literal("matmul", (a, b), attrs, shape, dtype)
    batch_differs = box_a[:-2] != box_b[:-2] or r.shape(ra)[:-2] != r.shape(rb)[:-2]
    if len(shape) > 2 and len(r.shape(b)) > 2 and batch_differs:
        ra, box_a, rb, box_b = _align_batch(r, a, ra, box_a, b, rb, box_b)
    candidates = ([(ra, box_a, rb, box_b)] if _aligned(r, ra, box_a, rb, box_b) else []) + _aligned_regions(r, a, b)
    candidates += _one_side(r, a, ra, box_a, b, rb, box_b)
    if not candidates:
        return r.literal("matmul", (a, b), attrs, shape, dtype)
    ra, box_a, rb, box_b = candidates[0]
    core = r.build("matmul", (ra, rb), attrs, r.shape(ra)[:-1] + r.shape(rb)[-1:], dtype)
    for other in candidates[1:] if r.reference_size is not None and not r.in_reference(core) else ():
        product = r.build("matmul", (other[0], other[2]), attrs, r.shape(other[0])[:-1] + r.shape(other[2])[-1:], dtype)
        if r.in_reference(product):  # the product the reference computed, e.g. of its v, not of all of qkv
            (ra, box_a, rb, box_b), core = other, product
            break
    sa = r.shape(ra)
    out = r.slice(core, box_a[:-1] + box_b[-1:])
    lo, hi = box_a[-1]
    return r.piece(out, ("matmul", core), lo, hi, sa[-1])


def _one_side(r: Rules, a: int, ra: int, box_a: Box, b: int, rb: int, box_b: Box) -> list[tuple[int, Box, int, Box]]:
    """One operand's region with the other operand as it is, where only that lines up: a
    microbatch's rows of one gradient times a fused weight's slice (A[rows] @ W[:k] = (A @ W[:k])[rows])."""
    sides = [(ra, box_a, b, full_box(r.shape(b))), (a, full_box(r.shape(a)), rb, box_b)]
    return [(x, bx, y, by) for x, bx, y, by in sides if (x, y) != (a, b) and _aligned(r, x, bx, y, by)]


def _aligned(r: Rules, ra: int, box_a: Box, rb: int, box_b: Box) -> bool:
    """Both regions share the batch and contract the same range of the same length."""
    sa, sb = r.shape(ra), r.shape(rb)
    if len(sb) > 2 and (len(sa) != len(sb) or sa[:-2] != sb[:-2] or box_a[:-2] != box_b[:-2]):
        return False
    return sa[-1] == sb[-2] and box_a[-1] == box_b[-2]


def _aligned_regions(r: Rules, a: int, b: int) -> list[tuple[int, Box, int, Box]]:
    """Regions of the operands that line up, also inside tensors the reference sliced out: a
    rank's heads of q and of k, each a region of the reference's q and k from one fused qkv."""
    return [
        (ra, box_a, rb, box_b)
        for ra, box_a in r.regions(a)
        for rb, box_b in r.regions(b)
        if (ra, rb) != (a, b) and _aligned(r, ra, box_a, rb, box_b)
    ]


def _align_batch(r: Rules, a: int, ra: int, box_a: Box, b: int, rb: int, box_b: Box) -> tuple[int, Box, int, Box]:
    """Express the operand without a batch slice as a region with the other operand's batch box:
    over its own region, or else as it is (its matrix dims whole) where only that contracts alike
    (a rank's heads of half a rotary query, times the one rotary key broadcast to those heads).
    The first regions that line up; else the first found."""
    first = None
    for sliced, other in ((a, b), (b, a)):
        own = r.as_region(other)
        for other_root, other_box in dict.fromkeys((own, (other, full_box(r.shape(other))))):
            for root, box in r.regions(sliced):
                if root == sliced:
                    continue
                target = box[:-2] + other_box[-2:]
                lifted = r.region_like(other, target, r.shape(root)[:-2] + r.shape(other_root)[-2:])
                if lifted is None:
                    continue
                found = (root, box, lifted, target) if sliced == a else (lifted, target, root, box)
                if _aligned(r, *found):
                    return found
                first = first or found
    return first or (ra, box_a, rb, box_b)
