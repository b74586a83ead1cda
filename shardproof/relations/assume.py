"""Terms re-normalized under an assumption: some terms replaced by others, some integer terms
known to lie in a range.

A rank's share of a one-hot write (its vocab range of cross entropy's backward) is spelled with a
mask `ids outside [lo, hi)`: the written value is zero where the mask holds, and the index is
`ids - lo` (perhaps clamped) where it does not. Rebuilding the value with the mask replaced by a
constant, and the index knowing `lo <= ids < hi`, shows both.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import TYPE_CHECKING

from shardproof.ir.ops import OPS
from shardproof.relations.rules.topk import POSITIONS, TOPK

if TYPE_CHECKING:
    from shardproof.relations.rules import Rules

Interval = tuple[Fraction, Fraction]


def rebuild(r: Rules, t: int, replace: dict[int, int], known: dict[int, Interval]) -> int:
    """`t` with each term of `replace` swapped for its value, rebuilt through the normalizing
    constructors; a max or min that the ranges in `known` decide is dropped."""
    reachable, stack = set(), [t]
    while stack:
        x = stack.pop()
        if x not in reachable and x not in replace:
            reachable.add(x)
            stack.extend(r.u[x].args)
    done = dict(replace)
    for x in sorted(reachable):  # arguments have smaller ids than the terms built on them
        term = r.u[x]
        args = tuple(done[a] for a in term.args)
        decided = decided_bound(r, term.op, args, known) if term.op in ("maximum", "minimum") else None
        if decided is not None:
            done[x] = decided
        elif args == term.args:
            done[x] = x
        else:
            done[x] = _construct(r, x, args)
    return done[t]


def linear_bounds(coefs: tuple[Fraction, ...], bounds: list[Interval | None]) -> Interval | None:
    """Bounds of sum_i c_i x_i from the bounds of each x_i."""
    if None in bounds:
        return None
    return (sum((min(c * lo, c * hi) for c, (lo, hi) in zip(coefs, bounds)), Fraction(0)),
            sum((max(c * lo, c * hi) for c, (lo, hi) in zip(coefs, bounds)), Fraction(0)))


def interval(r: Rules, t: int, known: dict[int, Interval]) -> Interval | None:
    """Bounds of the values of an integer or float term, from the ranges in `known` and constants."""
    if t in known:
        return known[t]
    value = r.full_value(t)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (Fraction(value), Fraction(value)) if math.isfinite(value) else None
    term = r.u[t]
    if term.op in ("bcast", "view", "slice", "permute", "repeat"):
        return interval(r, term.args[0], known)
    if term.op == "lin":
        return linear_bounds(term.attrs[0], [interval(r, a, known) for a in term.args])
    if term.op == "argmax":  # a position along the reduced dim
        return Fraction(0), Fraction(r.shape(term.args[0])[term.attrs[0][0]] - 1)
    if term.op == TOPK and term.attrs[2] == POSITIONS:  # positions along the dim its top k is taken over
        return Fraction(0), Fraction(r.shape(term.args[0])[term.attrs[0][2]] - 1)
    if term.op == "arg_piece":  # a position in [lo, hi)
        return Fraction(term.attrs[1]), Fraction(term.attrs[2] - 1)
    if term.op in ("maximum", "minimum", "cat"):
        bounds = [interval(r, a, known) for a in term.args]
        if term.op == "cat":
            return (None if None in bounds else (min(b[0] for b in bounds), max(b[1] for b in bounds)))
        if None in bounds:
            return None
        pick = max if term.op == "maximum" else min
        return pick(b[0] for b in bounds), pick(b[1] for b in bounds)
    return None


def decided_bound(r: Rules, op: str, args: tuple[int, ...], known: dict[int, Interval]) -> int | None:
    """max(a, b) is a when a >= b everywhere (min: when a <= b), as the ranges show."""
    a, b = args
    ia, ib = interval(r, a, known), interval(r, b, known)
    if ia is None or ib is None:
        return None
    if op == "maximum":
        chosen = [x for x, wins in ((a, ia[0] >= ib[1]), (b, ib[0] >= ia[1])) if wins]
    else:
        chosen = [x for x, wins in ((a, ia[1] <= ib[0]), (b, ib[1] <= ia[0])) if wins]
    varying = [x for x in chosen if r.full_value(x) is None]  # on a tie, keep the term over the constant
    return (varying or chosen or [None])[0]


def _construct(r: Rules, t: int, args: tuple[int, ...]) -> int:
    """The term `t` with new arguments, through the constructor its op is normalized by."""
    term = r.u[t]
    op, attrs = term.op, term.attrs
    if op == "lin":
        return r.lin(list(zip(args, attrs[0])))
    if op == "piece":
        return r.piece(args[0], *attrs)
    if op in ("max_piece", "arg_piece", "top_piece"):
        return getattr(r, op)(args[0], *attrs)
    if op == "slice":
        return r.slice(args[0], attrs[0])
    if op == "cat":
        return r.cat(list(args), attrs[0])
    if op == "bcast":
        return r.bcast(args[0], term.shape, attrs[0])
    if op == "repeat":
        return r.repeat(args[0], *attrs)
    if op == "view":
        return r.view(args[0], term.shape)
    if op == "permute":
        return r.permute(args[0], attrs[0])
    if op in OPS:
        return r.build(op, args, attrs, term.shape, term.dtype)
    return r.literal(op, args, attrs, term.shape, term.dtype)
