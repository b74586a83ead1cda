"""Numeric tests of the view constructor (`rules/views.py`): reshapes of slices, concatenations,
broadcasts, permutes and matmuls.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardproof.relations.evaluate import evaluate
from test_rules import V, SETTINGS, Build, ranges


# --- view ------------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.data())
def test_view_of_slice_splits_a_group(rows, heads, head_dim, data):
    """X(rows, heads*d)[:, h0*d:h1*d] viewed (rows, h1-h0, d) is view(X, (rows, heads, d))[:, h0:h1]."""
    b = Build()
    x = b.leaf("x", (rows, heads * head_dim))
    h0, h1 = data.draw(ranges(heads))
    y = b.view(b.sl(x, 1, h0 * head_dim, h1 * head_dim), (rows, h1 - h0, head_dim))
    b.check(y)
    if (h0, h1) != (0, heads) and h1 - h0 > 1 and head_dim > 1:
        whole = b.view(x, (rows, heads, head_dim))
        assert b.is_slice_of(y, whole)


@SETTINGS
@given(st.integers(2, 4), st.integers(1, 3), st.integers(1, 3), st.data())
def test_view_of_slice_merges_a_group(a, m, n, data):
    """X(a, m, n)[a0:a1] flattened is the [a0*m*n : a1*m*n) range of X flattened."""
    b = Build()
    x = b.leaf("x", (a, m, n))
    a0, a1 = data.draw(ranges(a))
    s = b.sl(x, 0, a0, a1)
    flat = b.view(s, ((a1 - a0) * m * n,))
    rows = b.view(s, ((a1 - a0) * m, n))
    for y in (flat, rows):
        b.check(y)
    if (a0, a1) != (0, a):
        assert b.is_slice_of(flat, b.view(x, (a * m * n,)))
        assert b.is_slice_of(rows, b.view(x, (a * m, n)))


def test_view_of_slice_head_split_follows_the_reference():
    """`(s, 4) -> (s, 1, 4)` of columns [36:40) is head 9 of `(s, 12, 4)` when the reference
    split heads that way, and stays a column range of `(s, 1, 48)` otherwise."""
    seq = 3
    b = Build()
    x = b.leaf("x", (seq, 48))
    heads = b.view(x, (seq, 12, 4))
    b.r.reference_size = len(b.u)
    y = b.view(b.sl(x, 1, 36, 40), (seq, 1, 4))
    b.check(y)
    assert b.is_slice_of(y, heads) and b.u[y.term].attrs[0] == ((0, seq), (9, 10), (0, 4))

    plain = Build()
    x = plain.leaf("x", (seq, 48))
    y = plain.view(plain.sl(x, 1, 36, 40), (seq, 1, 4))
    plain.check(y)
    assert not plain.is_slice_of(y, plain.view(x, (seq, 12, 4)))


def test_a_column_of_a_grid_dropped_by_a_view_keeps_the_other_slices_outside():
    """`x[..., ::2]` is column 0 of the last dim viewed as a (d/2, 2) grid, the column's one-wide
    dim then dropped. A rank's heads of that are the reference's strided slice, cut to its heads:
    the column (which no box of a view can express) is held as a tensor of its own, the heads
    box is a box of its view."""
    b = Build()
    q = b.leaf("q", (2, 4, 6, 4))

    def even_columns(x: V) -> V:
        grid = b.view(x, x.shape[:3] + (2, 2))
        return b.view(b.sl(grid, 4, 0, 1), x.shape[:3] + (2,))

    whole = even_columns(q)
    b.r.reference_size = len(b.u)
    heads = even_columns(b.sl(q, 1, 0, 2))
    b.check(heads)
    assert b.is_slice_of(heads, whole) and b.u[heads.term].attrs[0] == ((0, 2), (0, 2), (0, 6), (0, 2))


@pytest.mark.parametrize("heads", [2, 4])
def test_one_head_of_a_fused_projection_flattened_is_a_column_range_of_the_references(heads):
    """v is columns [2d:3d) of each head's fused (q, k, v) block; the reference flattens all heads'
    v, (s, heads, d) -> (s, heads*d). A rank's one head flattens (s, 1, d) -> (s, d): a dropped
    size-1 dim, yet the rank's columns [h*d:(h+1)*d) of the reference's."""
    seq, d = 3, 2
    b = Build()
    fused = b.leaf("fused", (seq, heads, 3 * d))
    reference = b.view(b.sl(fused, 2, 2 * d, 3 * d), (seq, heads * d))
    b.r.reference_size = len(b.u)
    for h in range(heads):
        y = b.view(b.box(fused, ((0, seq), (h, h + 1), (2 * d, 3 * d))), (seq, d))
        b.check(y)
        assert y.term == b.sl(reference, 1, h * d, (h + 1) * d).term


def test_a_batch_row_dropped_before_a_head_range_is_held_apart():
    """A data-parallel rank's batch row with its tensor-parallel heads, the batch of one dropped
    (XLA's bitcast (1, 2, 4, 8) -> (2, 4, 8)): where the reference never slices the heads alone,
    the row is held apart and the heads are a range of its view, not of the batch merged with
    the heads; where it does (fused qkv's v columns), those stay the tensor held apart."""
    b = Build()
    x = b.leaf("x", (2, 4, 4, 8))
    b.r.reference_size = len(b.u)
    y = b.view(b.box(x, ((0, 1), (0, 2), (0, 4), (0, 8))), (2, 4, 8))
    b.check(y)
    assert y.term == b.sl(b.view(b.sl(x, 0, 0, 1), (4, 4, 8)), 0, 0, 2).term


def test_a_flat_buffers_row_read_back_in_its_tensors_shape_is_the_tensors_rows():
    """FSDP2 over TP: a rank's TP shard X[:, 0:8] of the reference's weight, flattened into a buffer
    of one row per data-parallel rank, (8, 8) -> (2, 32); the row a reduce-scatter leaves it, read
    back as (4, 8), is X[0:4, 0:8]. The reshape undoes the buffer's (no flattening is made, so no row
    is held apart as a selected head would be)."""
    b = Build()
    x = b.leaf("x", (8, 16))
    b.r.reference_size = len(b.u)
    flat = b.view(b.sl(x, 1, 0, 8), (2, 32))
    for row in range(2):
        y = b.view(b.sl(flat, 0, row, row + 1), (4, 8))
        b.check(y)
        assert y.term == b.box(x, ((4 * row, 4 * row + 4), (0, 8))).term


def test_a_head_of_a_permute_flattened_is_held_apart_though_its_view_normalizes_to_a_permute():
    """Megatron's one head per rank in training: a rank's head of (b, heads, s, d), a permute of the
    reference's (s, b, heads, d), read as (b, s, d). The view of the permute it would be a range of,
    (b, heads * s, d), normalizes to a permute of a view: no tensor the flattening came from, so
    the flattening is new and the head is held apart (a reshape back to a flat buffer's own tensor
    is not, above)."""
    b = Build()
    q = b.view(b.leaf("x", (16, 2, 32)), (16, 2, 8, 4))
    b.permute(b.view(q, (16, 16, 4)), (1, 0, 2))  # the reference's heads merged with the batch
    b.r.reference_size = len(b.u)
    heads = b.permute(q, (1, 2, 0, 3))
    for h in range(2):
        one = b.sl(heads, 1, h, h + 1)
        y = b.view(one, (2, 16, 4))
        b.check(y)
        assert b.op_of(y) == "view" and b.u[y.term].args == (one.term,)


def test_one_head_of_a_batch_of_one_follows_the_reference():
    """A rank's one head of a batch of one, flattened for a batched matmul, (1, 1, s, d) ->
    (1, s, d), is that head of the reference's (heads, s, d); the scores back, (1, s, s) ->
    (1, 1, s, s), are that head of the reference's (1, heads, s, s)."""
    b = Build()
    q, scores = b.leaf("q", (1, 6, 4, 3)), b.leaf("scores", (6, 4, 4))
    per_head, batched = b.view(q, (6, 4, 3)), b.view(scores, (1, 6, 4, 4))
    b.r.reference_size = len(b.u)
    y = b.view(b.sl(q, 1, 2, 3), (1, 4, 3))
    b.check(y)
    assert y.term == b.sl(per_head, 0, 2, 3).term
    z = b.view(b.sl(scores, 0, 2, 3), (1, 1, 4, 4))
    b.check(z)
    assert z.term == b.sl(batched, 1, 2, 3).term


@pytest.mark.parametrize("head", [0, 2])
def test_one_head_merged_with_the_batch_meets_the_references_heads(head):
    """Megatron's attention, sequence first: the reference merges (s, b, heads, d) -> (s, b*heads, d)
    for its batched products and splits the scores back to (b, heads, s, s); a rank with one head
    merges (s, b, 1, d) -> (s, b, d), dropping the head. Held apart (not a column range of a
    flattening the reference never makes), the head comes back where the scores add the size-1
    dim again: the rank's scores are the reference's head, and so is the scores' gradient
    returned to (s, b, 1, d) through a permute of a product."""
    s, batch, heads, d = 4, 2, 3, 2
    b = Build()
    q, k = b.leaf("q", (s, batch, heads, d)), b.leaf("k", (s, batch, heads, d))

    def scores(q: V, k: V, n: int) -> V:
        rows = b.permute(b.view(q, (s, batch * n, d)), (1, 0, 2))
        cols = b.permute(b.view(k, (s, batch * n, d)), (1, 2, 0))
        return b.view(b.op("matmul", rows, cols), (batch, n, s, s))

    reference = scores(q, k, heads)
    b.r.reference_size = len(b.u)
    q_h, k_h = b.sl(q, 2, head, head + 1), b.sl(k, 2, head, head + 1)
    mine = scores(q_h, k_h, 1)
    b.check(mine)
    assert mine.term == b.sl(reference, 1, head, head + 1).term
    grad = b.permute(b.op("matmul", b.view(mine, (batch, s, s)), b.permute(b.view(k_h, (s, batch, d)), (1, 0, 2))), (1, 0, 2))
    back = b.view(grad, (s, batch, 1, d))  # the gradient of q_h
    b.check(back)
    assert b.op_of(back) == "slice" and "bcast" not in b.ops_in(back)


@SETTINGS
@given(st.integers(1, 4), st.integers(2, 3), st.integers(1, 3))
def test_view_splitting_a_cat_dim_is_a_cat_of_views(ranks, rows, cols):
    """Ranks' (rows, cols) blocks stacked flat along dim 0 and viewed (ranks, rows, cols) are the
    blocks each viewed (1, rows, cols), joined along dim 0."""
    b = Build()
    parts = [b.leaf(f"p{i}", (rows, cols)) for i in range(ranks)]
    y = b.view(b.cat(parts, 0), (ranks, rows, cols))
    b.check(y)
    if ranks > 1:
        assert b.op_of(y) == "cat" and b.u[y.term].attrs[0] == 0


def test_view_splitting_a_cat_dim_across_parts_stays_a_view():
    """Parts of 2 and 1 outer rows: a view of the cat (a rank's [q | k | v] read per group)."""
    b = Build()
    y = b.view(b.cat([b.leaf("q", (4, 3)), b.leaf("k", (2, 3))], 0), (3, 2, 3))
    b.check(y)
    assert b.op_of(y) == "view"


def test_view_of_a_broadcast_drops_its_kept_size_one_dims():
    """One head's attention output of a batch of one, (1, s, 1, d) -> (1, s, d), broadcasts its
    base with the size-1 head dim dropped: the head's columns of the reference's (1, s, heads*d)."""
    b = Build()
    out = b.permute(b.leaf("out", (6, 4, 3)), (1, 0, 2))  # (s, heads, d)
    merged = b.view(b.view(out, (1, 4, 6, 3)), (1, 4, 18))
    head = b.view(b.view(b.sl(out, 1, 2, 3), (1, 4, 1, 3)), (1, 4, 3))
    b.check(head)
    assert b.op_of(head) == "bcast" and head.term == b.sl(merged, 2, 6, 9).term


def test_view_of_a_broadcast_bias():
    """bias (8,) -> (1, 8) -> expand (6, 8) -> view (2, 3, 8): still the bias broadcast."""
    b = Build()
    bias = b.leaf("bias", (8,))
    y = b.view(b.expand(b.view(bias, (1, 8)), (6, 8)), (2, 3, 8))
    b.check(y)
    term = b.u[y.term]
    assert term.op == "bcast" and term.args[0] == bias.term and term.attrs[0] == (2,)


def test_view_of_a_broadcast_then_add():
    b = Build()
    bias, x = b.leaf("bias", (8,)), b.leaf("x", (2, 3, 8))
    y = b.op("add", x, b.view(b.expand(b.view(bias, (1, 8)), (6, 8)), (2, 3, 8)))
    b.check(y)


def test_view_inserting_ones_is_a_broadcast():
    b = Build()
    x = b.leaf("x", (3, 4))
    y = b.view(x, (1, 3, 1, 4, 1))
    b.check(y)
    assert b.op_of(y) == "bcast"
    back = b.view(y, (3, 4))
    b.check(back)
    assert back.term == x.term


# --- permutes of activations: seq-major layouts meet batch-major ones ------------------------------
@pytest.mark.parametrize(
    ("shape", "perm", "target"),
    [
        ((2, 3, 4, 5), (0, 2, 1, 3), (2, 4, 15)),  # transpose(1, 2) then merge heads: the reference's layout
        ((2, 3, 4, 5), (2, 0, 1, 3), (4, 2, 15)),  # (seq, batch, heads*dim) from (batch, heads, seq, dim)
        ((2, 3, 4, 5), (2, 0, 1, 3), (8, 15)),  # (seq*batch, heads*dim)
        ((2, 3, 4), (1, 0, 2), (3, 2, 2, 2)),  # split the last dim of a transposed tensor
    ],
)
def test_view_of_a_permute_is_a_permute_of_a_view(shape, perm, target):
    b = Build()
    x = b.leaf("x", shape)
    y = b.view(b.permute(x, perm), target)
    b.check(y)


def test_seq_major_and_batch_major_head_merges_meet():
    """(seq, batch, h*d) from a transposed attention output is a transpose of (batch, seq, h*d)."""
    b = Build()
    a, w = b.leaf("a", (2, 3, 4, 5)), b.leaf("w", (15, 6))
    batch_major = b.op("matmul", b.view(b.permute(a, (0, 2, 1, 3)), (2, 4, 15)), w)
    seq_major = b.op("matmul", b.view(b.permute(a, (2, 0, 1, 3)), (8, 15)), w)
    back = b.permute(b.view(seq_major, (4, 2, 6)), (1, 0, 2))
    b.check(batch_major)
    b.check(back)
    assert back.term == batch_major.term


def test_view_of_a_two_dim_matmul_splits_its_rows():
    b = Build()
    x, w = b.leaf("x", (6, 4)), b.leaf("w", (4, 5))
    y = b.view(b.op("matmul", x, w), (2, 3, 5))
    b.check(y)
    assert b.op_of(y) == "matmul"


def test_view_of_cat_keeping_the_cat_dim_is_a_cat_of_views():
    b = Build()
    x, y = b.leaf("x", (2, 3, 4)), b.leaf("y", (2, 3, 2))
    v = b.view(b.cat([x, y], 2), (6, 6))
    b.check(v)
    assert v.term == b.cat([b.view(x, (6, 4)), b.view(y, (6, 2))], 1).term


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.sampled_from([(1, 1), (3, 1), (2, 5), (-1, 4)]), st.integers(2, 4))
def test_scales_move_out_of_a_reshaped_cat(batch, rows, scales, share):
    """A cat of scaled parts reshaped across its cat dim is the common factor times the reshaped cat:
    a data-parallel rank's microbatch row, its gradient parts scaled by `share` times the
    reference's, is `share` times that row of the reference's reshaped cat (no scale stays inside)."""
    b = Build()
    x, y = b.leaf("x", (batch, rows, 2, 3)), b.leaf("y", (batch, rows, 2, 1))

    def gradient(factor: int, lo: int, hi: int) -> V:
        parts = [b.op("mul", b.sl(t, 0, lo, hi), b.scalar(factor * s / 7, (hi - lo, rows, 2, t.shape[3])))
                 for t, s in ((x, scales[0]), (y, scales[1]))]
        return b.view(b.cat(parts, 3), (hi - lo, rows * 8))

    whole = gradient(1, 0, batch)
    b.r.reference_size = len(b.u)
    row = gradient(share, batch - 1, batch)
    for v in (whole, row):
        b.check(v)
    assert "cat" not in {b.op_of(v) for v in (whole, row)}
    assert row.term == b.r.scale(b.r.slice(whole.term, ((batch - 1, batch), (0, rows * 8))), share)


def test_view_merging_the_cat_dim_of_one_row_parts_joins_them_along_the_next_dim():
    """Sequence shards of a batch of one gathered on dim 0, then flattened with the sequence: the
    whole sequence flattened (and any one-row parts: their join along the next dim)."""
    b = Build()
    x = b.leaf("x", (1, 8, 3))
    gathered = b.view(b.cat([b.sl(x, 1, 0, 4), b.sl(x, 1, 4, 8)], 0), (8, 3))
    b.check(gathered)
    assert gathered.term == b.view(x, (8, 3)).term
    p, q = b.leaf("p", (1, 2, 3)), b.leaf("q", (1, 2, 3))
    stacked = b.view(b.cat([p, q], 0), (4, 3))
    b.check(stacked)
    assert stacked.term == b.view(b.cat([p, q], 1), (4, 3)).term


@SETTINGS
@given(st.integers(1, 3), st.integers(2, 4), st.integers(1, 3), st.integers(1, 3))
def test_sequence_slices_gathered_along_a_new_axis_and_flattened_are_the_whole_flattened(batch, ranks, chunk, hidden):
    """XLA's all-gather of sequence shards: each rank's slice (b, c, d) given a new size-1 axis
    (b, 1, c, d), gathered along it and flattened to rows is the whole (b, n*c, d) flattened: a
    broadcast that only inserts size-1 dims reshapes as its base."""
    b = Build()
    x = b.leaf("x", (batch, ranks * chunk, hidden))
    parts = [b.view(b.sl(x, 1, r * chunk, (r + 1) * chunk), (batch, 1, chunk, hidden)) for r in range(ranks)]
    rows = b.view(b.cat(parts, 1), (batch * ranks * chunk, hidden))
    b.check(rows)
    assert rows.term == b.view(x, (batch * ranks * chunk, hidden)).term
    moved = b.view(b.view(x, (batch, 1, ranks * chunk, hidden)), (batch, ranks, chunk, hidden))
    b.check(moved)
    assert moved.term == b.view(x, (batch, ranks, chunk, hidden)).term


def test_view_of_a_broadcast_drops_broadcast_size_one_dims_before_the_bases():
    """One kv head's gradient at a batch of one, summed over its query heads, (1, 1, 1, s, d) ->
    (1, 1, s, d), with only the middle size-1 dim the base's own: the two broadcast ones are
    dropped for one, so the base keeps its head dim and the result is that head of the
    reference's (1, kv_heads, s, d), not a row range of its heads flattened."""
    b = Build()
    s = b.leaf("s", (2, 4, 3))  # (kv heads, seq, d)
    reference = b.view(s, (1, 2, 4, 3))
    head = b.permute(b.view(b.sl(s, 0, 1, 2), (1, 1, 1, 4, 3)), (1, 2, 0, 3, 4))  # base at dims (2, 3, 4)
    y = b.view(head, (1, 1, 4, 3))
    b.check(y)
    assert y.term == b.sl(reference, 1, 1, 2).term


@st.composite
def _broadcast_and_ones(draw) -> tuple[list[int], list[bool], list[int]]:
    """A broadcast's shape, which of its dims the base holds, and a reshape of it that only
    drops or adds size-1 dims."""
    shape = draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=1, max_size=6))
    kept = [draw(st.booleans()) for _ in shape]
    real = [size for size in shape if size != 1]
    target: list[int] = []
    for size in real + [None]:
        target += [1] * draw(st.integers(0, 2))
        target += [size] if size is not None else []
    return shape, kept, target


