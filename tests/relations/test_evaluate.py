"""Tests of `shardproof.relations.evaluate` itself: constants, integer sums and unsorted broadcasts."""

from __future__ import annotations

import math

import torch

from shardproof.relations.evaluate import evaluate
from test_rules import Build


def test_evaluate_constants():
    b = Build()
    ar = b.r.const(("arange", 2, 11, 3), (3,), "int64")
    torch.testing.assert_close(evaluate(b.u, ar, {}), torch.arange(2, 11, 3))
    vals = b.r.const(("values", (1.0, 2.0, 3.0, 4.0)), (2, 2), "float64")
    torch.testing.assert_close(evaluate(b.u, vals, {}), torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
    same = b.r.const(("values", (5, 5, 5)), (3,), "int64")
    assert b.u[same].op == "full"
    torch.testing.assert_close(evaluate(b.u, same, {}), torch.full((3,), 5))
    assert math.isclose(float(evaluate(b.u, b.r.const(("full", 2), (), "float64"), {})), 2.0)


def test_evaluate_integer_lin_and_unsorted_bcast():
    b = Build()
    ids = b.leaf("ids", (2, 3), value=torch.tensor([[0, 4, 7], [2, 9, 5]]))
    shifted = b.sub(ids, b.scalar(4, ids.shape, torch.int64))
    assert b.op_of(shifted) == "lin"
    got = b.value_of(shifted)
    assert got.dtype == torch.int64 and torch.equal(got, ids.value - 4)
    x = b.leaf("x", (3, 2))
    t = b.r.bcast(x.term, (2, 4, 3), (2, 0))  # base dim 0 -> out dim 2, base dim 1 -> out dim 0
    expected = x.value.t().reshape(2, 1, 3).expand(2, 4, 3)
    torch.testing.assert_close(evaluate(b.u, t, b.leaves), expected)
