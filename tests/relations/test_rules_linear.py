"""Numeric tests of the linear constructors (`rules/linear.py`): sums, scales, pieces, and sums of
concatenations cut at their parts.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_rules import SETTINGS, Build, V, cuts


@st.composite
def flat_buffers(draw):
    """Parameter shapes, a world size and a padded flat length (ZeRO's gradient buffer)."""
    shapes = draw(st.lists(st.tuples(st.integers(1, 3), st.integers(1, 4)), min_size=1, max_size=3))
    ranks = draw(st.integers(1, 3))
    numel = sum(r * c for r, c in shapes)
    return shapes, ranks, -(-numel // ranks) * ranks - numel


def _zero_padded(b: Build, x: V, dim: int, lo: int, hi: int) -> V:
    """x[lo:hi] along `dim` put back in place with zeros around it: the gradient through a slice."""
    parts = []
    for a, z in ((0, lo), (lo, hi), (hi, x.shape[dim])):
        if a == z:
            continue
        shape = tuple(z - a if d == dim else n for d, n in enumerate(x.shape))
        parts.append(b.sl(x, dim, a, z) if (a, z) == (lo, hi) else b.scalar(0.0, shape))
    return b.cat(parts, dim) if len(parts) > 1 else parts[0]


def test_lin_add_is_commutative_and_associative():
    b = Build()
    x, y, z = (b.leaf(n, (3, 4)) for n in "xyz")
    s1 = b.add(b.add(x, y), z)
    s2 = b.add(z, b.add(y, x))
    b.check(s1)
    b.check(s2)
    assert s1.term == s2.term


def test_lin_sub_and_neg_cancel():
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (3, 4))
    back = b.sub(b.add(x, y), y)
    b.check(back)
    assert back.term == x.term
    twice = b.op("neg", b.op("neg", x))
    b.check(twice)
    assert twice.term == x.term
    zero = b.sub(x, x)
    b.check(zero)
    assert b.op_of(zero) == "full" and b.u[zero.term].attrs == (0.0,)


@SETTINGS
@given(st.sampled_from([2.0, 0.5, -3.0, 0.25, 1.5]), st.sampled_from([2.0, 4.0, -0.5, 3.0]))
def test_lin_scaling_by_constants(c, d):
    b = Build()
    x, y = b.leaf("x", (2, 5)), b.leaf("y", (2, 5))
    scaled = b.op("mul", x, b.scalar(c, x.shape))
    left = b.op("mul", b.scalar(c, x.shape), x)
    assert scaled.term == left.term
    divided = b.op("div", b.add(scaled, y), b.scalar(d, x.shape))
    b.check(divided)
    term = b.u[divided.term]
    assert term.op == "lin" and dict(zip(term.args, term.attrs[0])) == {
        x.term: Fraction(c) / Fraction(d),
        y.term: 1 / Fraction(d),
    }


def test_lin_merges_equal_terms():
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (3, 4))
    half = b.scalar(0.5, x.shape)
    y1 = b.op("mul", b.add(x, y), half)
    y2 = b.op("mul", b.sub(x, y), half)
    total = b.add(y1, y2)
    b.check(total)
    assert total.term == x.term
    three = b.add(x, x, x)
    b.check(three)
    t = b.u[three.term]
    assert t.op == "lin" and t.args == (x.term,) and t.attrs[0] == (Fraction(3),)


def test_lin_mean_all_reduce_of_replicas_is_the_value():
    b = Build()
    x = b.leaf("x", (3, 4))
    quarter = b.scalar(0.25, x.shape)
    replicas = [b.op("mul", b.op("exp", x), quarter) for _ in range(4)]
    y = b.add(*replicas)
    b.check(y)
    assert y.term == b.op("exp", x).term


def test_lin_commutes_with_layout():
    b = Build()
    x, y = b.leaf("x", (4, 6)), b.leaf("y", (4, 6))
    s = b.add(x, y)
    z = b.permute(b.view(b.sl(s, 1, 0, 4), (2, 2, 4)), (2, 0, 1))
    b.check(z)
    assert b.op_of(z) == "lin"


@SETTINGS
@given(flat_buffers())
def test_lin_of_flat_buffers_is_the_flat_buffer_of_sums(buffers):
    """Each rank flattens its gradients into one padded buffer; the sum over ranks is the buffer
    of the summed gradients, so pieces of one contraction meet again."""
    shapes, ranks, pad = buffers
    b = Build()
    grads = [[b.leaf(f"g{r}_{i}", shape) for i, shape in enumerate(shapes)] for r in range(ranks)]

    def flat(tensors):
        parts = [b.view(t, (math.prod(t.shape),)) for t in tensors]
        return b.cat(parts + ([b.scalar(0.0, (pad,))] if pad else []), 0) if len(parts) + bool(pad) > 1 else parts[0]

    total = b.add(*(flat(g) for g in grads))
    b.check(total)
    summed = [b.add(*(grads[r][i] for r in range(ranks))) for i in range(len(shapes))]
    assert total.term == flat(summed).term