@SETTINGS
@given(_broadcast_and_ones())
def test_view_of_a_broadcast_moving_size_one_dims(case):
    """However the size-1 dims of a broadcast and of the reshape's target pair up, the view is
    the broadcast's value."""
    shape, kept, target = case
    b = Build()
    base = b.leaf("x", tuple(size for size, k in zip(shape, kept) if k))
    spread = b.view(base, tuple(size if k else 1 for size, k in zip(shape, kept)))
    y = b.view(b.expand(spread, tuple(shape)), tuple(target))
    b.check(y)


@pytest.mark.parametrize("shape", [(1, 1, 3), (2, 1, 1), (1, 1, 2, 2)])
def test_squeeze_of_unsqueeze_with_adjacent_size_one_dims(shape):
    b = Build()
    x = b.leaf("x", shape)
    grown = b.view(x, shape[:2] + (1,) + shape[2:])
    back = b.view(grown, shape)
    b.check(back)
    assert back.term == x.term



@SETTINGS
@given(st.integers(2, 4), st.integers(2, 4), st.integers(1, 2), st.integers(0, 2), st.data())
def test_a_cat_behind_size_one_reshapes_and_permutes_is_exposed(m, n, dim, which, data):
    """A reshape of a cat that drops (and adds) size-1 dims stays a view of the cat, but
    `exposed_cat` reads it, permuted or not, as the cat of its parts reshaped alike."""
    b = Build()
    shape = (1, m, n)
    cut = data.draw(st.integers(1, shape[dim] - 1))
    sizes = [cut, shape[dim] - cut]
    parts = [b.leaf(f"p{i}", shape[:dim] + (size,) + shape[dim + 1 :]) for i, size in enumerate(sizes)]
    target = [(m, n), (m, 1, n), (m, n, 1)][which]
    viewed = b.view(b.cat(parts, dim), target)
    y = b.permute(viewed, data.draw(st.permutations(range(len(target)))))
    b.check(y)
    exposed = b.r.exposed_cat(y.term)
    assert b.op_of(viewed) == "view" and b.u[exposed].op == "cat"
    torch.testing.assert_close(evaluate(b.u, exposed, b.leaves), y.value)


