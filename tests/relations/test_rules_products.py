"""Numeric tests of the product rules (`rules/products.py`): mul, div and matmul over slices,
concatenations, pieces and scaled operands.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_rules import SETTINGS, Build, V, cuts, ranges


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(2, 6), st.data())
def test_matmul_column_parallel(m, k, n, data):
    b = Build()
    x, w = b.leaf("x", (m, k)), b.leaf("w", (k, n))
    lo, hi = data.draw(ranges(n))
    y = b.op("matmul", x, b.sl(w, 1, lo, hi))
    b.check(y)
    full = b.op("matmul", x, w)
    assert y.term == full.term if (lo, hi) == (0, n) else b.is_slice_of(y, full)


@SETTINGS
@given(st.integers(2, 5), st.integers(1, 4), st.integers(1, 4), st.data())
def test_matmul_sliced_rows_of_the_left_operand(m, k, n, data):
    b = Build()
    x, w = b.leaf("x", (2, m, k)), b.leaf("w", (k, n))
    lo, hi = data.draw(ranges(m))
    y = b.op("matmul", b.sl(x, 1, lo, hi), w)
    b.check(y)
    if (lo, hi) != (0, m):
        assert b.is_slice_of(y, b.op("matmul", x, w))


def test_matmul_batched_heads_slice():
    """Per-head attention scores of a head range are that range of the full scores."""
    b = Build()
    q, k = b.leaf("q", (2, 4, 3, 5)), b.leaf("k", (2, 4, 3, 5))
    kt = b.permute(k, (0, 1, 3, 2))
    y = b.op("matmul", b.sl(q, 1, 1, 3), b.sl(kt, 1, 1, 3))
    b.check(y)
    assert b.is_slice_of(y, b.op("matmul", q, kt))


def test_matmul_of_a_cat_on_a_free_dim():
    b = Build()
    x, w1, w2 = b.leaf("x", (3, 4)), b.leaf("w1", (4, 2)), b.leaf("w2", (4, 5))
    y = b.op("matmul", x, b.cat([w1, w2], 1))
    b.check(y)
    term = b.u[y.term]
    assert term.op == "cat" and term.args == (b.op("matmul", x, w1).term, b.op("matmul", x, w2).term)


@SETTINGS
@given(st.integers(1, 3), st.integers(2, 8), st.integers(1, 3), st.data())
def test_matmul_over_a_cat_on_the_contracted_dim(m, k, n, data):
    """cat(a1, a2) @ cat(b1, b2), the parts cut at unrelated points, is the sum of matching parts."""
    b = Build()
    x, w = b.leaf("x", (m, k)), b.leaf("w", (k, n))
    a_points, b_points = data.draw(cuts(k)), data.draw(cuts(k))
    left = b.cat([b.sl(x, 1, lo, hi) for lo, hi in zip(a_points, a_points[1:])], 1)
    right = b.cat([b.sl(w, 0, lo, hi) for lo, hi in zip(b_points, b_points[1:])], 0)
    y = b.op("matmul", left, right)
    b.check(y)
    assert y.term == b.op("matmul", x, w).term


def test_matmul_over_cats_of_different_tensors():
    b = Build()
    g1, g2, w1, w2 = b.leaf("g1", (3, 2)), b.leaf("g2", (3, 4)), b.leaf("w1", (2, 5)), b.leaf("w2", (4, 5))
    y = b.op("matmul", b.cat([g1, g2], 1), b.cat([w1, w2], 0))
    b.check(y)
    assert y.term == b.add(b.op("matmul", g1, w1), b.op("matmul", g2, w2)).term


def test_product_with_a_scaled_factor_is_a_scaled_product():
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (3, 4))
    z = b.op("mul", b.op("mul", x, b.scalar(2.0, x.shape)), y)
    b.check(z)
    t = b.u[z.term]
    assert t.op == "lin" and t.args == (b.op("mul", x, y).term,) and t.attrs[0] == (Fraction(2),)


def test_matmul_by_a_scaled_operand():
    b = Build()
    x, w = b.leaf("x", (3, 4)), b.leaf("w", (4, 2))
    y = b.op("matmul", b.op("mul", x, b.scalar(0.5, x.shape)), w)
    b.check(y)
    t = b.u[y.term]
    assert t.op == "lin" and t.args == (b.op("matmul", x, w).term,) and t.attrs[0] == (Fraction(1, 2),)


@SETTINGS
@given(st.integers(1, 3), st.integers(2, 8), st.integers(1, 3), st.data())
def test_matmul_row_parallel_sums_to_the_full_matmul(m, k, n, data):
    b = Build()
    x, w = b.leaf("x", (2, m, k)), b.leaf("w", (k, n))
    points = data.draw(cuts(k))
    partials = [b.op("matmul", b.sl(x, 2, lo, hi), b.sl(w, 0, lo, hi)) for lo, hi in zip(points, points[1:])]
    if len(partials) > 1:
        assert all(b.op_of(p) == "piece" for p in partials)
        with pytest.raises(NotImplementedError):
            b.value_of(partials[0])
    total = b.add(*partials)
    full = b.op("matmul", x, w)
    assert total.term == full.term
    b.check(total)
    torch.testing.assert_close(b.value_of(total), full.value)


def test_matmul_row_parallel_partial_ranks_stay_a_piece():
    """Only ranges tiling the whole contraction add up to the matmul."""
    b = Build()
    x, w = b.leaf("x", (3, 6)), b.leaf("w", (6, 2))
    parts = [b.op("matmul", b.sl(x, 1, lo, lo + 2), b.sl(w, 0, lo, lo + 2)) for lo in (0, 2, 4)]
    two = b.add(parts[0], parts[1])
    t = b.u[two.term]
    assert t.op == "piece" and t.attrs[1:] == (0, 4, 6)
    gapped = b.add(parts[0], parts[2])
    assert b.op_of(gapped) == "lin"
    total = b.add(two, parts[2])
    assert total.term == b.op("matmul", x, w).term


def test_partial_sums_times_a_tensor_sum_to_the_product():
    """mul distributes over a piece: sum_r (x_r @ w_r) * g == (x @ w) * g for a non-constant g."""
    b = Build()
    x, w, g = b.leaf("x", (3, 6)), b.leaf("w", (6, 2)), b.leaf("g", (2,))
    wide_g = b.expand(b.view(g, (1, 2)), (3, 2))
    partials = [b.op("mul", b.op("matmul", b.sl(x, 1, lo, lo + 3), b.sl(w, 0, lo, lo + 3)), wide_g) for lo in (0, 3)]
    assert all(b.op_of(p) == "piece" for p in partials)
    total = b.add(*partials)
    assert total.term == b.op("mul", b.op("matmul", x, w), wide_g).term
    b.check(total)


@SETTINGS
@given(st.integers(2, 8), st.data())
def test_mlp_megatron_column_then_row(ffn, data):
    """relu(x @ w1[:, r]) @ w2[r, :] summed over ranks is the reference MLP."""
    b = Build()
    x, w1, w2 = b.leaf("x", (2, 3, 4)), b.leaf("w1", (4, ffn)), b.leaf("w2", (ffn, 4))
    points = data.draw(cuts(ffn))
    partials = [
        b.op("matmul", b.op("relu", b.op("matmul", x, b.sl(w1, 1, lo, hi))), b.sl(w2, 0, lo, hi))
        for lo, hi in zip(points, points[1:])
    ]
    total = b.add(*partials)
    reference = b.op("matmul", b.op("relu", b.op("matmul", x, w1)), w2)
    assert total.term == reference.term
    b.check(total)


@pytest.mark.parametrize("op", ["mul", "matmul", "div"])
def test_scales_move_out_of_products(op):
    """c*x (op) y is c * (x (op) y); for div also x / (c*y) = (1/c) * (x / y)."""
    b = Build()
    x, y, z = (b.leaf(n, (3, 3)) for n in "xyz")
    positive = b.op("exp", z)

    def third(t: V) -> V:
        return b.op("mul", t, b.scalar(1 / 3, (3, 3)))

    scaled = b.op(op, third(b.sub(x, b.add(y, y))), positive)
    b.check(scaled)
    assert scaled.term == third(b.op(op, b.sub(x, b.add(y, y)), positive)).term
    if op == "div":
        inverse = b.op(op, x, b.op("mul", positive, b.scalar(4.0, (3, 3))))
        b.check(inverse)
        assert inverse.term == b.op("mul", b.op(op, x, positive), b.scalar(0.25, (3, 3))).term


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_data_parallel_mean_of_shard_gradients_is_the_gradient(ranks):
    """Each rank's gradient is a mean over its batch shard; their mean over ranks is the
    reference's mean over the whole batch, though every rank's coefficients are `ranks` times larger."""
    b = Build()
    out, target, h = b.leaf("out", (8, 3)), b.leaf("target", (8, 3)), b.leaf("h", (8, 5))

    def grad(rows: int, o: V, t: V, a: V) -> V:
        residual = b.op("mul", b.sub(o, t), b.scalar(2 / (rows * 3), (rows, 3)))
        return b.op("matmul", b.permute(residual, (1, 0)), a)

    shard = 8 // ranks
    local = [grad(shard, *(b.sl(v, 0, r * shard, (r + 1) * shard) for v in (out, target, h))) for r in range(ranks)]
    mean = b.op("mul", b.add(*local), b.scalar(1 / ranks, (3, 5)))
    b.check(mean)
    assert mean.term == grad(8, out, target, h).term


def test_products_with_float_masks_and_constant_conditions():
    b = Build()
    x, m = b.leaf("x", (3, 4)), b.leaf("m", (3, 4), value=torch.rand(3, 4, generator=b.gen) > 0.5)
    masked = b.op("mul", x, b.op("convert", m, attrs=("float64",)))
    b.check(masked)
    assert masked.term == b.op("where", m, x, b.scalar(0.0, x.shape)).term
    yes = b.scalar(True, x.shape, torch.bool)
    assert b.op("where", yes, x, b.scalar(0.0, x.shape)).term == x.term
    folded = b.op("convert", b.op("logical_not", yes), attrs=("float64",))
    b.check(folded)
    assert b.u[folded.term].op == "full" and b.u[folded.term].attrs == (0.0,)


def test_products_order_their_operands_and_pull_out_scales():
    b = Build()
    x, y = b.leaf("x", (3, 4)), b.leaf("y", (3, 4))
    assert b.op("mul", x, y).term == b.op("mul", y, x).term
    scaled = b.op("mul", b.op("neg", x), y)
    b.check(scaled)
    assert scaled.term == b.op("neg", b.op("mul", x, y)).term


def test_matmul_of_permuted_rows_is_the_permuted_matmul():
    b = Build()
    x, w = b.leaf("x", (3, 2, 4)), b.leaf("w", (4, 5))
    y = b.op("matmul", b.permute(x, (1, 0, 2)), w)
    b.check(y)
    term = b.u[y.term]
    assert term.op == "permute" and b.u[term.args[0]].op == "matmul"


@pytest.mark.parametrize("batch", [1, 2])
def test_weight_gradient_of_fused_parts_meets_the_loaders_row_blocks(batch):
    """A rank's fused q/k/v output gradient, its own columns of each part, flattened over batch and
    sequence for the weight gradient: the product splits by the parts, also for a batch of one,
    whose flattening only drops the batch dim and so stays a view of the cat. It meets the rows
    the loader cuts from the reference's weight gradient of the whole parts."""
    b = Build()
    seq, hidden = 3, 5
    q, k, v = (b.leaf(name, (batch, seq, 4)) for name in "qkv")
    x = b.leaf("x", (batch * seq, hidden))

    def weight_gradient(parts: list[V]) -> V:
        flat = b.view(b.cat(parts, 2), (batch * seq, sum(p.shape[2] for p in parts)))
        return b.op("matmul", b.permute(flat, (1, 0)), x)

    whole = weight_gradient([q, k, v])
    rank = weight_gradient([b.sl(q, 2, 0, 2), b.sl(k, 2, 0, 2), b.sl(v, 2, 0, 2)])
    loaded = b.cat([b.sl(whole, 0, lo, lo + 2) for lo in (0, 4, 8)], 0)
    b.check(rank)
    b.check(loaded)
    assert rank.term == loaded.term


