"""Numeric tests of ops on blocks of rows (relations/rules/blocks.py): a rank's rows of every
operand give that rank's rows of the op on the wholes, where the op's law says each block is
computed from its own (DTensor's strategies for open ops; scatter along another dim); an operand
read whole, or a cut along the op's own dim, gives no such term. The harness is in test_rules.py."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from shardproof.ir.aten_ops import Operand
from test_rules import SETTINGS, Build, ranges
from test_rules_topk import top


@SETTINGS
@given(st.integers(2, 6), st.integers(2, 5), st.data())
def test_the_top_k_of_a_ranks_rows_is_those_rows_of_the_top_k(rows, experts, data):
    """A router's top-k experts of a rank's tokens are those tokens' rows of every token's (where
    the reference computed every token's scores)."""
    b = Build()
    scores = b.leaf("scores", (rows, experts))
    lo, hi = data.draw(ranges(rows))
    k = data.draw(st.integers(1, experts))
    whole = [top(b, scores, k, path) for path in ((0,), (1,))]
    b.r.reference_size = len(b.u)  # the reference's top k of every token
    for path, reference in zip(((0,), (1,)), whole):
        mine = top(b, b.sl(scores, 0, lo, hi), k, path)
        b.check(mine)
        if (lo, hi) != (0, rows):
            assert mine.term == b.sl(reference, 0, lo, hi).term


@SETTINGS
@given(st.integers(2, 6), st.integers(3, 6), st.data())
def test_a_scatter_of_a_ranks_rows_is_those_rows_of_the_scatter(rows, experts, data):
    """Gates scattered into zeros at the chosen experts, a rank's tokens: its rows of all tokens'."""
    b = Build()
    scores = b.leaf("scores", (rows, experts))
    lo, hi = data.draw(ranges(rows))
    k = data.draw(st.integers(1, experts))

    def dense(x):
        zeros = b.scalar(0.0, x.shape)
        return b.op("scatter", zeros, top(b, x, k, (1,)), top(b, x, k, (0,)), attrs=(1,))

    reference = dense(scores)
    b.r.reference_size = len(b.u)
    mine = dense(b.sl(scores, 0, lo, hi))
    b.check(mine)
    if (lo, hi) != (0, rows):
        assert mine.term == b.sl(reference, 0, lo, hi).term


def test_an_open_op_with_a_row_dim_sharded_by_dtensor_is_computed_by_rows():
    """`aten.cumsum` along the columns: DTensor keeps rows sharded, so a rank's rows are its rows of
    the whole; along the rows, each row depends on the rows before it: no law."""
    b = Build()
    x = b.leaf("x", (6, 4))
    along_columns = b.op("aten.cumsum.default", b.sl(x, 0, 2, 4), attrs=((Operand(0), 1), (), ()))
    b.check(along_columns)
    assert along_columns.term == b.sl(b.op("aten.cumsum.default", x, attrs=((Operand(0), 1), (), ())), 0, 2, 4).term
    along_rows = b.op("aten.cumsum.default", b.sl(x, 0, 2, 4), attrs=((Operand(0), 0), (), ()))
    b.check(along_rows)
    assert b.op_of(along_rows) == "aten.cumsum.default"


def test_a_scatter_cut_along_its_own_dim_is_no_block():
    """Columns of the index along the written dim write other columns: no block of the whole."""
    b = Build()
    index = b.leaf("index", (3, 4), torch.tensor([[0, 1, 2, 3]] * 3))
    values = b.leaf("values", (3, 4))
    out = b.op("scatter", b.scalar(0.0, (3, 4)), b.sl(index, 1, 0, 2), b.sl(values, 1, 0, 2), attrs=(1,))
    b.check(out)
    assert b.op_of(out) != "slice"


@SETTINGS
@given(st.integers(2, 6), st.integers(3, 6), st.sampled_from([2, 3, 1 / 4]), st.data())
def test_a_scaled_write_into_zeros_is_the_write_scaled(rows, experts, factor, data):
    """top-k's backward, zeros scattered with a rank's gradient of its own mean (a scale the
    average over ranks undoes later): c * the scatter of the unscaled values, so a rank's rows
    still meet the rows of the reference's scatter."""
    b = Build()
    scores = b.leaf("scores", (rows, experts))
    lo, hi = data.draw(ranges(rows))
    k = data.draw(st.integers(1, experts))
    grad = b.leaf("grad", (rows, k))  # of the top k values

    def backward(x, g):
        zeros = b.scalar(0.0, x.shape)
        return b.op("scatter", zeros, top(b, x, k, (1,)), g, attrs=(1,))

    whole = backward(scores, grad)
    b.r.reference_size = len(b.u)
    mine = backward(b.sl(scores, 0, lo, hi), b.op("mul", b.sl(grad, 0, lo, hi), b.scalar(factor, ())))
    b.check(mine)
    assert b.op_of(mine) == "lin"
    if (lo, hi) != (0, rows):
        assert b.u[mine.term].args[0] == b.sl(whole, 0, lo, hi).term