def test_a_reshape_of_the_rows_of_a_product_by_a_matrix_reshapes_its_rows():
    """(x @ w).view(6, 5) for a 3-D x is x.view(6, 4) @ w: a router applied before or after its
    input is flattened."""
    b = Build()
    x, w = b.leaf("x", (2, 3, 4)), b.leaf("w", (4, 5))
    after = b.view(b.op("matmul", x, w), (6, 5))
    before = b.op("matmul", b.view(x, (6, 4)), w)
    b.check(after)
    assert after.term == before.term


def test_a_batch_of_ones_product_keeps_a_view_that_only_drops_its_size_one_dims():
    """(x @ w).view(3, 5) for x of shape (1, 3, 4) only drops the batch of one: the view stays
    outside the product (where the layout rules of a batch of one meet it), its value the product's."""
    b = Build()
    x, w = b.leaf("x", (1, 3, 4)), b.leaf("w", (4, 5))
    dropped = b.view(b.op("matmul", x, w), (3, 5))
    b.check(dropped)
    assert b.op_of(dropped) == "view"
    assert dropped.term != b.op("matmul", b.view(x, (3, 4)), w).term


@SETTINGS
@given(st.lists(st.integers(1, 3), min_size=2, max_size=4), st.permutations(range(4)), st.data())
def test_a_permute_moving_only_size_one_dims_is_a_reshape(sizes, perm, data):
    """Elements keep their order when only size-1 dims move: the permute is the view to its shape."""
    shape = tuple(sizes) + (1,) * (4 - len(sizes))
    shape = tuple(data.draw(st.permutations(shape)))
    b = Build()
    x = b.leaf("x", shape)
    y = b.permute(x, perm)
    b.check(y)
    moved = [p for p in perm if shape[p] != 1]
    if moved != sorted(moved):
        assert b.op_of(y) == "permute"
    else:
        assert y.term == x.term if y.shape == shape else b.op_of(y) == "view"


