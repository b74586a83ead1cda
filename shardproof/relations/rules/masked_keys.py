"""Keys a mask hides. A constant mask (a comparison of positions, a triangle of ones) is decided over
a region by the ranges of what it compares: a causal mask hides every key of a later block from a
block of queries and none of an earlier one. Where the scores are -inf over a whole region of keys:
- those keys add nothing: softmax along the keys is zero there, and the softmax (and log-sum-exp) of
  the keys left equals the whole row's restricted to them;
- a product with probabilities that are zero over a range of the contraction is the product over
  the rest of it.
So a causal ring, which skips the KV blocks the mask hides entirely and leaves the mask off the
blocks it hides nowhere, computes the reference's attention over all the keys.
Assumed: every query row has a key the mask leaves (its softmax is defined), stated in the report.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from shardproof.relations.assume import linear_bounds
from shardproof.relations.layout import Box, compose, source_box

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

VISIBLE_ROWS = "softmax over keys a mask hides in part: equal to the reference's where every query row has a key the mask leaves"
_COMPARE = {"lt": lambda a, b: (a[1] < b[0], a[0] >= b[1]), "le": lambda a, b: (a[1] <= b[0], a[0] > b[1]),
            "gt": lambda a, b: (a[0] > b[1], a[1] <= b[0]), "ge": lambda a, b: (a[0] >= b[1], a[1] < b[0])}


def _inner(r: Rules, t: int, box: Box) -> tuple[int, Box] | None:
    """(x, b) with t[box] read from x[b] element for element: t a slice, broadcast, permute or
    reshape of x."""
    term = r.u[t]
    if term.op == "slice":
        return term.args[0], compose(term.attrs[0], box)
    if term.op == "bcast":
        return term.args[0], tuple(box[d] for d in term.attrs[0])
    if term.op == "permute":
        perm = term.attrs[0]
        return term.args[0], tuple(box[perm.index(d)] for d in range(len(perm)))
    if term.op == "view":
        inner = source_box(r.shape(term.args[0]), term.shape, box)
        return None if inner is None else (term.args[0], inner)
    return None


def bounds(r: Rules, t: int, box: Box) -> tuple[Fraction, Fraction] | None:
    """Bounds of the values of t[box], for terms of constants (positions and sums of them)."""
    value = r.full_value(t)
    if isinstance(value, (int, float, Fraction)) and not isinstance(value, bool):
        return (Fraction(value), Fraction(value)) if math.isfinite(value) else None
    term = r.u[t]
    if term.op == "const" and term.attrs[0] == "arange" and len(box) == 1 and box[0][0] < box[0][1]:
        start, _, step = term.attrs[1:]
        ends = (Fraction(start + box[0][0] * step), Fraction(start + (box[0][1] - 1) * step))
        return min(ends), max(ends)
    if term.op == "lin":
        return linear_bounds(term.attrs[0], [bounds(r, a, box) for a in term.args])
    inner = _inner(r, t, box)
    return None if inner is None else bounds(r, *inner)


def truth(r: Rules, mask: int, box: Box) -> bool | None:
    """True or False if the boolean `mask` is that everywhere in `box`; None if not known."""
    value = r.full_value(mask)
    term = r.u[mask]
    if value is not None and term.dtype == "bool":
        return bool(value)
    if term.op in _COMPARE:
        a, b = (bounds(r, x, box) for x in term.args)
        if a is None or b is None:
            return None
        always, never = _COMPARE[term.op](a, b)
        return True if always else False if never else None
    if term.op == "logical_not":
        inner = truth(r, term.args[0], box)
        return None if inner is None else not inner
    if term.op in ("logical_and", "logical_or"):
        parts = [truth(r, a, box) for a in term.args]
        absorbing = term.op == "logical_or"
        return absorbing if absorbing in parts else None if None in parts else not absorbing
    if term.op in ("triu", "tril"):
        kept = _triangle(term.op, term.attrs[0], box)
        return None if kept is None else truth(r, term.args[0], box) if kept else False
    inner = _inner(r, mask, box)
    return None if inner is None else truth(r, *inner)


def _triangle(op: str, diagonal: int, box: Box) -> bool | None:
    """Whether triu/tril(x, diagonal) keeps all of box (True) or none of it (False)."""
    (r0, r1), (c0, c1) = box[-2:]
    lowest, highest = c0 - (r1 - 1), (c1 - 1) - r0  # of column - row over the box
    if op == "triu":
        return True if lowest >= diagonal else False if highest < diagonal else None
    return True if highest <= diagonal else False if lowest > diagonal else None


def hidden(r: Rules, t: int, box: Box) -> bool:
    """t[box] is -inf everywhere: masked by a mask `where` decides there."""
    if r.full_value(t) == -math.inf:
        return True
    term = r.u[t]
    if term.op == "where":
        cond, when_true, when_false = term.args
        chosen = truth(r, cond, box)
        if chosen is None:
            return hidden(r, when_true, box) and hidden(r, when_false, box)
        return hidden(r, when_true if chosen else when_false, box)
    if term.op == "lin" and len(term.args) == 1 and term.attrs[0][0] > 0:
        return hidden(r, term.args[0], box)
    inner = _inner(r, t, box)
    return inner is not None and hidden(r, *inner)


def on_masked_root(r: Rules, parts: list[int], regions: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
    """The parts' regions (X, box), those of unmasked scores S seen as regions of masked scores
    where(m, t, S) where m is False in all of box: a ring's blocks no key of which is masked, with the
    mask left off, beside its block on the diagonal, masked."""
    roots = {root for root, _ in regions}
    for masked in roots if len(roots) > 1 else ():
        term = r.u[masked]
        if term.op != "where":
            continue
        lifted = [(root, box) if root == masked else (masked, box) if (
            r.shape(root) == term.shape and truth(r, term.args[0], box) is False and r.slice(term.args[2], box) == p
        ) else None for p, (root, box) in zip(parts, regions)]
        if None not in lifted:
            return lifted
    return regions


def _outside(r: Rules, root: int, box: Box, dim: int) -> list[Box]:
    """The boxes of `root` beside `box` along `dim`, in box's range of the other dims."""
    lo, hi = box[dim]
    return [tuple((a, b) if d == dim else box[d] for d in range(len(box)))
            for a, b in ((0, lo), (hi, r.shape(root)[dim])) if a < b]


