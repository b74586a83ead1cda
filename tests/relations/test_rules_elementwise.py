"""Numeric tests of the elementwise rules (`rules/elementwise.py`): unary, binary, compare and where
ops commute with slices, concatenations, broadcasts and reshapes; exact ops fold on constants.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from test_rules import SETTINGS, Build, labels, shape_and_box


UNARY = [("relu", ()), ("exp", ()), ("silu", ()), ("tanh", ()), ("erf", ()), ("gelu", ("tanh",)), ("pow", (2.0,))]


@pytest.mark.parametrize("op,attrs", UNARY, ids=[u[0] for u in UNARY])
def test_unary_commutes_with_slice(op, attrs):
    b = Build()
    x = b.leaf("x", (4, 6))
    y = b.op(op, b.sl(b.sl(x, 1, 2, 5), 0, 1, 3), attrs=attrs)
    b.check(y)
    assert b.is_slice_of(y, b.op(op, x, attrs=attrs))


@pytest.mark.parametrize("op,attrs", UNARY, ids=[u[0] for u in UNARY])
def test_unary_commutes_with_cat(op, attrs):
    b = Build()
    x1, x2 = b.leaf("x1", (4, 2)), b.leaf("x2", (4, 3))
    y = b.op(op, b.cat([x1, x2], 1), attrs=attrs)
    b.check(y)
    term = b.u[y.term]
    assert term.op == "cat" and term.args == (b.op(op, x1, attrs=attrs).term, b.op(op, x2, attrs=attrs).term)


@pytest.mark.parametrize("op,attrs", UNARY, ids=[u[0] for u in UNARY])
def test_unary_commutes_with_broadcast(op, attrs):
    b = Build()
    bias = b.leaf("bias", (5,))
    y = b.op(op, b.expand(b.view(bias, (1, 5)), (3, 5)), attrs=attrs)
    b.check(y)
    term = b.u[y.term]
    assert term.op == "bcast" and term.args[0] == b.op(op, bias, attrs=attrs).term


@pytest.mark.parametrize("op", ["mul", "maximum", "minimum", "div"])
@SETTINGS
@given(shape_and_box(min_dims=2, max_dims=3))
def test_binary_with_equal_slices(op, sb):
    shape, box = sb
    b = Build()
    x, y = b.leaf("x", shape), b.leaf("y", shape)
    z = b.op(op, b.box(x, box), b.box(y, box))
    b.check(z)
    if box != tuple((0, s) for s in shape):
        assert b.is_slice_of(z, b.op(op, x, y))


@pytest.mark.parametrize("op", ["mul", "maximum", "add"])
def test_binary_slice_with_a_broadcast_bias(op):
    """x[:, 2:6] op bias[2:6] (broadcast over rows) is a slice of x op bias."""
    b = Build()
    x, bias = b.leaf("x", (3, 8)), b.leaf("bias", (8,))
    local = b.expand(b.view(b.sl(bias, 0, 2, 6), (1, 4)), (3, 4))
    y = b.op(op, b.sl(x, 1, 2, 6), local)
    b.check(y)
    whole = b.op(op, x, b.expand(b.view(bias, (1, 8)), (3, 8)))
    if op == "add":
        assert b.op_of(y) == "lin"
    else:
        assert b.is_slice_of(y, whole)


@pytest.mark.parametrize("op", ["mul", "maximum"])
def test_binary_with_cat(op):
    b = Build()
    x1, x2, y = b.leaf("x1", (3, 2)), b.leaf("x2", (3, 4)), b.leaf("y", (3, 6))
    z = b.op(op, b.cat([x1, x2], 1), y)
    b.check(z)
    assert b.op_of(z) == "cat"


def test_binary_of_two_broadcasts():
    b = Build()
    u, v = b.leaf("u", (4,)), b.leaf("v", (4,))
    bu = b.expand(b.view(u, (1, 4)), (3, 4))
    bv = b.expand(b.view(v, (1, 4)), (3, 4))
    z = b.op("maximum", bu, bv)
    b.check(z)
    assert b.op_of(z) == "bcast"


def test_where_with_a_broadcast_mask_over_a_slice():
    """Causal-style masking of a slice of the scores: a slice of the masked scores."""
    b = Build()
    scores = b.leaf("scores", (2, 4, 5, 5))
    mask_values = torch.rand((5, 5), generator=b.gen) > 0.5
    mask = b.leaf("mask", (5, 5), value=mask_values)
    local_scores = b.sl(scores, 1, 1, 3)
    big = b.scalar(-1e4, local_scores.shape)
    local_mask = b.expand(b.view(mask, (1, 1, 5, 5)), local_scores.shape)
    y = b.op("where", local_mask, big, local_scores)
    b.check(y)
    whole = b.op("where", b.expand(b.view(mask, (1, 1, 5, 5)), scores.shape), b.scalar(-1e4, scores.shape), scores)
    assert b.is_slice_of(y, whole)


def test_where_with_equal_branches():
    b = Build()
    x = b.leaf("x", (3, 3))
    mask = b.leaf("mask", (3, 3), value=torch.rand((3, 3), generator=b.gen) > 0.5)
    y = b.op("where", mask, x, x)
    b.check(y)
    assert y.term == x.term


def test_compare_and_logical_ops_commute_with_slices():
    b = Build()
    x, y = b.leaf("x", (4, 6)), b.leaf("y", (4, 6))
    lt = b.op("lt", b.sl(x, 1, 1, 4), b.sl(y, 1, 1, 4))
    ge = b.op("ge", b.sl(x, 1, 1, 4), b.sl(y, 1, 1, 4))
    z = b.op("logical_or", lt, b.op("logical_not", ge))
    b.check(z)
    assert b.op_of(z) == "slice"


def test_convert_between_floats_is_the_identity():
    b = Build()
    x = b.leaf("x", (2, 3))
    y = b.op("convert", x, attrs=("float32",))
    assert y.term == x.term
    torch.testing.assert_close(b.value_of(y), x.value.float(), check_dtype=False, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op", ["mul", "div", "maximum", "sqrt"])
def test_elementwise_of_views_is_a_view(op):
    """Elementwise ops on flattened parameters (an optimizer over a flat buffer) are the flattened
    elementwise op, also through sums of views and constants."""
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (3, 4))
    flat_x, flat_y = b.view(b.op("abs", x), (12,)), b.view(y, (12,))
    operand = b.add(b.op("mul", flat_y, b.scalar(0.5, (12,))), b.scalar(2.0, (12,)))
    z = b.op(op, flat_x) if op == "sqrt" else b.op(op, flat_x, operand)
    b.check(z)
    whole_operand = b.add(b.op("mul", y, b.scalar(0.5, (3, 4))), b.scalar(2.0, (3, 4)))
    whole = b.op(op, b.op("abs", x)) if op == "sqrt" else b.op(op, b.op("abs", x), whole_operand)
    assert b.view(z, (3, 4)).term == whole.term


def test_elementwise_of_views_of_other_shapes_is_kept():
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (2, 6))
    z = b.op("mul", b.view(x, (12,)), b.view(y, (12,)))
    b.check(z)
    assert b.op_of(z) == "mul"


@pytest.mark.parametrize("weight", [0.1, 0.5, -0.7])
def test_exact_ops_on_constants_fold_and_pick_a_branch(weight):
    """lerp's decomposition tests |weight| >= 0.5 on a constant weight: the test folds, where picks."""
    b = Build()
    x, y = b.leaf("x", (2, 3)), b.leaf("y", (2, 3))
    cond = b.op("ge", b.op("abs", b.scalar(weight, ())), b.scalar(0.5, ()))
    assert b.op_of(cond) == "full"
    z = b.op("where", b.expand(b.view(cond, (1, 1)), (2, 3)), x, b.op("exp", y))
    b.check(z)
    assert z.term == (x.term if abs(weight) >= 0.5 else b.op("exp", y).term)