def test_size_one_dims_added_to_a_products_rows_and_dropped_again_leave_the_product():
    """einsum's x.unsqueeze(2) @ w, viewed without the size-1 dim, is x @ w."""
    b = Build()
    x, w = b.leaf("x", (2, 3, 4)), b.leaf("w", (4, 5))
    y = b.view(b.op("matmul", b.view(x, (2, 3, 1, 4)), w), (2, 3, 5))
    b.check(y)
    assert y.term == b.op("matmul", x, w).term


@SETTINGS
@given(st.integers(2, 4), st.integers(2, 4), st.integers(2, 3), st.data())
def test_view_of_one_block_moved_ahead_is_that_block(tokens, blocks, width, data):
    """X(tokens, blocks*w) viewed (tokens, blocks, w), the blocks moved ahead, block k taken and its
    unit dim dropped (Ulysses' switch before an all_to_all) is the column range X[:, k*w:(k+1)*w]."""
    b = Build()
    x = b.leaf("x", (tokens, blocks * width))
    k = data.draw(st.integers(0, blocks - 1))
    moved = b.permute(b.view(x, (tokens, blocks, width)), (1, 0, 2))
    y = b.view(b.sl(moved, 0, k, k + 1), (tokens, width))
    b.check(y)
    assert y.term == b.sl(x, 1, k * width, (k + 1) * width).term


