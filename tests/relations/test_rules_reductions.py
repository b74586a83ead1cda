"""Numeric tests of the reduction rules (`rules/reductions.py`): sums and maxes over regions,
broadcasts, views and concatenations, softmax, log-softmax and the log and exp rules that meet it.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from test_rules import SETTINGS, Build, cuts, shape_and_box


def test_sum_over_a_sliced_dim_with_another_dim_sliced():
    b = Build()
    x = b.leaf("x", (4, 6, 3))
    partials = [b.op("sum", b.sl(b.sl(x, 0, 1, 3), 1, lo, lo + 3), attrs=((1,), False)) for lo in (0, 3)]
    total = b.add(*partials)
    b.check(total)
    assert b.is_slice_of(total, b.op("sum", x, attrs=((1,), False)))


@SETTINGS
@given(shape_and_box(min_dims=2, max_dims=3), st.data())
def test_reduce_over_unsliced_dims_of_a_slice(sb, data):
    shape, box = sb
    free = [d for d in range(len(shape)) if box[d] == (0, shape[d])]
    dims = tuple(sorted(data.draw(st.sets(st.sampled_from(free), min_size=1)))) if free else (0,)
    if not free:
        box = ((0, shape[0]),) + box[1:]
    op = data.draw(st.sampled_from(["sum", "amax"]))
    keepdim = data.draw(st.booleans())
    b = Build()
    x = b.leaf("x", shape)
    y = b.op(op, b.box(x, box), attrs=(dims, keepdim))
    b.check(y)


@pytest.mark.parametrize("op", ["sum", "amax"])
@pytest.mark.parametrize("keepdim", [False, True])
def test_reduce_over_a_size_one_dim_and_an_unsliced_dim_of_a_slice(op, keepdim):
    """Dropping the size-1 dim must not merge the sliced dim into the reduced one (found by
    hypothesis: the squeeze read as a view of (1, 4) made the sum a piece of a larger sum)."""
    b = Build()
    x = b.leaf("x", (1, 2, 2))
    y = b.op(op, b.box(x, ((0, 1), (0, 1), (0, 2))), attrs=((0, 2), keepdim))
    b.check(y)
    assert b.op_of(y) not in ("piece", "max_piece")


@pytest.mark.parametrize("op", ["sum", "amax"])
@SETTINGS
@given(st.integers(2, 7), st.booleans(), st.data())
def test_reduce_over_sliced_ranges_combined_over_ranks_is_the_whole(op, size, keepdim, data):
    """Sums over parts of an axis add up to the sum (pieces); maxes combine by a max (max pieces)."""
    b = Build()
    x = b.leaf("x", (3, size, 2))
    points = data.draw(cuts(size))
    parts = [b.op(op, b.sl(x, 1, lo, hi), attrs=((1,), keepdim)) for lo, hi in zip(points, points[1:])]
    if len(parts) > 1:
        assert {b.op_of(p) for p in parts} == {"piece" if op == "sum" else "max_piece"}
    combine = b.add if op == "sum" else b.max_over
    total = combine(*parts)
    whole = b.op(op, x, attrs=((1,), keepdim))
    assert total.term == whole.term
    b.check(total)
    flip = tuple(reversed(range(len(whole.shape))))
    moved = combine(*[b.sl(b.permute(p, flip), 0, 0, 1) for p in parts])  # layout ops pass through pieces
    assert moved.term == b.sl(b.permute(whole, flip), 0, 0, 1).term
    b.check(moved)


@SETTINGS
@given(st.lists(st.integers(2, 4), min_size=2, max_size=4), st.sampled_from(["sum", "amax"]), st.booleans(), st.data())
def test_reduce_of_a_merging_view_reduces_the_source(shape, op, keepdim, data):
    """Summing a flattened (b*s, h) over its rows sums (b, s, h) over b and s."""
    shape = tuple(shape)
    merged = data.draw(st.integers(1, len(shape) - 1))
    flat = (math.prod(shape[:merged]),) + shape[merged:]
    b = Build()
    x = b.leaf("x", shape)
    y = b.op(op, b.view(x, flat), attrs=((0,), keepdim))
    b.check(y)
    direct = b.op(op, x, attrs=(tuple(range(merged)), False))
    assert y.term == b.view(direct, y.shape).term


def test_reduce_of_a_view_splitting_a_reduced_group_stays_literal():
    b = Build()
    x = b.leaf("x", (6, 4))
    y = b.op("sum", b.view(x, (2, 12)), attrs=((0,), False))
    b.check(y)
    assert b.op_of(y) == "sum"


def test_max_pieces_are_never_summed():
    b = Build()
    x = b.leaf("x", (3, 6))
    parts = [b.op("amax", b.sl(x, 1, lo, lo + 3), attrs=((1,), False)) for lo in (0, 3)]
    total = b.add(*parts)
    assert b.op_of(total) == "lin" and total.term != b.op("amax", x, attrs=((1,), False)).term


def test_max_over_equal_and_over_unrelated_values():
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (3, 4))
    assert b.max_over(x, x).term == x.term
    both = b.max_over(x, y, x)
    b.check(both)
    assert both.term == b.max_over(y, x).term


@SETTINGS
@given(st.lists(st.integers(1, 4), min_size=2, max_size=4), st.sampled_from(["sum", "amax"]), st.booleans(), st.data())
def test_reduce_over_broadcast_dims_reduces_copies(shape, op, keepdim, data):
    shape = tuple(shape)
    placed = sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), max_size=len(shape) - 1)))
    dims = tuple(sorted(data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))))
    b = Build()
    base = b.leaf("base", tuple(shape[d] for d in placed))
    x = b.expand(b.view(base, tuple(shape[d] if d in placed else 1 for d in range(len(shape)))), shape)
    y = b.op(op, x, attrs=(dims, keepdim))
    b.check(y)
    if set(dims).isdisjoint(placed):
        assert op not in b.ops_in(y)


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@SETTINGS
@given(shape_and_box(min_dims=2, max_dims=3), st.data())
def test_softmax_of_a_slice_keeping_the_softmax_dim(op, sb, data):
    shape, box = sb
    dim = data.draw(st.integers(0, len(shape) - 1))
    assume(op == "softmax" or shape[dim] > 1)  # log_softmax over one element: its row max lands ambiguously among size-1 dims
    box = tuple((0, s) if d == dim else r for d, (s, r) in enumerate(zip(shape, box)))
    b = Build()
    x = b.leaf("x", shape)
    y = b.op(op, b.box(x, box), attrs=(dim,))
    b.check(y)
    assert y.term == b.r.slice(b.op(op, x, attrs=(dim,)).term, box)


def test_softmax_of_a_slice_of_the_softmax_dim_stays_literal():
    b = Build()
    x = b.leaf("x", (3, 6))
    y = b.op("softmax", b.sl(x, 1, 0, 4), attrs=(1,))
    b.check(y)
    assert b.op_of(y) == "softmax"


@SETTINGS
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data())
def test_log_softmax_is_its_max_shifted_decomposition(shape, data):
    shape = tuple(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    b = Build()
    x = b.leaf("x", shape)
    y = b.op("log_softmax", x, attrs=(dim,))
    b.check(y)
    shifted = b.sub(x, b.expand(b.op("amax", x, attrs=((dim,), True)), shape))
    total = b.op("sum", b.op("exp", shifted), attrs=((dim,), True))
    assert b.sub(shifted, b.expand(b.op("log", total), shape)).term == y.term


@pytest.mark.parametrize("cuts_", [(0, 8), (0, 4, 8), (0, 3, 8), (0, 2, 4, 6, 8)])
def test_vocab_parallel_log_softmax_meets_the_reference(cuts_):
    """Each rank holds a vocab slice: max all-reduced by MAX, sum of exps by SUM, then gathered."""
    b = Build()
    x = b.leaf("x", (2, 3, 8))
    shards = [b.sl(x, 2, lo, hi) for lo, hi in zip(cuts_, cuts_[1:])]
    peak = b.max_over(*[b.op("amax", s, attrs=((2,), True)) for s in shards])
    shifted = [b.sub(s, b.expand(peak, s.shape)) for s in shards]
    total = b.add(*[b.op("sum", b.op("exp", z), attrs=((2,), True)) for z in shifted])
    gathered = b.cat([b.sub(z, b.expand(b.op("log", total), z.shape)) for z in shifted], 2)
    assert gathered.term == b.op("log_softmax", x, attrs=(2,)).term
    b.check(gathered)


def test_log_of_exp_and_of_exp_over_a_divisor():
    b = Build()
    a = b.leaf("a", (3, 4))
    d = b.leaf("d", (3, 4), value=torch.rand(3, 4, dtype=torch.float64, generator=b.gen) + 0.5)
    y = b.op("log", b.op("exp", a))
    b.check(y)
    assert y.term == a.term
    z = b.op("log", b.op("div", b.op("exp", a), d))
    b.check(z)
    assert z.term == b.sub(a, b.op("log", d)).term


def test_softmax_of_a_cat_along_another_dim():
    b = Build()
    x1, x2 = b.leaf("x1", (2, 5)), b.leaf("x2", (3, 5))
    y = b.op("softmax", b.cat([x1, x2], 0), attrs=(1,))
    b.check(y)
    assert b.op_of(y) == "cat"


@pytest.mark.parametrize("op", ["sum", "amax"])
def test_reducing_a_size_one_dim_drops_it(op):
    """Reducing a size-1 dim is a reshape (a batch of one row per rank); a one-wide shard of a
    longer axis stays a part of the full reduction (see the sliced-range tests)."""
    b = Build()
    x = b.leaf("x", (1, 3, 2))
    y = b.op(op, x, attrs=((0, 2), False))
    b.check(y)
    assert y.term == b.op(op, b.view(x, (3, 2)), attrs=((1,), False)).term


@SETTINGS
@given(st.lists(st.integers(1, 3), min_size=2, max_size=4), st.booleans())
def test_sum_over_the_joined_dim_of_a_cat_adds_the_parts(sizes, all_dims):
    """Stacked per-micro-batch losses summed over the stack are the sum of the losses."""
    b = Build()
    parts = [b.op("exp", b.leaf(f"p{i}", (n, 3))) for i, n in enumerate(sizes)]
    dims = (0, 1) if all_dims else (0,)
    total = b.op("sum", b.cat(parts, 0), attrs=(dims, False))
    b.check(total)
    assert total.term == b.add(*(b.op("sum", p, attrs=(dims, False)) for p in parts)).term


def test_exp_of_a_log_softmax_is_the_softmax():
    b = Build()
    x = b.leaf("x", (2, 5))
    probs = b.op("exp", b.op("log_softmax", x, attrs=(1,)))
    b.check(probs)
    peak = b.expand(b.op("amax", x, attrs=((1,), True)), x.shape)
    powers = b.op("exp", b.sub(x, peak))
    spelled = b.op("div", powers, b.expand(b.op("sum", powers, attrs=((1,), True)), x.shape))
    assert probs.term == spelled.term


@pytest.mark.parametrize("keepdim", [False, True])
def test_argmax_over_a_size_one_dim_is_position_zero_not_the_value(keepdim):
    """A one-wide slice of a larger dim is one rank's shard of it: its position stays a piece."""
    b = Build()
    y = b.op("argmax", b.leaf("x", (3, 1, 4)), attrs=((1,), keepdim))
    b.check(y)
    assert b.r.full_value(y.term) == 0
    shard = b.op("argmax", b.sl(b.leaf("z", (3, 5, 4)), 1, 2, 3), attrs=((1,), False))
    assert "arg_piece" in b.ops_in(shard)


