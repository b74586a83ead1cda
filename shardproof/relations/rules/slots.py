"""Slots: the positions of an ids tensor (a token's routing slots, a row's label), and the terms
computed slot by slot from them. One rank owns the rows [lo, hi) of a stacked table (its experts'
weights, its vocabulary) and looks them up at the ids renumbered into its block (ids - lo, the
others clamped or sent to a sentinel); slots whose ids lie outside the block are zeroed by a mask
(`where(ids outside [lo, hi), 0, x)`, or a product with such a factor):
- a value computed slot by slot from the rank's lookups, where a factor vanishing outside the block
  meets it, equals the one computed from the lookups into the whole table at ids: wherever ids lies
  in the block, the renumbered lookup reads the row ids reads (transformers' expert parallelism runs
  every routing slot through an expert, the sentinel ones through a clamped one, and weighs them by
  masked routing weights);
- the sum over ranks of one linear context of such masks, their blocks covering every value ids
  takes, is the context of the unmasked value.
The vocab-parallel lookup masked as it is read is the simplest case (`lookups._masked_lookup`).

A term's slots are a run of its dims [a, b) that flatten, row-major, to the positions of ids: the
only dims a slot-by-slot op may not mix (contract, reduce, slice, reorder).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from shardproof.ir.ops import OPS
from shardproof.relations.assume import interval, rebuild
from shardproof.relations.rules.masks import inside_range, is_shift_of, outside_range, range_masks

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

Run = tuple[int, int]
Mask = tuple[int, int, int, frozenset]  # (ids, lo, hi, the wheres that zero the slots outside [lo, hi))
_MIXED = "mixed"  # a term that mixes slots (or reads them in an order we do not follow)
_ELEMENTWISE_KINDS = {"unary", "binary", "compare", "where", "pointwise"}
_SEARCH_DEPTH = 16  # how deep a factor vanishing outside a block is looked for


def _canonical(shape: tuple[int, ...], inner: int, n: int) -> Run | None:
    """The tightest run [a, b) of `shape` with prod(shape[b:]) == inner and prod(shape[a:b]) == n."""
    suffix = [math.prod(shape[i:]) for i in range(len(shape) + 1)]
    ends = [i for i, s in enumerate(suffix) if s == inner]
    starts = [i for i, s in enumerate(suffix) if s == inner * n]
    if not ends or not starts:
        return None
    a, b = max(starts), min(ends)
    return (a, b) if a <= b else (b, b)


def _settled(shape: tuple[int, ...], run: Run | None, n: int) -> Run | str:
    if run is None:
        return _MIXED
    found = _canonical(shape, math.prod(shape[run[1]:]), n)
    return _MIXED if found is None else found


def out_run(r: Rules, op: str, attrs: tuple, args: tuple[int, ...], runs: list, shape: tuple[int, ...], n: int) -> Run | None | str:
    """The slots' run in the output of `op`, given each argument's (None: it reads no slot);
    `_MIXED` where the op mixes slots."""
    held = [(a, run) for a, run in zip(args, runs) if run is not None]
    if not held:
        return None
    if any(run == _MIXED for _, run in held):
        return _MIXED
    first, (a, b) = r.shape(held[0][0]), held[0][1]
    if op == "view":
        return _settled(shape, _canonical(shape, math.prod(first[b:]), n), n)
    if op == "bcast":
        placed = attrs[0][a:b]
        if any(q != p + 1 for p, q in zip(placed, placed[1:])):
            return _MIXED
        return _settled(shape, (placed[0], placed[-1] + 1) if placed else (len(shape), len(shape)), n)
    if op == "permute":
        spots = [attrs[0].index(d) for d in range(a, b)]
        if any(q != p + 1 for p, q in zip(spots, spots[1:])):
            return _MIXED
        return _settled(shape, (spots[0], spots[-1] + 1) if spots else (a, b), n)
    if op == "slice":
        return _settled(shape, (a, b), n) if all(attrs[0][d] == (0, first[d]) for d in range(a, b)) else _MIXED
    if op == "matmul":
        return _matmul_run(r, args, runs, shape, n)
    if op in ("sum", "amax"):
        dims, keep = attrs[0], attrs[1]
        if any(a <= d < b for d in dims):
            return _MIXED
        shift = 0 if keep else sum(1 for d in dims if d < a)
        return _settled(shape, (a - shift, b - shift), n)
    if op in ("softmax", "log_softmax"):
        return _MIXED if a <= attrs[0] % len(shape) < b else _settled(shape, (a, b), n)
    if op == "cat" and not a <= attrs[0] < b:  # parts joined along a dim of no slot
        found = {_settled(shape, run, n) for _, run in held}
        return found.pop() if len(found) == 1 else _MIXED
    if op == "lin" or (op in OPS and OPS[op].kind in _ELEMENTWISE_KINDS):
        found = {_settled(shape, run, n) if r.shape(t) == shape else _MIXED for t, run in held}
        return found.pop() if len(found) == 1 else _MIXED
    return _MIXED


def _matmul_run(r: Rules, args: tuple[int, ...], runs: list, shape: tuple[int, ...], n: int) -> Run | str:
    """A batched product computes slot by slot along its batch dims, and along A's rows or B's
    columns; it contracts the dim between."""
    rank = len(shape)
    found = set()
    for side, (t, run) in enumerate(zip(args, runs)):
        if run is None:
            continue
        a, b = run
        arg_rank = len(r.shape(t))
        free = (arg_rank - 2, arg_rank - 1) if side == 0 else (arg_rank - 1, arg_rank)
        if (a, b) == free and a < b:
            out = (rank - 2, rank - 1) if side == 0 else (rank - 1, rank)
        elif arg_rank == rank and b <= rank - 2:
            out = (a, b)
        else:
            return _MIXED
        found.add(_settled(shape, out, n))
    return found.pop() if len(found) == 1 else _MIXED


def slot_run(r: Rules, t: int, sources: dict[int, Run], n: int) -> Run | None | str:
    """The run of `t`'s dims that holds the slots, where `sources` hold them in the given runs:
    None where `t` reads no source, `_MIXED` where it mixes slots."""
    memo: dict[int, Run | None | str] = dict(sources)
    stack = [t]
    while stack:
        x = stack[-1]
        if x in memo:
            stack.pop()
            continue
        term = r.u[x]
        if not term.args or r.in_reference(x):
            memo[x] = None  # what the reference built reads no rank's lookup
            stack.pop()
            continue
        pending = [a for a in term.args if a not in memo]
        if pending:
            stack.extend(pending)
            continue
        stack.pop()
        memo[x] = out_run(r, term.op, term.attrs, term.args, [memo[a] for a in term.args], term.shape, n)
    return memo[t]


def _renumbered(r: Rules, index: int, ids: int, lo: int, hi: int) -> bool:
    """`index` is ids - lo, reshaped, wherever ids lies in [lo, hi) (perhaps clamped into the block,
    perhaps a sentinel elsewhere, chosen by a test of that range)."""
    if math.prod(r.shape(index)) != math.prod(r.shape(ids)):
        return False
    assumed = {mask: r.const(("full", not outside), r.shape(mask), "bool")
               for mask, (tested, m_lo, m_hi, outside) in range_masks(r, index) if (tested, m_lo, m_hi) == (ids, lo, hi)}
    return is_shift_of(r, index, ids, lo, hi, assumed)


def local_lookups(r: Rules, t: int, ids: int, lo: int, hi: int) -> dict[int, int]:
    """The rank's lookups inside `t` into the rows [lo, hi) of a table at ids renumbered into them,
    each with the lookup into the whole table at ids."""
    found: dict[int, int] = {}
    seen, stack = set(), [t]
    while stack:
        x = stack.pop()
        if x in seen or r.in_reference(x):
            continue
        seen.add(x)
        term = r.u[x]
        stack.extend(term.args)
        if term.op != "embedding":
            continue
        table, index = term.args
        root, box = r.as_region(table)
        if root == table or box[0] != (lo, hi) or box[1] != (0, r.shape(root)[1]) or not _renumbered(r, index, ids, lo, hi):
            continue
        whole_ids = r.view(ids, r.shape(index))
        found[x] = r.build("embedding", (root, whole_ids), (), term.shape, term.dtype)
    return found


def _lookup_runs(r: Rules, lookups: dict[int, int], n: int) -> dict[int, Run]:
    """A lookup's slots are its index's dims, which flatten to the ids' positions."""
    runs = {}
    for e in lookups:
        index_rank = len(r.shape(r.u[e].args[1]))
        found = _canonical(r.shape(e), math.prod(r.shape(e)[index_rank:]), n)
        if found is not None:
            runs[e] = found
    return runs