@SETTINGS
@given(st.integers(2, 3), st.integers(2, 4), st.integers(2, 3), st.data())
def test_one_of_interleaved_pairs_of_permuted_heads_is_that_entry_of_each_pair(tokens, heads, pairs, data):
    """X(tokens, heads*pairs*2) viewed (tokens, heads, pairs, 2), heads moved ahead, entry k of each
    pair taken and its unit dim dropped (x[..., k::2] of a rotary embedding, heads split among
    ranks) keeps the heads ahead: permute(view(that entry of X's pairs), (1, 0, 2)). A view of the
    slice as a whole is no region: the permute reorders the dims it keeps."""
    b = Build()
    x = b.leaf("x", (tokens, heads * pairs * 2))
    k = data.draw(st.integers(0, 1))
    h0, h1 = data.draw(ranges(heads).filter(lambda r: r[1] - r[0] > 1))  # one head left would be cut too
    split = b.view(x, (tokens, heads, pairs, 2))
    moved = b.box(b.permute(split, (1, 0, 2, 3)), ((h0, h1), (0, tokens), (0, pairs), (k, k + 1)))
    y = b.view(moved, (h1 - h0, tokens, pairs))
    b.check(y)
    entry = b.box(split, ((0, tokens), (h0, h1), (0, pairs), (k, k + 1)))
    assert y.term == b.permute(b.view(entry, (tokens, h1 - h0, pairs)), (1, 0, 2)).term