def test_lin_of_cats_with_other_boundaries_is_cut_at_all_of_them():
    b = Build()
    x, y = b.leaf("x", (6,)), b.leaf("y", (6,))
    left = b.cat([b.sl(x, 0, 0, 2), b.op("exp", b.sl(x, 0, 2, 6))], 0)
    right = b.cat([b.op("exp", b.sl(y, 0, 0, 4)), b.sl(y, 0, 4, 6)], 0)
    total = b.add(left, b.op("mul", right, b.scalar(3.0, (6,))), b.scalar(1.0, (6,)))
    b.check(total)
    term = b.u[total.term]
    assert term.op == "cat" and [b.u[p].shape[0] for p in term.args] == [2, 2, 2]


def test_lin_of_a_cat_and_another_tensor_is_kept():
    b = Build()
    x, y = b.leaf("x", (6,)), b.leaf("y", (6,))
    total = b.add(b.cat([b.op("exp", b.sl(x, 0, 0, 2)), b.sl(x, 0, 2, 6)], 0), y)
    b.check(total)
    assert b.op_of(total) == "lin"


@SETTINGS
@given(st.integers(2, 8), st.integers(0, 1), st.data())
def test_lin_of_zero_padded_shards_is_the_whole(size, dim, data):
    """Each rank's slice gradient, zero-padded, summed over ranks (the all-reduce in the backward
    of a copy into the tensor-parallel region) is the full gradient."""
    b = Build()
    g = b.leaf("g", (3, size) if dim else (size, 3))
    points = data.draw(cuts(size))
    total = b.add(*(_zero_padded(b, g, dim, lo, hi) for lo, hi in zip(points, points[1:])))
    b.check(total)
    assert total.term == g.term


@pytest.mark.parametrize("divisor", [2, 3])
def test_a_scaled_constant_is_a_constant(divisor):
    """The backward seed of `(loss / steps).backward()` is the constant 1/steps, exactly."""
    b = Build()
    x = b.leaf("x", (2, 3))
    seed = b.op("div", b.scalar(1.0, ()), b.scalar(divisor, ()))
    assert b.op_of(seed) == "full" and b.u[seed.term].attrs == (Fraction(1, divisor),)
    y = b.op("mul", x, b.expand(b.view(seed, (1, 1)), (2, 3)))
    b.check(y)
    t = b.u[y.term]
    assert t.op == "lin" and t.args == (x.term,) and t.attrs[0] == (Fraction(1, divisor),)


def test_an_integer_constant_added_to_floats_is_a_float_sum_whichever_comes_first() -> None:
    """tanh-GELU's backward adds a Python `1` (an int64 constant) to float terms. The sum is a float
    whatever the order of its terms, so its scale moves out of a product alike on every rank."""
    b = Build()
    one = b.scalar(1, (2, 3), dtype=torch.int64)
    x, z = b.leaf("x", (2, 3)), b.leaf("z", (2, 3))
    half_sum = b.op("mul", b.add(one, x), b.scalar(0.5, (2, 3)))
    product = b.op("mul", half_sum, z)
    b.check(product)
    assert b.u[half_sum.term].dtype == "float64"
    assert product.term == b.op("mul", b.op("mul", b.add(x, one), z), b.scalar(0.5, (2, 3))).term


@pytest.mark.parametrize("ranks", [2, 4])
def test_ranks_shares_of_several_sums_add_up_to_a_flat_sum(ranks):
    """A rank's share of two sums over its rows (a bias gradient through a norm's backward: one
    share of each term) is one piece of their joint sum; the ranks' pieces, each divided before
    they are summed (FSDP's pre-divided reduce-scatter), add up to that joint sum, itself a sum:
    its terms stand beside the others', as in the reference's sum."""
    b = Build()
    x, y = b.leaf("x", (8, 3)), b.leaf("y", (8, 3))
    rows = 8 // ranks

    def share(r):
        lo, hi = r * rows, (r + 1) * rows
        return b.add(b.op("sum", b.sl(x, 0, lo, hi), attrs=((0,), False)),
                     b.op("mul", b.op("sum", b.sl(y, 0, lo, hi), attrs=((0,), False)), b.scalar(3.0, (3,))))

    averaged = b.add(*(b.op("div", share(r), b.scalar(float(ranks), (3,))) for r in range(ranks)))
    b.check(averaged)
    whole = b.add(b.op("sum", x, attrs=((0,), False)), b.op("mul", b.op("sum", y, attrs=((0,), False)), b.scalar(3.0, (3,))))
    expected = b.op("div", whole, b.scalar(float(ranks), (3,)))
    assert averaged.term == expected.term


def test_shares_of_shares_add_up_over_a_two_d_grid():
    """Rank (d, t) of a (data, tensor) grid holds, of a router's weight gradient g^T @ X, the share
    over its token rows d of a g that is itself its share over the hidden block t: summed over the
    whole grid in any order, the tensor shares meet once the data shares they sit in have."""
    b = Build()
    h, v, x = b.leaf("h", (4, 6)), b.leaf("v", (6, 3)), b.leaf("x", (4, 5))
    rows, block = 2, 3

    def share(d: int, t: int) -> V:
        g = b.op("matmul", b.sl(h, 1, t * block, (t + 1) * block), b.sl(v, 0, t * block, (t + 1) * block))
        return b.op("matmul", b.permute(b.sl(g, 0, d * rows, (d + 1) * rows), (1, 0)), b.sl(x, 0, d * rows, (d + 1) * rows))

    summed = b.add(*(share(d, t) for d, t in [(0, 0), (1, 1), (0, 1), (1, 0)]))
    b.check(summed)
    assert summed.term == b.op("matmul", b.permute(b.op("matmul", h, v), (1, 0)), x).term