def test_input_gradient_of_a_batch_of_one_sums_over_the_fused_parts():
    """The batch-of-one gradient of cat(gate, up), flattened, times the fused weight is the sum of
    each part's product with its rows of the weight, as for a larger batch."""
    b = Build()
    gate, up, w = b.leaf("gate", (1, 3, 2)), b.leaf("up", (1, 3, 4)), b.leaf("w", (6, 5))
    y = b.op("matmul", b.view(b.cat([gate, up], 2), (3, 6)), w)
    b.check(y)
    parts = [b.op("matmul", b.view(gate, (3, 2)), b.sl(w, 0, 0, 2)), b.op("matmul", b.view(up, (3, 4)), b.sl(w, 0, 2, 6))]
    assert y.term == b.add(*parts).term


@pytest.mark.parametrize("zero_side", [0, 1])
def test_a_matmul_with_a_zero_operand_is_zero(zero_side: int) -> None:
    """Over any other operand, sliced or whole: the padding of a sliced gradient (`logits[:, :-1]`)
    times each rank's weight shard sums to the padding times the whole weight."""
    b = Build()
    zeros, w = b.scalar(0.0, (2, 3, 4)), b.leaf("w", (4, 5))
    operands = [zeros, w] if zero_side == 0 else [b.leaf("x", (5, 2)), b.scalar(0.0, (2, 3))]
    y = b.op("matmul", *operands)
    b.check(y)
    assert b.r.full_value(y.term) == 0
    if zero_side == 0:
        shards = [b.op("matmul", b.sl(zeros, 2, lo, lo + 2), b.sl(w, 0, lo, lo + 2)) for lo in (0, 2)]
        assert b.op("add", *shards).term == y.term


