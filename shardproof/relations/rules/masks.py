"""Boolean masks: logical ops fold on known operands, a bool mask times numbers is a `where`, and
range tests `ids < lo | ids >= hi` (and `lo <= ids < hi`) are recognized in their usual spellings
for the lookup and one-hot rules.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

from shardproof.relations.assume import interval, rebuild
from shardproof.relations.rules.elementwise import elementwise

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def times_mask(r: Rules, args: tuple[int, int], shape, dtype) -> int | None:
    """x * mask (a bool mask times numbers) is where(not mask, 0, x): the masked-out form the
    vocab-parallel lookup rule reads, as vLLM spells its shifted ids `mask * (ids - offset)`."""
    for i, a in enumerate(args):
        if r.u[a].dtype == "bool" and dtype != "bool":
            other = args[1 - i]
            zero = r.const(("full", 0), shape, dtype)
            return r.build("where", (r.build("logical_not", (a,), (), shape, "bool"), zero, other), (), shape, dtype)
    return None


def assuming(r: Rules, t: int, cond: int, value: bool) -> int:
    """`t` where it is read, when `cond` has `value` there: where(cond, a, b) inside t (through
    sums) is a or b. So ids - where(outside, 0, start) in the inside branch is ids - start."""
    term = r.u[t]
    if term.op == "where" and term.args[0] == cond:
        return term.args[1] if value else term.args[2]
    if term.op == "lin" and any(r.op(a) == "where" for a in term.args):
        return r.lin([(assuming(r, a, cond, value), c) for a, c in zip(term.args, term.attrs[0])])
    return t


def logical(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """and/or/not with a known operand fold; not(not m) is m; `x >= a and x < b` with a >= b is
    the empty range (vLLM's added-vocabulary mask when nothing was added)."""
    if op == "logical_not":
        inner = r.u[args[0]]
        if inner.op == "logical_not":
            return inner.args[0]
        known = r.full_value(args[0])
        if isinstance(known, bool):
            return r.const(("full", not known), shape, "bool")
        return elementwise(r, op, args, attrs, shape, dtype)
    absorbing = op == "logical_or"  # or(m, True) is True; and(m, False) is False
    for i, a in enumerate(args):
        known = r.full_value(a)
        if isinstance(known, bool):
            return r.const(("full", absorbing), shape, "bool") if known == absorbing else args[1 - i]
    if op == "logical_and" and _empty_range(r, args):
        return r.const(("full", False), shape, "bool")
    return elementwise(r, op, args, attrs, shape, dtype)


def _empty_range(r: Rules, args: tuple[int, ...]) -> bool:
    bounds = [_compare_const(r, a) for a in args]
    if None in bounds or bounds[0][0] != bounds[1][0]:
        return False
    limits = {op: value for _, op, value in bounds}
    return "ge" in limits and "lt" in limits and limits["ge"] >= limits["lt"]


def outside_range(r: Rules, mask: int) -> tuple[int, int, int] | None:
    """Recognize `ids < lo | ids >= hi` (in its usual spellings, perhaps reshaped) as (ids, lo, hi);
    one test of a bound is the range from the other bound of the ids' values."""
    term = r.u[mask]
    if term.op == "view":
        inner = outside_range(r, term.args[0])
        return None if inner is None else (r.view(inner[0], term.shape), *inner[1:])
    if term.op == "logical_or" and len(term.args) == 2:
        bounds = [_compare_const(r, a) for a in term.args]
        if None in bounds:
            return None
        (x1, op1, v1), (x2, op2, v2) = bounds
        if x1 != x2:
            return None
        limits = {op1: v1, op2: v2}
        if "lt" in limits and "ge" in limits:
            return x1, int(limits["lt"]), int(limits["ge"])
    if term.op == "logical_not":
        return inside_range(r, term.args[0])
    return _one_sided(r, mask, {"ge": False, "lt": True})


def inside_range(r: Rules, mask: int) -> tuple[int, int, int] | None:
    """Recognize `ids >= lo & ids < hi` (perhaps reshaped) as (ids, lo, hi); one test of a bound is
    the range to the other bound of the ids' values."""
    term = r.u[mask]
    if term.op == "view":
        inner = inside_range(r, term.args[0])
        return None if inner is None else (r.view(inner[0], term.shape), *inner[1:])
    if term.op == "logical_not":
        return outside_range(r, term.args[0])
    if term.op != "logical_and" or len(term.args) != 2:
        return _one_sided(r, mask, {"ge": True, "lt": False})
    bounds = [_compare_const(r, a) for a in term.args]
    if None in bounds or bounds[0][0] != bounds[1][0]:
        return None
    limits = {b[1]: b[2] for b in bounds}
    if "ge" in limits and "lt" in limits:
        return bounds[0][0], int(limits["ge"]), int(limits["lt"])
    return None


def _one_sided(r: Rules, mask: int, above: dict[str, bool]) -> tuple[int, int, int] | None:
    """`ids >= v` or `ids < v` as (ids, lo, hi): the range above v (`above[op]`) or below it, up to
    the bound of the values ids takes (top-k positions lie in [0, k))."""
    compared = _compare_const(r, mask)
    values = None if compared is None else interval(r, compared[0], {})
    if values is None or not isinstance(compared[2], int):
        return None
    ids, op, v = compared
    lo, hi = (v, int(values[1]) + 1) if above[op] else (int(values[0]), v)
    return (ids, lo, hi) if lo < hi else None


def range_masks(r: Rules, t: int) -> list[tuple[int, tuple[int, int, int, bool]]]:
    """The boolean terms inside `t` that test ids against a range: (mask, (ids, lo, hi, outside)),
    outside True for `ids < lo | ids >= hi`, False for `lo <= ids < hi`. One test of a bound reads
    both ways (ids < v: inside [0, v), outside [v, n)), unless it is a side of a two-sided test."""
    seen: dict[int, None] = {}  # in the order found, outermost first
    stack = [t]
    while stack:
        x = stack.pop()
        if x not in seen:
            seen[x] = None
            stack.extend(r.u[x].args)
    sides = {a for x in seen if r.op(x) in ("logical_and", "logical_or") for a in r.u[x].args}
    found = []
    for x in seen:
        if r.u[x].dtype != "bool" or (x in sides and r.op(x) in ("lt", "le", "gt", "ge")):
            continue
        beyond, within = outside_range(r, x), inside_range(r, x)
        if beyond is not None:
            found.append((x, (*beyond, True)))
        if within is not None:
            found.append((x, (*within, False)))
    return found


def compare(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """A comparison of where(m, a, b) with a constant that each branch decides where it is taken
    is m, not m or a constant: `where(lo <= ids < hi, ids - lo, n) >= n`, a sentinel test of ids
    renumbered into a rank's range [lo, hi) (n = hi - lo), is the test of ids outside the range."""
    x, bound = args
    chosen, limit = r.u[x], r.full_value(bound)
    if limit is None or isinstance(limit, bool):
        return elementwise(r, op, args, attrs, shape, dtype)
    always = _holds(r, op, interval(r, x, {}), limit)
    if always is not None:  # decided by the values' range (top-k positions are below their axis' size)
        return r.const(("full", always), shape, "bool")
    if chosen.op != "where":
        return elementwise(r, op, args, attrs, shape, dtype)
    cond, when_true, when_false = chosen.args
    truths = [_decided(r, op, branch, limit, cond, taken) for branch, taken in ((when_true, True), (when_false, False))]
    if None in truths:
        return elementwise(r, op, args, attrs, shape, dtype)
    if truths[0] == truths[1]:
        return r.const(("full", truths[0]), shape, "bool")
    return cond if truths[0] else r.build("logical_not", (cond,), (), shape, "bool")


def _decided(r: Rules, op: str, value: int, limit, cond: int, taken: bool) -> bool | None:
    """`value op limit` wherever `cond` is `taken`, when the ranges decide it: ids known to lie in
    [lo, hi) where a range test of them holds, constants everywhere."""
    known = {}
    tested = inside_range(r, cond) if taken else outside_range(r, cond)
    if tested is not None:
        ids, lo, hi = tested
        known[ids] = (Fraction(lo), Fraction(hi - 1))
    return _holds(r, op, interval(r, value, known), limit)


def _holds(r: Rules, op: str, bounds, limit) -> bool | None:
    """`x op limit` for every x in `bounds`: True, False, or None (not decided)."""
    if bounds is None:
        return None
    low, high = bounds
    always, never = {"lt": (high < limit, low >= limit), "le": (high <= limit, low > limit),
                     "gt": (low > limit, high <= limit), "ge": (low >= limit, high < limit)}.get(op, (False, False))
    return True if always else False if never else None


def _compare_const(r: Rules, t: int) -> tuple[int, str, Any] | None:
    term = r.u[t]
    if term.op not in ("lt", "ge", "le", "gt") or len(term.args) != 2:
        return None
    value = r.full_value(term.args[1])
    if value is None:
        return None
    op = {"le": "lt", "gt": "ge"}.get(term.op, term.op)
    shift = 1 if term.op in ("le", "gt") else 0
    return term.args[0], op, value + shift


def is_shift_of(r: Rules, shifted: int, ids: int, lo: int, hi: int, assumed: dict[int, int]) -> bool:
    """`shifted` is ids - lo wherever ids lies in [lo, hi) (with the terms of `assumed`, a mask
    testing that, replaced by their values there); an index clamped to the shard counts."""
    offset = r.literal("full", (), (-lo,), r.shape(ids), r.u[ids].dtype)
    local = r.view(r.lin([(ids, Fraction(1)), (offset, Fraction(1))]), r.shape(shifted))
    return rebuild(r, shifted, assumed, {ids: (Fraction(lo), Fraction(hi - 1))}) == local


def keep_literal(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    return r.literal(op, args, attrs, shape, dtype)