def masking(r: Rules, cond: int, zero_when: bool) -> tuple[int, int, int, int] | None:
    """(ids, lo, hi, m) when the bool `cond` (perhaps broadcast or reshaped from the test m) zeroes a
    value where it is `zero_when`, and that is where ids lies outside [lo, hi)."""
    base = cond
    while r.op(base) in ("bcast", "view"):
        base = r.u[base].args[0]
    tested = outside_range(r, base) if zero_when else inside_range(r, base)
    return None if tested is None or r.shape(tested[0]) != r.shape(base) else (*tested, base)


def vanishing(r: Rules, t: int, depth: int = _SEARCH_DEPTH) -> tuple[Mask, Run] | None:
    """(mask, run): `t` is zero on the slots whose ids lie outside [lo, hi), through `where`s of
    that test (the mask's last entry: all of them) multiplied into `t` slot by slot; run holds the
    slots in `t` (answers kept: products ask of each operand, chains of products of theirs)."""
    key = (t, depth, r.reference_size)
    if key not in r.vanishing:
        r.vanishing[key] = _vanishing(r, t, depth)
    return r.vanishing[key]


def _vanishing(r: Rules, t: int, depth: int) -> tuple[Mask, Run] | None:
    term = r.u[t]
    if depth == 0 or r.in_reference(t):
        return None
    if term.op == "where":
        cond, when_true, when_false = term.args
        for zero, zero_when in ((when_true, True), (when_false, False)):
            tested = masking(r, cond, zero_when) if r.full_value(zero) == 0 else None
            if tested is not None:
                ids, lo, hi, base = tested
                n = math.prod(r.shape(ids))
                run = slot_run(r, cond, {base: (0, len(r.shape(base)))}, n)
                if run is not None and run != _MIXED:
                    return (ids, lo, hi, frozenset((t,))), run
        return None
    if term.op in ("cat", "lin"):  # every part vanishes
        found = [vanishing(r, a, depth - 1) for a in term.args]
        if None in found or len({mask[:3] for mask, _ in found}) != 1:
            return None
        n = math.prod(r.shape(found[0][0][0]))
        out = out_run(r, term.op, term.attrs, term.args, [run for _, run in found], term.shape, n)
        if out is None or out == _MIXED:
            return None
        return (*found[0][0][:3], frozenset().union(*(mask[3] for mask, _ in found))), out
    if term.op not in ("mul", "view", "bcast", "permute", "slice", "matmul", "sum"):
        return None
    for i, a in enumerate(term.args):  # one factor vanishes
        found = vanishing(r, a, depth - 1)
        if found is None:
            continue
        mask, run = found
        runs = [run if j == i else None for j in range(len(term.args))]
        out = out_run(r, term.op, term.attrs, term.args, runs, term.shape, math.prod(r.shape(mask[0])))
        if out is not None and out != _MIXED:
            return mask, out
    return None