@given(st.integers(1, 2), st.integers(2, 4), st.integers(2, 4), st.integers(1, 3), st.data())
def test_view_of_one_block_moved_behind_other_dims_is_that_block_permuted(tokens, blocks, width, d, data):
    """X(batch, tokens, blocks*w, d) viewed (batch, tokens, blocks, w, d), permuted to (batch, w,
    blocks, tokens, d), block k taken and its unit dim dropped (heads moved ahead of the sequence
    for Ulysses' exchange) is X's heads [k*w:(k+1)*w] with heads and tokens swapped."""
    b = Build()
    x = b.leaf("x", (2, tokens, blocks * width, d))
    k = data.draw(st.integers(0, blocks - 1))
    moved = b.permute(b.view(x, (2, tokens, blocks, width, d)), (0, 3, 2, 1, 4))
    y = b.view(b.sl(moved, 2, k, k + 1), (2, width, tokens, d))
    b.check(y)
    assert y.term == b.permute(b.sl(x, 2, k * width, (k + 1) * width), (0, 2, 1, 3)).term


def test_a_row_of_a_dim_the_view_kept_is_no_block():
    """A data-parallel rank's batch row of Y = view(Z(2, 8, 4, 8), (2, 32, 8)), Y transposed and
    the row dropped, is a region of the transpose's flattening: the batch dim is Y's own, not a
    block of a dim the program split, so the slice is not moved inside the permute (it would miss
    the form the reference's matmul over the whole batch meets)."""
    b = Build()
    z = b.leaf("z", (2, 8, 4, 8))
    moved = b.permute(b.view(z, (2, 32, 8)), (0, 2, 1))
    y = b.view(b.box(moved, ((1, 2), (0, 8), (16, 32))), (8, 16))
    b.check(y)
    assert b.is_slice_of(y, b.view(moved, (16, 32)))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5, 1), (2, 3, 4, 1, 5), (2, 3, 1, 4, 5, 1)])