def test_matmul_over_a_broadcast_cat_on_the_contracted_dim():
    """A fused gate/up gradient broadcast over the experts of a grouped product splits the product
    like a cat: bcast(cat(g, u)) @ w == bcast(g) @ w[:, :k] + bcast(u) @ w[:, k:]."""
    b = Build()
    g, u, w = b.leaf("g", (3, 2)), b.leaf("u", (3, 4)), b.leaf("w", (5, 6, 7))
    y = b.op("matmul", over_experts(b, b.cat([g, u], 1), 5), w)
    b.check(y)
    parts = [b.op("matmul", over_experts(b, g, 5), b.sl(w, 1, 0, 2)), b.op("matmul", over_experts(b, u, 5), b.sl(w, 1, 2, 6))]
    assert y.term == b.add(*parts).term


def test_packed_shards_of_a_fused_gradient_sum_to_the_product():
    """Each rank contracts its columns of both halves of a fused gate/up gradient with its rows of
    the fused weight (a packed column-parallel weight): one partial sum per rank, summing to the
    reference's product."""
    b = Build()
    g, u, w = b.leaf("g", (3, 4)), b.leaf("u", (3, 4)), b.leaf("w", (2, 8, 5))
    grad = over_experts(b, b.cat([g, u], 1), 2)
    full = b.op("matmul", grad, w)
    b.r.reference_size = len(b.u)  # the ranks' terms come after the reference's, as in a proof
    shares = []
    for lo, hi in ((0, 2), (2, 4)):
        local = over_experts(b, b.cat([b.sl(g, 1, lo, hi), b.sl(u, 1, lo, hi)], 1), 2)
        rows = b.cat([b.sl(w, 1, lo, hi), b.sl(w, 1, 4 + lo, 4 + hi)], 1)
        shares.append(b.op("matmul", local, rows))
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    b.check(total)
    assert total.term == full.term