def whole_under(r: Rules, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], zeroed: int) -> tuple[int, ...] | None:
    """The arguments of `op` with the rank's renumbered lookups in all but argument `zeroed` read
    from the whole table, where argument `zeroed` vanishes outside the rank's block and `op` meets
    them slot by slot; None where nothing changes."""
    found = vanishing(r, args[zeroed])
    if found is None:
        return None
    (ids, lo, hi, _), run = found
    n = math.prod(r.shape(ids))
    new_args = list(args)
    for i, a in enumerate(args):
        if i == zeroed:
            continue
        lookups = local_lookups(r, a, ids, lo, hi)
        if not lookups:
            continue
        own = slot_run(r, a, _lookup_runs(r, lookups, n), n)
        if own in (None, _MIXED):
            return None
        runs = [run if j == zeroed else own if j == i else None for j in range(len(args))]
        if _slot_by_slot(r, op, attrs, args, runs, shape, n):
            new_args[i] = rebuild(r, a, lookups, {})
    return tuple(new_args) if new_args != list(args) else None


def _slot_by_slot(r: Rules, op: str, attrs: tuple, args: tuple[int, ...], runs: list, shape: tuple[int, ...], n: int) -> bool:
    """`op` meets its arguments' slots position by position (each run maps to one output run)."""
    outs = {out_run(r, op, attrs, args, [run if j == i else None for j in range(len(args))], shape, n)
            for i, run in enumerate(runs) if run is not None}
    return len(outs) == 1 and _MIXED not in outs and None not in outs