@pytest.mark.parametrize("op", ["sum", "amax"])
def test_reducing_a_cat_along_another_dim_cats_the_reductions(op):
    """A rank's packed gate and up columns of every expert's product, summed over the experts: the
    reference's sum over the experts, at those columns."""
    b = Build()
    whole = b.leaf("x", (4, 3, 8))
    columns = b.cat([b.sl(whole, 2, 0, 2), b.sl(whole, 2, 4, 6)], 2)
    reduced = b.op(op, columns, attrs=((0,), False))
    b.check(reduced)
    assert b.op_of(reduced) == "cat"
    of_whole = b.op(op, whole, attrs=((0,), False))
    assert reduced.term == b.cat([b.sl(of_whole, 1, lo, lo + 2) for lo in (0, 4)], 1).term


def test_a_sum_over_flattened_rows_of_a_product_is_the_sum_over_the_rows_dims():
    """A bias gradient: (x.view(b*s, h) @ w).sum(0) of F.linear's 2-D form meets the sum over (b, s)
    of the 3-D product a rank computes."""
    b = Build()
    x, w = b.leaf("x", (2, 3, 4)), b.leaf("w", (4, 5))
    flat = b.op("sum", b.op("matmul", b.view(x, (6, 4)), w), attrs=((0,), False))
    b.check(flat)
    assert flat.term == b.op("sum", b.op("matmul", x, w), attrs=((0, 1), False)).term


@SETTINGS
@given(st.sets(st.integers(0, 3), min_size=1, max_size=3), st.data())
def test_a_permuted_reduction_is_the_reduction_of_its_operand_permuted(reduced, data):
    """A weight gradient summed over the batch, then transposed: the sum of the transposed operand,
    the reduced dims left in place."""
    op = data.draw(st.sampled_from(["sum", "amax"]))
    b = Build()
    x = b.leaf("x", (2, 3, 4, 5))
    dims = tuple(sorted(reduced))
    kept = 4 - len(dims)
    perm = tuple(data.draw(st.permutations(range(kept))))
    y = b.permute(b.op(op, x, attrs=(dims, False)), perm)
    b.check(y)
    assert b.op_of(y) == op if perm != tuple(range(kept)) else y.term == b.op(op, x, attrs=(dims, False)).term
