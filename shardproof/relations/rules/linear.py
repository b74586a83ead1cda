"""Linear structure: the constructors of linear combinations (`lin`), of pieces of a sum split over
ranks (`piece`), of a max split over ranks (`max_piece`, `maximum`) and of its position
(`arg_piece`), of a top k split over ranks (`top_piece`). A part of `Rules`: it
reaches the layout constructors through `self`.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Callable

from shardproof.relations.layout import box_along
from shardproof.relations.rules import masked_keys
from shardproof.relations.rules.online_softmax import merged
from shardproof.relations.rules.regions import cat_bounds
from shardproof.relations.rules.slots import tiled_sum
from shardproof.relations.rules.values import FLOAT_DTYPES, is_finite_number


PIECES = ("piece", "max_piece", "arg_piece", "top_piece")
_ONE = Fraction(1)
# Where a piece's axis names terms (the product, table, ids or whole it is a part of), by the axis's
# kind: ("matmul", A @ B); ("lookup", dim, table, ids); ("joint", axes); a reduction's or top k's
# (op, dim, whole) otherwise.
_AXIS_TERMS = {"matmul": (1,), "lookup": (2, 3)}


def attr_terms(op: str, attrs: tuple) -> tuple[int, ...]:
    """The terms an op's attrs name (a piece's axis): copied to another universe with it, they
    must be copied too, and renamed (`with_attr_terms`), or the copy names unrelated terms there."""
    found: list[int] = []
    with_attr_terms(op, attrs, lambda t: found.append(t) or t)
    return tuple(found)


def with_attr_terms(op: str, attrs: tuple, rename: Callable[[int], int]) -> tuple:
    """`attrs` with every term they name renamed (to its copy in another universe, to a boundary entry)."""
    return (_axis_renamed(attrs[0], rename), *attrs[1:]) if op in PIECES else attrs


def _axis_renamed(axis: Any, rename: Callable[[int], int]) -> Any:
    if axis[0] == "joint":
        return ("joint", tuple(sorted((_axis_renamed(a, rename) for a in axis[1]), key=repr)))
    at = _AXIS_TERMS.get(axis[0], (2,))
    return tuple(rename(v) if i in at else v for i, v in enumerate(axis))


class LinearRules:
    """Sums, scales, pieces and max pieces of `Rules`."""

    def lin(self, pairs: list[tuple[int, Fraction]]) -> int:
        coefs: dict[int, Fraction] = {}
        for t, c in pairs:
            c = c if type(c) is Fraction else Fraction(c)
            term = self.u[t]
            inner_pairs = zip(term.args, term.attrs[0]) if term.op == "lin" else [(t, _ONE)]
            for inner, ic in inner_pairs:
                inner, ic = self._unit_constant(inner, ic)
                weight = ic if c == 1 else c * ic  # Fraction arithmetic is slow: sums of many terms mostly add ones
                known = coefs.get(inner)
                coefs[inner] = weight if known is None else known + weight
        coefs = self._merge_pieces({t: c for t, c in coefs.items() if c != 0})
        if any(self.u[t].op == "lin" for t in coefs):  # pieces merged into a whole that is a sum itself
            return self.lin(list(coefs.items()))
        items = sorted(coefs.items())
        if not items:
            first = pairs[0][0]
            return self.literal("full", (), (0.0,), self.shape(first), self.u[first].dtype)
        if len(items) == 1 and items[0][1] == 1:
            return items[0][0]
        only, c = items[0]
        if len(items) == 1 and self.full_value(only) == 1 and self.u[only].dtype in FLOAT_DTYPES:
            return self.literal("full", (), (c,), self.shape(only), self.u[only].dtype)  # a scaled constant is a constant
        by_parts = self._lin_of_cats(items)
        by_parts = merged(self, items) if by_parts is None else by_parts
        if by_parts is not None:
            return by_parts
        if len(items) > 1 and len({c for _, c in items}) == 1 and len({self.u[t].op for t, _ in items}) == 1:
            tiled = tiled_sum(self, [t for t, _ in items])  # ranks' masks of one value over blocks covering its ids
            if tiled is not None:
                return self.scale(tiled, items[0][1])
        first = self.u[items[0][0]]
        # a sum with a float term is a float (an integer constant added to floats is promoted), whatever comes first
        dtype = next((self.u[t].dtype for t, _ in items if self.u[t].dtype in FLOAT_DTYPES), first.dtype)
        return self.literal("lin", tuple(t for t, _ in items), (tuple(c for _, c in items),), first.shape, dtype)

    def _lin_of_cats(self, items: list[tuple[int, Fraction]]) -> int | None:
        """A sum of concatenations along one dim (and constants) is the concatenation of the sums of
        their parts, cut at every part boundary: flat gradient buffers summed over ranks become the
        per-parameter sums, where pieces of one contraction meet and merge."""
        cats = [self.u[t] for t, _ in items if self.u[t].op == "cat"]
        if not cats:
            return None
        dim = cats[0].attrs[0]
        if any(self.u[t].op != "full" and (self.u[t].op != "cat" or self.u[t].attrs[0] != dim) for t, _ in items):
            return None
        shape = cats[0].shape
        cuts = sorted({0, shape[dim]} | {end for t, _ in items if self.u[t].op == "cat" for _, end in cat_bounds(self, t)})
        parts = []
        for lo, hi in zip(cuts, cuts[1:]):
            box = box_along(shape, dim, lo, hi)
            parts.append(self.lin([(self.slice(t, box), c) for t, c in items]))
        return self.cat(parts, dim)

    def _unit_constant(self, t: int, c: Fraction) -> tuple[int, Fraction]:
        """c * full(v) is (v*c) * full(1): constants of one shape merge into one term."""
        term = self.u[t]
        if term.op == "full" and is_finite_number(term.attrs[0]) and term.attrs[0] != 1:
            one = self.literal("full", (), (1.0 if term.dtype in FLOAT_DTYPES else 1,), term.shape, term.dtype)
            return one, c * Fraction(term.attrs[0])
        return t, c

    def _merge_pieces(self, coefs: dict[int, Fraction]) -> dict[int, Fraction]:
        """Pieces of one sum whose ranges tile the whole axis add up to the sum itself; where that
        sum is a piece of another (a TP rank's share of a data-parallel rank's share), again."""
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for t, c in coefs.items():
            term = self.u[t]
            if term.op == "piece":
                axis, lo, hi, size = term.attrs
                groups.setdefault((term.args[0], axis, size, c), []).append((lo, hi, t))
        nested = False
        for (full, axis, size, c), ranges in groups.items():
            for run in _adjacent_runs(ranges):
                for _, _, t in run:
                    del coefs[t]
                merged = self.piece(full, axis, run[0][0], run[-1][1], size)
                coefs[merged] = coefs.get(merged, Fraction(0)) + c
                nested = nested or self.u[merged].op == "piece"
        return self._merge_pieces(coefs) if nested else self._joint_piece(coefs)

    def _joint_piece(self, coefs: dict[int, Fraction]) -> dict[int, Fraction]:
        """A sum of pieces of different sums, all over one range, is that range of their sum (see
        `pieces_joined`). A rank's share of a fused gate/up product's gradient, one piece from each
        half, stays one partial sum through what is linear in it (`where(mask, x, 0)`), as the
        reference's sum does."""
        terms = [self.u[t] for t in coefs]
        joined = None if len(terms) < 2 else self.pieces_joined(
            terms, lambda sums: self.lin(list(zip(sums, coefs.values()))))
        return coefs if joined is None else {joined: Fraction(1)}

    def pieces_joined(self, pieces: list[Any], join: Callable[[list[int]], int]) -> int | None:
        """Pieces (terms) all over the same range [lo, hi) of the same number of indices, combined
        by a `join` linear in each (a sum, a cat) as that range of the join of their sums: the
        pieces' indices pair up one to one (index k of the join's sum is the k-th of every part's),
        so the ranks' pieces still tile the whole. None if they are not such pieces."""
        if any(p.op != "piece" for p in pieces) or len({p.attrs[1:] for p in pieces}) != 1:
            return None
        axis = ("joint", tuple(sorted((p.attrs[0] for p in pieces), key=repr)))
        return self.piece(join([p.args[0] for p in pieces]), axis, *pieces[0].attrs[1:])

    def piece(self, full: int, axis: Any, lo: int, hi: int, size: int) -> int:
        """The part of the sum `full` whose summation index along `axis` lies in [lo, hi)."""
        vanishing = masked_keys.contraction_piece(self, full, axis, lo, hi, size)
        if (lo, hi) == (0, size) or vanishing == "whole":
            return full
        term = self.u[full]
        if vanishing == "zero":
            return self.literal("full", (), (0.0,), term.shape, term.dtype)
        return self.literal("piece", (full,), (axis, lo, hi, size), term.shape, term.dtype)

    def max_piece(self, full: int, axis: Any, lo: int, hi: int, size: int) -> int:
        """The max `full` takes over the indices [lo, hi) of the reduced `axis` only (one rank's max
        over its shard). Max pieces combine by a max (see `maximum`), never by a sum."""
        if (lo, hi) == (0, size):
            return full
        term = self.u[full]
        return self.literal("max_piece", (full,), (axis, lo, hi, size), term.shape, term.dtype)

    def arg_piece(self, full: int, axis: Any, lo: int, hi: int, size: int) -> int:
        """The position along the reduced axis of the max over its indices [lo, hi) only: one rank's
        argmax over its shard plus the shard's offset, where `full` is the argmax over the whole
        axis and `axis` the one of the matching `max_piece`. It combines with other ranks' by the
        pick of the largest max (see `lookups.gather`)."""
        if (lo, hi) == (0, size):
            return full
        term = self.u[full]
        return self.literal("arg_piece", (full,), (axis, lo, hi, size), term.shape, term.dtype)

    def top_piece(self, full: int, axis: Any, lo: int, hi: int, size: int) -> int:
        """The top k (values, or positions along the whole axis) over the indices [lo, hi) of
        `axis` only, where `full` is that output of the top k over the whole axis: one rank's top k
        over its shard. Ranks' pieces combine by a top k of their candidates (see `rules.topk`)."""
        if (lo, hi) == (0, size):
            return full
        term = self.u[full]
        return self.literal("top_piece", (full,), (axis, lo, hi, size), term.shape, term.dtype)

    def maximum(self, parts: list[int]) -> int:
        """The elementwise max of `parts` (a MAX all-reduce): equal terms collapse, and max pieces
        whose ranges tile their axis are the max over the whole axis."""
        operands = set(parts)
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for t in operands:
            term = self.u[t]
            if term.op == "max_piece":
                axis, lo, hi, size = term.attrs
                groups.setdefault((term.args[0], axis, size), []).append((lo, hi, t))
        for (full, axis, size), ranges in groups.items():
            for run in _adjacent_runs(ranges):
                operands -= {t for _, _, t in run}
                operands.add(self.max_piece(full, axis, run[0][0], run[-1][1], size))
        result, *rest = sorted(operands)
        for t in rest:
            result = self.build("maximum", (result, t), (), self.shape(result), self.u[result].dtype)
        return result

    def _map_parts(self, x: int, f: Callable[[int], int], shape: tuple[int, ...]) -> int:
        """Apply a layout map (it moves elements) through lin and the pieces."""
        term = self.u[x]
        if term.op in ("max_piece", "arg_piece", "top_piece"):
            return getattr(self, term.op)(f(term.args[0]), *term.attrs)
        return self._map_linear(x, f, shape)

    def _map_linear(self, x: int, f: Callable[[int], int], shape: tuple[int, ...]) -> int:
        """Apply a linear map through `lin` and `piece`."""
        term = self.u[x]
        if term.op == "lin":
            return self.lin([(f(t), c) for t, c in zip(term.args, term.attrs[0])])
        axis, lo, hi, size = term.attrs
        return self.piece(f(term.args[0]), axis, lo, hi, size)

    def scale(self, x: int, factor: Any) -> int:
        return self.lin([(x, Fraction(factor))])

    def common_factor(self, t: int) -> tuple[int, Fraction]:
        """(u, c) with t = c * u, so that scales move out of products (a gradient averaged over a
        data-parallel group is (1/dp) times the sum over its batch shard). A scaled term gives its
        coefficient; a sum gives c > 0, the largest rational dividing every coefficient, which does
        not depend on the order of the terms, so every rank's slice of a sum factors like the sum."""
        term = self.u[t]
        if term.op != "lin" or term.dtype not in FLOAT_DTYPES:  # integer lin truncates: no factoring
            return t, Fraction(1)
        coefs = term.attrs[0]
        if len(coefs) == 1:
            return term.args[0], coefs[0]
        c = Fraction(math.gcd(*(k.numerator for k in coefs)), math.lcm(*(k.denominator for k in coefs)))
        if c == 1:
            return t, c
        return self.lin([(a, k / c) for a, k in zip(term.args, coefs)]), c


def _adjacent_runs(ranges: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """The runs of two or more (lo, hi, term) whose ranges follow each other without gap or overlap."""
    ranges = sorted(ranges)
    runs: list[list[tuple[int, int, int]]] = [[ranges[0]]]
    for r in ranges[1:]:
        if r[0] == runs[-1][-1][1]:
            runs[-1].append(r)
        else:
            runs.append([r])
    return [run for run in runs if len(run) > 1]