def over_experts(b: Build, x: V, experts: int) -> V:
    """`x` broadcast over a leading experts dim, as `torch.expand` adds one (a view, then an expand)."""
    return b.expand(b.view(x, (1, *x.shape)), (experts, *x.shape))


def test_matmul_with_a_matrix_broadcast_over_the_batch_is_the_product_with_the_matrix():
    """einsum runs x @ w as a bmm with w broadcast over a batch of one: the same product."""
    b = Build()
    x, w = b.leaf("x", (1, 6, 4)), b.leaf("w", (4, 3))
    y = b.op("matmul", x, over_experts(b, w, 1))
    b.check(y)
    assert y.term == b.op("matmul", x, w).term


@pytest.mark.parametrize("batch", [(1,), (3,), (1, 2)])
def test_a_matrix_broadcast_over_a_batch_times_a_matrix_is_the_product_broadcast(batch):
    """einsum's bmm over a batch of one, a weight gradient's rows given a size-1 batch: the batch
    copies of one product, the broadcast outside it."""
    b = Build()
    x, w = b.leaf("x", (6, 4)), b.leaf("w", (4, 3))
    y = b.op("matmul", b.expand(b.view(x, (1,) * len(batch) + x.shape), batch + x.shape), w)
    b.check(y)
    assert b.op_of(y) == "bcast" and b.u[y.term].args[0] == b.op("matmul", x, w).term