def test_a_products_batch_regrouped_with_ones_added_is_the_regrouped_product(shape):
    """einsum views its bmm over b*heads as (b, heads, m, 1, n), a one for the dim it contracted:
    the per-head products, the ones added outside them."""
    b = Build()
    x, w = b.leaf("x", (6, 4, 3)), b.leaf("w", (6, 3, 5))
    y = b.view(b.op("matmul", x, w), shape)
    b.check(y)
    per_head = b.op("matmul", b.view(x, (2, 3, 4, 3)), b.view(w, (2, 3, 3, 5)))
    assert b.op_of(y) == "bcast" and b.u[y.term].args[0] == per_head.term


@SETTINGS
@given(st.integers(2, 4), st.integers(2, 3), st.data())
def test_one_block_moved_behind_and_kept_one_row_deep_is_that_block_broadcast(blocks, rows, data):
    """S(blocks*rows) viewed (blocks, rows), transposed and cut to block k, the unit dim kept (a
    gradient column of one peer's tokens): S[k*rows:(k+1)*rows] as a column, the form the
    reference's slice of its own column takes."""
    b = Build()
    s = b.leaf("s", (blocks * rows,))
    k = data.draw(st.integers(0, blocks - 1))
    column = b.sl(b.permute(b.view(s, (blocks, rows)), (1, 0)), 1, k, k + 1)
    b.check(column)
    assert column.term == b.view(b.sl(s, 0, k * rows, (k + 1) * rows), (rows, 1)).term