def test_inexact_ops_on_constants_are_not_folded():
    b = Build()
    assert b.op_of(b.op("exp", b.scalar(0.1, ()))) == "exp"


@pytest.mark.parametrize("value, exact", [(0.0, True), (2.25, True), (2.0, False)])
def test_a_square_root_folds_where_it_squares_back(value, exact):
    """Adam on zero padding: sqrt(0) is 0, so the update 0 / (sqrt(0) + eps) is exactly 0."""
    b = Build()
    root = b.op("sqrt", b.scalar(value, (3,)))
    b.check(root)
    assert (b.op_of(root) == "full") == exact
    if value == 0:
        update = b.op("div", b.scalar(0.0, (3,)), b.add(root, b.scalar(1e-8, (3,))))
        b.check(update)
        assert b.op_of(update) == "full"


def test_elementwise_ops_of_reshapes_are_reshapes_of_the_op():
    """where(view(m), view(a) - c, 0) = view(where(m, a - c, 0)): flattening before or after meets."""
    b = Build()
    a, m = labels(b, "a", (2, 3), 9), b.leaf("m", (2, 3), value=torch.rand(2, 3, generator=b.gen) > 0.5)
    shifted = b.sub(b.view(a, (6,)), b.scalar(4, (6,), torch.int64))
    flat_first = b.op("where", b.view(m, (6,)), b.scalar(0, (6,), torch.int64), shifted)
    b.check(flat_first)
    op_first = b.view(b.op("where", m, b.scalar(0, (2, 3), torch.int64), b.sub(a, b.scalar(4, (2, 3), torch.int64))), (6,))
    assert flat_first.term == op_first.term