def test_a_batch_of_ones_contraction_over_flattened_rows_is_the_sum_of_the_per_batch_contractions():
    """einsum's weight gradient: a bmm over a batch of one of g's transposed flattened rows and x's,
    the matrices' contraction (the sum over the batch of g[i].T @ x[i]) with its batch of one."""
    b = Build()
    g, x = b.leaf("g", (2, 6, 3)), b.leaf("x", (2, 6, 4))
    rows = b.permute(b.view(g, (1, 12, 3)), (0, 2, 1))
    y = b.op("matmul", rows, b.view(x, (1, 12, 4)))
    b.check(y)
    flat = b.op("matmul", b.permute(b.view(g, (12, 3)), (1, 0)), b.view(x, (12, 4)))
    assert b.op_of(flat) == "sum" and b.u[y.term].args[0] == flat.term


@SETTINGS
@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_a_transposed_matrix_product_is_the_product_of_the_transposes(m, k, n):
    """(A @ B)^T = B^T @ A^T for matrices too: einsum's weight gradient is a bmm transposed back."""
    b = Build()
    x, w = b.leaf("x", (m, k)), b.leaf("w", (k, n))
    y = b.permute(b.op("matmul", x, w), (1, 0))
    b.check(y)
    assert y.term == b.op("matmul", b.permute(w, (1, 0)), b.permute(x, (1, 0))).term


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.booleans(), st.booleans())
def test_a_product_with_a_reciprocal_is_a_division(rows, cols, broadcast, first):
    """x * (1/y) and (1/y) * x, y perhaps broadcast along the columns, are x / y: the softmax
    gradient XLA divides on one side and multiplies by the reciprocal on the other."""
    b = Build()
    x = b.leaf("x", (rows, cols))
    y = b.leaf("y", (rows, 1) if broadcast else (rows, cols))
    one = b.scalar(1.0, y.shape)
    reciprocal = b.op("div", one, y)
    if broadcast:
        reciprocal = b.expand(reciprocal, (rows, cols))
    product = b.op("mul", reciprocal, x) if first else b.op("mul", x, reciprocal)
    b.check(product)
    divisor = b.expand(y, (rows, cols)) if broadcast else y
    assert product.term == b.op("div", x, divisor).term


@SETTINGS
@given(st.integers(2, 5), st.integers(1, 4), st.integers(2, 6), st.data())
def test_matmul_of_sliced_rows_and_a_slice_of_the_contracted_dim(m, k, n, data):
    """A microbatch's rows of one gradient times a slice of a fused weight's rows (its gate half):
    A[rows] @ W[:k] = (A @ W[:k])[rows], though the two slices are of different tensors and dims."""
    b = Build()
    a, w = b.leaf("a", (2, m, k)), b.leaf("w", (k + n, 3))
    lo, hi = data.draw(ranges(m))
    y = b.op("matmul", b.sl(a, 1, lo, hi), b.sl(w, 0, 0, k))
    b.check(y)
    if (lo, hi) != (0, m):
        assert b.is_slice_of(y, b.op("matmul", a, b.sl(w, 0, 0, k)))


def test_a_contraction_over_flattened_rows_is_the_sum_of_the_per_batch_contractions():
    """A weight gradient of batch-first activations, g.view(n*s, k).T @ x.view(n*s, h), is the sum
    over the batch of g[i].T @ x[i]; each rank's sequence shard x[:, s0:s1] is then one range of
    every per-batch contraction, and the ranks' products sum to the reference's."""
    b = Build()
    g, x = b.leaf("g", (2, 6, 3)), b.leaf("x", (2, 6, 4))

    def flat_product(gs: V, xs: V) -> V:
        rows = gs.shape[0] * gs.shape[1]
        return b.op("matmul", b.permute(b.view(gs, (rows, 3)), (1, 0)), b.view(xs, (rows, 4)))

    full = flat_product(g, x)
    b.check(full)
    assert b.op_of(full) == "sum"
    b.r.reference_size = len(b.u)
    shares = [flat_product(b.sl(g, 1, lo, hi), b.sl(x, 1, lo, hi)) for lo, hi in ((0, 2), (2, 6))]
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    assert total.term == full.term
    b.check(total)