def visible_keys(r: Rules, x: int, dim: int) -> tuple[int, Box] | None:
    """(X, box) with x = X[box] where X along `dim` is masked in full outside box's range (and box
    is narrower along `dim`): x's keys are the ones X leaves visible in these rows."""
    root, box = r.as_region(x)
    if root == x or box[dim] == (0, r.shape(root)[dim]):
        return None
    if not all(hidden(r, root, b) for b in _outside(r, root, box, dim)):
        return None
    r.assumptions.add(VISIBLE_ROWS)
    return root, box


def softmax_zero(r: Rules, x: int, dim: int, box: Box) -> bool:
    """softmax(x, dim)[box] is zero: x is -inf there (box narrower than x along dim, the keys)."""
    return box[dim] != (0, r.shape(x)[dim]) and hidden(r, x, box)


def contraction_piece(r: Rules, out: int, axis: object, lo: int, hi: int, size: int) -> str | None:
    """What the piece [lo, hi) of the contraction `axis` = ("matmul", A @ B), read at `out` (a region
    of the product), is where A vanishes in those rows (probabilities, or multiples of them, of keys
    a mask hides, or of the queries it hides them from): "zero" where A is zero over [lo, hi),
    "whole" where A is zero over the rest of the contracted range; else None."""
    if not (isinstance(axis, tuple) and axis[0] == "matmul" and r.op(axis[1]) == "matmul"):
        return None
    core = axis[1]
    rows = r.u[out].attrs[0] if r.op(out) == "slice" and r.u[out].args[0] == core else tuple((0, n) for n in r.shape(core))
    left, box = r.u[core].args[0], rows[:-1] + ((lo, hi),)
    if r.shape(left) != r.shape(core)[:-1] + (size,) or (lo, hi) == (0, size):
        return None  # (only the product's own rows of A, contracted along its last dim)
    found = "zero" if zero_in(r, left, box) else "whole" if all(zero_in(r, left, b) for b in _outside(r, left, box, len(box) - 1)) else None
    if found is not None:
        r.assumptions.add(VISIBLE_ROWS)
    return found


def zero_in(r: Rules, t: int, box: Box) -> bool:
    """t[box] is zero: softmax over keys hidden there, or a product or sum of such."""
    term = r.u[t]
    if term.op == "lin":
        return all(zero_in(r, a, box) for a in term.args)
    if term.op == "mul":
        return any(r.shape(a) == term.shape and zero_in(r, a, box) for a in term.args)
    if term.op == "permute":
        perm = term.attrs[0]
        return zero_in(r, term.args[0], tuple(box[perm.index(d)] for d in range(len(perm))))
    return term.op == "softmax" and softmax_zero(r, term.args[0], term.attrs[0] % len(term.shape), box)