def row_masked(r: Rules, t: int) -> tuple[int, int] | None:
    """(keep, x): the (count, width) rows `t` are x where the per-row flag keep (count, 1) holds and
    zero elsewhere, the flag a test of ids (one per row) against a rank's block."""
    if len(r.shape(t)) != 2:
        return None
    found = vanishing(r, t)
    if found is None or found[1] != (0, 1):
        return None
    (ids, lo, hi, masks), _ = found
    kept = {}
    for masked in masks:  # each where as the value it keeps: t is that where the flag holds
        _, when_true, when_false = r.u[masked].args
        kept[masked] = when_false if r.full_value(when_true) == 0 else when_true
    range_test = inside_test(r, ids, lo, hi)
    return r.view(range_test, (r.shape(t)[0], 1)), rebuild(r, t, kept, {})


# Ops linear (not only affine) in an argument, the others held: a sum over ranks of their values
# is their value at the sum. None: in each argument (mul, matmul; lin of one scaled term).
_LINEAR_IN = {"mul": None, "matmul": None, "lin": None, "div": (0,), "view": (0,), "bcast": (0,), "permute": (0,),
              "slice": (0,), "repeat": (0,), "sum": (0,), "convert": (0,), "embedding": (0,), "gather": (0,),
              "scatter_add": (2,)}


def tiled_sum(r: Rules, terms: list[int]) -> int | None:
    """The sum of `terms`, one linear context of masks where(ids outside [lo_i, hi_i), 0, x) of one x
    whose blocks cover every value ids takes (each once), as the context of x; else None."""
    first = r.u[terms[0]]
    if len({r.shape(t) for t in terms}) != 1:
        return None
    masked = [_masked_value(r, t) for t in terms]
    if None not in masked and len({(x, ids, layout) for x, ids, _, _, layout in masked}) == 1:
        _, ids, _, _, _ = masked[0]
        return masked[0][0] if _tile(r, ids, [(lo, hi) for _, _, lo, hi, _ in masked]) else None
    others = [r.u[t] for t in terms[1:]]
    if any((o.op, o.attrs if o.op != "lin" else None, len(o.args)) != (first.op, first.attrs if first.op != "lin" else None,
                                                                       len(first.args)) for o in others):
        return None
    if first.op not in _LINEAR_IN or (first.op == "lin" and len(first.args) != 1):
        return None  # (a sum with a shared term, a cat with a shared part: affine in the rest)
    if first.op == "scatter_add" and r.full_value(first.args[0]) != 0:
        return None  # (written into values every rank holds: affine)
    holes = _holes(r, terms, _LINEAR_IN[first.op])
    if holes is None:
        return None
    position, parts = holes
    inner = tiled_sum(r, parts)
    return None if inner is None else rebuild(r, terms[0], {r.u[terms[0]].args[position]: inner}, {})