def test_a_flattened_contraction_sees_through_a_sum_with_a_broadcast_bias():
    """The bias of the loss gradient is broadcast over the rows: still one reshape of the rows."""
    b = Build()
    g, x, bias = b.leaf("g", (2, 3, 5)), b.leaf("x", (2, 3, 4)), b.leaf("bias", (5,))
    grad = b.add(b.view(g, (6, 5)), b.expand(b.view(bias, (1, 5)), (6, 5)))
    whole = b.op("matmul", b.permute(grad, (1, 0)), b.view(x, (6, 4)))
    assert b.op_of(whole) == "sum"  # the per-batch contractions, summed
    y = b.op("matmul", b.permute(grad, (1, 0)), b.sl(b.view(x, (6, 4)), 1, 1, 3))
    b.check(y)
    assert b.is_slice_of(y, whole)  # a column range of it


def test_a_free_slice_leaves_a_product_whose_contractions_do_not_line_up():
    """A rank's vocab columns of a gradient (rows of a's transpose) times a range of the other
    operand's rows that is no range of the first's contraction: the row slice still moves out."""
    b = Build()
    g, h = b.leaf("g", (2, 6, 3)), b.leaf("h", (2, 4, 5))
    full = b.op("matmul", g, b.sl(h, 1, 0, 3))
    y = b.op("matmul", b.sl(g, 1, 2, 5), b.sl(h, 1, 0, 3))
    b.check(y)
    assert b.is_slice_of(y, full)


@pytest.mark.parametrize("batch", [1, 2])
def test_shards_of_flattened_rows_starting_at_zero_stay_shares(batch):
    """A rank's first shard of the sequence, x[:, 0:s1], flattened: a slice from 0 that cuts a dim
    other than the last is no reshape of the rows (its extent equals the slice's own size, not the
    whole dim's), so the product is a share of the reference's, and the shares sum to it."""
    b = Build()
    g, x = b.leaf("g", (batch, 8, 3)), b.leaf("x", (batch, 8, 4))

    def flat_product(gs: V, xs: V) -> V:
        rows = gs.shape[0] * gs.shape[1]
        return b.op("matmul", b.permute(b.view(gs, (rows, 3)), (1, 0)), b.view(xs, (rows, 4)))

    full = flat_product(g, x)
    b.r.reference_size = len(b.u)
    shares = [flat_product(b.sl(g, 1, lo, hi), b.sl(x, 1, lo, hi)) for lo, hi in ((0, 4), (4, 8))]
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    assert total.term == full.term
    b.check(total)


@pytest.mark.parametrize("h0, h1", [(0, 2), (2, 4), (1, 3)])
def test_heads_of_a_rotary_query_half_times_the_shared_key_are_heads_of_the_product(h0, h1):
    """MLA's rotary part under TP: a rank's heads of rotate-half's first half of the queries,
    lin(Q[:, h, :, :2], -Q[:, h, :, 2:]), times the one rotary key broadcast to those heads, is
    those heads of the reference's product over all heads (the key, itself half of the rotary
    key's rows, lifted to them as it is)."""
    b = Build()
    q, key = b.leaf("q", (2, 4, 3, 4)), b.sl(b.leaf("key", (2, 1, 4, 3)), 2, 0, 2)
    half = b.sub(b.sl(q, 3, 0, 2), b.sl(q, 3, 2, 4))
    whole = b.op("matmul", half, b.expand(key, (2, 4, 2, 3)))
    b.r.reference_size = len(b.u)
    mine = b.sl(q, 1, h0, h1)
    y = b.op("matmul", b.sub(b.sl(mine, 3, 0, 2), b.sl(mine, 3, 2, 4)), b.expand(key, (2, h1 - h0, 2, 3)))
    b.check(y)
    assert b.is_slice_of(y, whole)