def test_a_row_of_a_dim_the_permute_keeps_ahead_stays_a_slice():
    """The block index left ahead of its factors (no other factor moved before it) is a region of
    the permute, as the region laws read it."""
    b = Build()
    s = b.leaf("s", (3, 4, 2))
    kept = b.sl(b.permute(b.view(s, (3, 8)), (0, 1)), 0, 1, 2)
    row = b.sl(b.permute(s, (0, 2, 1)), 0, 1, 2)
    for x in (kept, row):
        b.check(x)
        assert b.op_of(x) == "slice"


@SETTINGS
@given(st.integers(2, 5), st.integers(2, 4), st.integers(0, 1))
def test_a_view_dropping_ones_every_part_broadcasts_is_the_cat_of_the_parts_viewed(rows, parts, where):
    """Columns, each a (rows,) vector broadcast to (rows, 1, 1) and scaled, joined along dim 2 and
    viewed (rows, parts): the cat of the scaled columns, each scale inside its part."""
    b = Build()
    shape = (rows, 1, 1) if where else (1, rows, 1)
    columns = [b.op("mul", b.view(b.leaf(f"s{i}", (rows,)), shape), b.scalar(1 / (i + 2), ())) for i in range(parts)]
    whole = b.view(b.cat(columns, 2), (rows, parts))
    b.check(whole)
    assert whole.term == b.cat([b.view(c, (rows, 1)) for c in columns], 1).term


def test_a_view_dropping_a_parts_own_size_one_dim_is_no_cat_of_views():
    """A part whose size-1 dim is its own (a row sliced out, not broadcast): the view is not
    distributed over the parts."""
    b = Build()
    own = b.sl(b.leaf("x", (3, 2, 1)), 1, 0, 1)
    whole = b.view(b.cat([own, b.view(b.leaf("y", (3,)), (3, 1, 1))], 2), (3, 2))
    b.check(whole)
    assert b.op_of(whole) != "cat"


@pytest.mark.parametrize("ranks", [2, 4])
def test_gate_gradient_columns_an_all_to_all_returns_are_the_rows_of_the_references(ranks):
    """Expert parallelism's dispatched gates: each rank's gate-gradient columns over every peer's
    tokens, (peers * tokens, local experts), viewed (peers, tokens, local) and cut to piece 0 for
    rank 0, joined in peer order, transposed and flattened to (tokens, experts): rows 0:tokens of
    the reference's columns, scales and all."""
    b = Build()
    tokens, local = 3, 2
    experts = ranks * local
    sums = [b.leaf(f"s{e}", (ranks * tokens,)) for e in range(experts)]

    def column(s):
        return b.op("mul", b.view(s, (ranks * tokens, 1)), b.scalar(1 / 8, ()))

    reference = b.cat([column(s) for s in sums], 1)
    b.r.reference_size = len(b.u)
    grads = [b.cat([column(sums[p * local + e]) for e in range(local)], 1) for p in range(ranks)]
    received = b.cat([b.sl(b.view(g, (ranks, tokens, local)), 0, 0, 1) for g in grads], 0)
    mine = b.view(b.permute(received, (1, 0, 2)), (tokens, experts))
    b.check(mine)
    assert mine.term == b.sl(reference, 0, 0, tokens).term


def test_a_broadcast_key_flattened_into_heads_and_back_is_the_broadcast():
    """One key (b, 1, s, d) expanded to h heads and flattened (b * h, s, d) for bmm is a repeat;
    viewed back to (b, h, s, d) it is the key broadcast to the heads, as the expand alone is."""
    b = Build()
    key = b.leaf("key", (2, 1, 3, 4))
    heads = b.expand(key, (2, 5, 3, 4))
    flat = b.view(heads, (10, 3, 4))
    back = b.view(flat, (2, 5, 3, 4))
    for y in (flat, back):
        b.check(y)
    assert b.op_of(flat) == "repeat" and back.term == heads.term


def test_a_batched_products_matrix_dim_of_one_dropped_is_a_view_of_the_product():
    """einsum("te,ted->td") is a bmm of (t, 1, e) rows by (t, e, d), viewed (t, d): the batch kept,
    only the matrix dim of one dropped, a view of the product (it once rebuilt the same product and
    viewed it again without end)."""
    b = Build()
    x, w = b.leaf("x", (4, 3, 5)), b.leaf("w", (4, 5, 1))
    y = b.view(b.op("matmul", x, w), (4, 3))
    b.check(y)
    assert b.op_of(y) == "view" and b.u[y.term].args[0] == b.op("matmul", x, w).term