def _holes(r: Rules, terms: list[int], linear_in: tuple[int, ...] | None) -> tuple[int, list[int]] | None:
    """(position in the first term, the terms there): the one argument the terms differ in, where
    their op is linear in it (and the other arguments, with their coefficients, are shared)."""
    pairs = [list(zip(r.u[t].args, r.u[t].attrs[0])) if r.op(t) == "lin" else list(r.u[t].args) for t in terms]
    if linear_in is None and r.op(terms[0]) in ("mul", "lin"):  # commutative: the shared arguments in any order
        shared = set(pairs[0]).intersection(*pairs[1:])
        rest = [[p for p in ps if p not in shared] for ps in pairs]
        if any(len(x) != 1 for x in rest) or (r.op(terms[0]) == "lin" and len({x[0][1] for x in rest}) != 1):
            return None
        parts = [x[0][0] if r.op(terms[0]) == "lin" else x[0] for x in rest]
        return pairs[0].index(rest[0][0]), parts
    differ = [i for i in range(len(pairs[0])) if len({ps[i] for ps in pairs}) > 1]
    if len(differ) != 1 or (linear_in is not None and differ[0] not in linear_in):
        return None
    return differ[0], [ps[differ[0]] for ps in pairs]


def _masked_value(r: Rules, t: int) -> tuple[int, int, int, int, int] | None:
    """(x, ids, lo, hi, layout) for t = where(ids outside [lo, hi), 0, x) (or where(inside, x, 0)),
    layout the mask's broadcasts and reshapes (applied to ids itself): masks of one layout meet."""
    term = r.u[t]
    if term.op != "where":
        return None
    cond, when_true, when_false = term.args
    for zero, x, zero_when in ((when_true, when_false, True), (when_false, when_true, False)):
        tested = masking(r, cond, zero_when) if r.full_value(zero) == 0 else None
        if tested is not None:
            ids, lo, hi, base = tested
            return x, ids, lo, hi, _laid_out(r, cond, base, ids)
    return None


def _laid_out(r: Rules, t: int, base: int, ids: int) -> int:
    """`t`, broadcasts and reshapes of `base`, applied to `ids` instead."""
    term = r.u[t]
    if t == base:
        return ids
    inner = _laid_out(r, term.args[0], base, ids)
    return r.view(inner, term.shape) if term.op == "view" else r.bcast(inner, term.shape, term.attrs[0])


def _tile(r: Rules, ids: int, blocks: list[tuple[int, int]]) -> bool:
    """The blocks follow each other without gap or overlap over every value ids can take."""
    bounds = interval(r, ids, {})
    blocks = sorted(blocks)
    if bounds is None or any(hi != lo for (_, hi), (lo, _) in zip(blocks, blocks[1:])):
        return False
    return blocks[0][0] <= bounds[0] and bounds[1] < blocks[-1][1]


def whole_where(r: Rules, cond: int, when_true: int, when_false: int) -> tuple[int, int] | None:
    """where(ids outside [lo, hi), 0, x) (or where(inside, x, 0)) with the rank's renumbered lookups
    in x read from the whole table, where x meets the test slot by slot; None where nothing changes."""
    for zero, kept, zero_when in ((when_true, when_false, True), (when_false, when_true, False)):
        tested = masking(r, cond, zero_when) if r.full_value(zero) == 0 else None
        if tested is None:
            continue
        ids, lo, hi, base = tested
        n = math.prod(r.shape(ids))
        lookups = local_lookups(r, kept, ids, lo, hi)
        if not lookups:
            continue
        own = slot_run(r, kept, _lookup_runs(r, lookups, n), n)
        if own in (None, _MIXED) or own != slot_run(r, cond, {base: (0, len(r.shape(base)))}, n):
            continue
        whole = rebuild(r, kept, lookups, {})
        return (zero, whole) if zero_when else (whole, zero)
    return None


def inside_test(r: Rules, ids: int, lo: int, hi: int) -> int:
    """The bool test lo <= ids < hi."""
    shape, dtype = r.shape(ids), r.u[ids].dtype
    above = r.build("ge", (ids, r.const(("full", lo), shape, dtype)), (), shape, "bool")
    below = r.build("lt", (ids, r.const(("full", hi), shape, dtype)), (), shape, "bool")
    return r.build("logical_and", (above, below), (), shape, "bool")
