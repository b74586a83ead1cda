"""Numeric tests of the lookup rules (`rules/lookups.py`): embedding and gather over regions, and
vocab-parallel lookups masked or clamped to a rank's shard.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from test_rules import SETTINGS, Build, V, column, cuts, labels, masked_local_ids, ranges


def vocab_parallel_rank(b: Build, w: V, ids: V, lo: int, hi: int) -> V:
    """Megatron's VocabParallelEmbedding on one rank."""
    mask, local_ids = masked_local_ids(b, ids, lo, hi)
    rows = b.op("embedding", b.sl(w, 0, lo, hi), local_ids)
    out_shape = rows.shape
    wide_mask = b.expand(b.view(mask, ids.shape + (1,)), out_shape)
    return b.op("where", wide_mask, b.scalar(0.0, out_shape), rows)


def vocab_parallel_target_logit(b: Build, logits: V, target: V, lo: int, hi: int) -> V:
    """Megatron's target-logit lookup on one rank (`logits_2d[arange, masked_target]` on flattened
    tokens lowers to a gather on the unflattened ones)."""
    mask, local = masked_local_ids(b, target, lo, hi)
    column = b.view(local, target.shape + (1,))
    picked = b.view(b.op("gather", b.sl(logits, 2, lo, hi), column, attrs=(2,)), target.shape)
    return b.op("where", mask, b.scalar(0.0, target.shape), picked)


def test_embedding_of_a_column_slice_and_of_sliced_ids():
    b = Build()
    w = b.leaf("w", (7, 6))
    ids = b.leaf("ids", (2, 5), value=torch.randint(0, 7, (2, 5), generator=b.gen))
    cols = b.op("embedding", b.sl(w, 1, 2, 5), ids)
    b.check(cols)
    assert b.is_slice_of(cols, b.op("embedding", w, ids))
    rows = b.op("embedding", w, b.sl(ids, 1, 1, 4))
    b.check(rows)
    assert b.is_slice_of(rows, b.op("embedding", w, ids))


@pytest.mark.parametrize(
    "vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9)), (10, (0, 7, 10)), (6, (0, 1, 2, 3, 4, 5, 6))]
)
def test_vocab_parallel_masked_embedding(vocab, cuts_):
    b = Build()
    w = b.leaf("w", (vocab, 4))
    ids = b.leaf("ids", (2, 5), value=torch.randint(0, vocab, (2, 5), generator=b.gen))
    ranks = [vocab_parallel_rank(b, w, ids, lo, hi) for lo, hi in zip(cuts_, cuts_[1:])]
    for rank in ranks:
        assert b.op_of(rank) == "piece"
    total = b.add(*ranks)
    full = b.op("embedding", w, ids)
    torch.testing.assert_close(total.value, full.value)
    assert total.term == full.term
    b.check(total)


@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9)), (10, (0, 7, 10))])
def test_vocab_parallel_clamped_embedding_scaled_by_its_float_mask(vocab, cuts_):
    """torchtitan's Embedding: rows at the clamped local ids, times `mask.unsqueeze(-1).to(dtype)`."""
    b = Build()
    w = b.leaf("w", (vocab, 4))
    ids = b.leaf("ids", (2, 5), value=torch.randint(0, vocab, (2, 5), generator=b.gen))
    ranks = []
    for lo, hi in zip(cuts_, cuts_[1:]):
        inside = b.op("logical_and", b.op("ge", ids, b.scalar(lo, ids.shape, torch.int64)),
                      b.op("lt", ids, b.scalar(hi, ids.shape, torch.int64)))
        shifted = b.sub(ids, b.scalar(lo, ids.shape, torch.int64))
        clamped = b.op("minimum", b.op("maximum", shifted, b.scalar(0, ids.shape, torch.int64)),
                       b.scalar(hi - lo - 1, ids.shape, torch.int64))
        rows = b.op("embedding", b.sl(w, 0, lo, hi), clamped)
        scale = b.expand(b.op("convert", b.view(inside, ids.shape + (1,)), attrs=("float64",)), rows.shape)
        ranks.append(b.op("mul", rows, scale))
    total = b.add(*ranks)
    b.check(total)
    assert total.term == b.op("embedding", w, ids).term


def test_gather_is_linear_in_its_table_and_constant_along_broadcast_rows():
    b = Build()
    x, y, m = b.leaf("x", (2, 3, 5)), b.leaf("y", (2, 3, 5)), b.leaf("m", (2, 3))
    idx = labels(b, "idx", (2, 3, 1), 5)
    row = b.expand(b.view(m, (2, 3, 1)), (2, 3, 5))
    g = b.op("gather", b.sub(b.add(x, y), row), idx, attrs=(2,))
    b.check(g)
    gx, gy = (b.op("gather", t, idx, attrs=(2,)) for t in (x, y))
    assert g.term == b.sub(b.add(gx, gy), b.view(m, (2, 3, 1))).term


@SETTINGS
@given(st.data())
def test_gather_of_slices_on_other_dims_and_of_an_index_slice(data):
    b = Build()
    x = b.leaf("x", (4, 3, 5))
    idx = labels(b, "idx", (4, 3, 2), 5)
    box = (data.draw(ranges(4)), data.draw(ranges(3)))
    g = b.op("gather", b.box(x, box + ((0, 5),)), b.box(idx, box + ((0, 2),)), attrs=(2,))
    b.check(g)
    whole = b.op("gather", x, idx, attrs=(2,))
    assert g.term == b.r.slice(whole.term, box + ((0, 2),))
    column = b.op("gather", x, b.sl(idx, 2, 1, 2), attrs=(2,))
    b.check(column)
    assert b.is_slice_of(column, whole)


@pytest.mark.parametrize("shift", [False, True], ids=["logits", "shifted-logits"])
@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 8)), (8, (0, 4, 8)), (9, (0, 3, 6, 9)), (10, (0, 7, 10))])
def test_vocab_parallel_masked_gather(vocab, cuts_, shift):
    b = Build()
    logits = b.leaf("logits", (2, 3, vocab))
    if shift:  # as cross entropy subtracts the row max first: the table is a lin
        logits = b.sub(logits, b.expand(b.view(b.leaf("m", (2, 3)), (2, 3, 1)), (2, 3, vocab)))
    target = labels(b, "target", (2, 3), vocab)
    ranks = [vocab_parallel_target_logit(b, logits, target, lo, hi) for lo, hi in zip(cuts_, cuts_[1:])]
    if len(ranks) > 1:
        assert {b.op_of(rank) for rank in ranks} == {"piece"}
    total = b.add(*ranks)
    full = b.view(b.op("gather", logits, b.view(target, (2, 3, 1)), attrs=(2,)), (2, 3))
    torch.testing.assert_close(total.value, full.value)
    assert total.term == full.term
    b.check(total)


@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9)), (10, (0, 7, 10))])
def test_vocab_parallel_clamped_gather_masked_by_a_float(vocab, cuts_):
    """ms-swift's target log-prob: gather at the clamped local id, times float(lo <= id < hi)."""
    b = Build()
    logits, target = b.leaf("logits", (2, 3, vocab)), labels(b, "target", (2, 3), vocab)
    ranks = []
    for lo, hi in zip(cuts_, cuts_[1:]):
        shifted = b.sub(target, b.scalar(lo, target.shape, torch.int64))
        clamped = b.op("minimum", b.op("maximum", shifted, b.scalar(0, target.shape, torch.int64)),
                       b.scalar(hi - lo - 1, target.shape, torch.int64))
        picked = b.view(b.op("gather", b.sl(logits, 2, lo, hi), column(b, clamped), attrs=(2,)), target.shape)
        inside = b.op("logical_and", b.op("ge", target, b.scalar(lo, target.shape, torch.int64)),
                      b.op("lt", target, b.scalar(hi, target.shape, torch.int64)))
        ranks.append(b.op("mul", picked, b.op("convert", inside, attrs=("float64",))))
    total = b.add(*ranks)
    b.check(total)
    assert total.term == b.view(b.op("gather", logits, column(b, target), attrs=(2,)), target.shape).term


@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9))])
def test_vocab_parallel_masked_gather_on_flattened_tokens(vocab, cuts_):
    """loss_parallel's spelling: tokens flattened before the mask, the local ids and the lookup."""
    b = Build()
    logits, target = b.leaf("logits", (6, vocab)), labels(b, "target", (2, 3), vocab)
    flat = b.view(target, (6,))
    ranks = []
    for lo, hi in zip(cuts_, cuts_[1:]):
        mask, local = masked_local_ids(b, flat, lo, hi)
        picked = b.view(b.op("gather", b.sl(logits, 1, lo, hi), column(b, local), attrs=(1,)), (6,))
        ranks.append(b.op("where", mask, b.scalar(0.0, (6,)), picked))
    total = b.add(*ranks)
    b.check(total)
    assert total.term == b.view(b.op("gather", logits, column(b, flat), attrs=(1,)), (6,)).term


@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9))])
@pytest.mark.parametrize("chunk", [(0, 2), (2, 4), (4, 6)])
def test_vocab_parallel_masked_gather_over_a_chunk_of_the_tokens(vocab, cuts_, chunk):
    """A chunked loss's spelling: loss_parallel's lookup over rows [a, b) of the logits, at the ids
    of those rows. The rows are the rows of the lookup over all the tokens, masked the same way:
    the ranks' lookups sum to the rows [a, b) of the reference's."""
    b = Build()
    logits, target = b.leaf("logits", (6, vocab)), labels(b, "target", (6,), vocab)
    rows, ids = b.sl(logits, 0, *chunk), b.sl(target, 0, *chunk)
    n = chunk[1] - chunk[0]
    ranks = []
    for lo, hi in zip(cuts_, cuts_[1:]):
        mask, local = masked_local_ids(b, ids, lo, hi)
        picked = b.view(b.op("gather", b.sl(rows, 1, lo, hi), column(b, local), attrs=(1,)), (n,))
        ranks.append(b.op("where", mask, b.scalar(0.0, (n,)), picked))
    total = b.add(*ranks)
    b.check(total)
    whole = b.view(b.op("gather", logits, column(b, target), attrs=(1,)), (6,))
    assert total.term == b.sl(whole, 0, *chunk).term


def _greedy_pick(b: Build, logits: V, points: list[int], offsets: list[int]) -> V:
    """Greedy sampling over vocab-parallel logits: each rank's max and argmax over its columns
    [lo, hi), the argmax plus the rank's offset, both stacked over ranks (an all-gather), the
    position of the rank holding the largest max picked."""
    maxes, positions = [], []
    for (lo, hi), offset in zip(zip(points, points[1:]), offsets):
        shard = b.sl(logits, 1, lo, hi)
        peak, position = b.op("amax", shard, attrs=((1,), False)), b.op("argmax", shard, attrs=((1,), False))
        position = b.add(position, b.scalar(offset, position.shape, torch.int64))
        maxes.append(b.view(peak, (1,) + peak.shape))
        positions.append(b.view(position, (1,) + position.shape))
    stacked = b.cat(positions, 0)
    best = b.view(b.op("argmax", b.cat(maxes, 0), attrs=((0,), False)), (1, logits.shape[0]))
    return b.view(b.op("gather", stacked, best, attrs=(0,)), (logits.shape[0],))


@SETTINGS
@given(st.integers(2, 9), st.data())
def test_the_position_of_the_largest_of_the_ranks_maxes_is_the_argmax(size, data):
    b = Build()
    logits = b.leaf("logits", (3, size))
    points = data.draw(cuts(size))
    picked = _greedy_pick(b, logits, points, points[:-1])
    b.check(picked)
    assert picked.term == b.op("argmax", logits, attrs=((1,), False)).term


def test_the_pick_from_ranks_gathered_into_flat_tensors_is_the_argmax():
    """all_gather_into_tensor: the ranks' values joined along dim 0, then viewed (ranks, tokens)."""
    b = Build()
    logits = b.leaf("logits", (3, 6))
    maxes, positions = [], []
    for lo, hi in ((0, 2), (2, 4), (4, 6)):
        shard = b.sl(logits, 1, lo, hi)
        maxes.append(b.op("amax", shard, attrs=((1,), False)))
        positions.append(b.add(b.op("argmax", shard, attrs=((1,), False)), b.scalar(lo, (3,), torch.int64)))
    best = b.view(b.op("argmax", b.view(b.cat(maxes, 0), (3, 3)), attrs=((0,), False)), (1, 3))
    picked = b.op("gather", b.view(b.cat(positions, 0), (3, 3)), best, attrs=(0,))
    b.check(picked)
    assert picked.term == b.view(b.op("argmax", logits, attrs=((1,), False)), (1, 3)).term


def test_ties_go_to_the_first_rank_as_torch_argmax_takes_the_first():
    b = Build()
    logits = b.leaf("logits", (2, 4), torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]], dtype=torch.float64))
    picked = _greedy_pick(b, logits, [0, 2, 4], [0, 2])
    b.check(picked)
    assert picked.term == b.op("argmax", logits, attrs=((1,), False)).term


SECOND_HALF_WINS = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 0.0, 3.0, 2.0]], dtype=torch.float64)


@pytest.mark.parametrize("offsets", [[0, 0], [0, 1], [1, 3]])
def test_positions_without_the_ranks_offsets_are_no_argmax(offsets):
    b = Build()
    logits = b.leaf("logits", (2, 4), SECOND_HALF_WINS)
    picked = _greedy_pick(b, logits, [0, 2, 4], offsets)
    assert not torch.equal(picked.value, SECOND_HALF_WINS.argmax(1))
    assert picked.term != b.op("argmax", logits, attrs=((1,), False)).term


def test_ranks_out_of_order_are_no_argmax():
    """The pick is the argmax only when the ranks' ranges follow each other in the stack's order:
    otherwise a tie goes to a later position."""
    b = Build()
    ties = torch.tensor([[3.0, 0.0, 0.0, 3.0]], dtype=torch.float64)
    logits = b.leaf("logits", (1, 4), ties)
    maxes, positions = [], []
    for lo, hi in ((2, 4), (0, 2)):
        shard = b.sl(logits, 1, lo, hi)
        position = b.add(b.op("argmax", shard, attrs=((1,), False)), b.scalar(lo, (1,), torch.int64))
        maxes.append(b.view(b.op("amax", shard, attrs=((1,), False)), (1, 1)))
        positions.append(b.view(position, (1, 1)))
    best = b.view(b.op("argmax", b.cat(maxes, 0), attrs=((0,), False)), (1, 1))
    picked = b.op("gather", b.cat(positions, 0), best, attrs=(0,))
    assert picked.value.item() == 3 != ties.argmax(1).item()  # the tie goes to the later position
    assert picked.term != b.view(b.op("argmax", logits, attrs=((1,), False)), (1, 1)).term


@SETTINGS
@given(st.integers(0, 2), st.data())
def test_gather_at_position_zero_reads_the_first_entry_along_the_dim(dim, data):
    b = Build()
    x = b.leaf("x", (3, 4, 2))
    shape = tuple(data.draw(st.integers(1, n)) if d != dim else data.draw(st.integers(1, 3)) for d, n in enumerate(x.shape))
    zeros = V(b.r.const(("full", 0), shape, "int64"), torch.zeros(shape, dtype=torch.int64))
    y = b.op("gather", x, zeros, attrs=(dim,))
    b.check(y)
    assert "gather" not in b.ops_in(y)


def test_a_where_takes_its_constant_branch_in_its_own_dtype():
    """where(m, x, 0) is one term whether the tracer made the 0 an int or a float."""
    b = Build()
    x = b.leaf("x", (3, 4))
    m = b.op("gt", b.leaf("y", (3, 4)), b.scalar(0.0, (3, 4)))
    ints, floats = (b.op("where", m, x, b.scalar(0, (3, 4), dtype)) for dtype in (torch.int64, torch.float64))
    b.check(ints)
    assert ints.term == floats.term


def test_a_where_keeping_a_partial_sum_or_zero_is_a_partial_sum():
    """The mask of an expert's rows over a rank's partial down projection: the shares of the masked
    whole, summing to it."""
    b = Build()
    h, w = b.leaf("h", (5, 6)), b.leaf("w", (6, 3))
    m = b.op("gt", b.leaf("y", (5, 3)), b.scalar(0.0, (5, 3)))
    zero = b.scalar(0.0, (5, 3))
    shares = [b.op("where", m, b.op("matmul", b.sl(h, 1, lo, hi), b.sl(w, 0, lo, hi)), zero) for lo, hi in ((0, 4), (4, 6))]
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    whole = b.op("where", m, b.op("matmul", h, w), zero)
    assert total.term == whole.term
    torch.testing.assert_close(b.value_of(total), whole.value)


def test_a_where_keeping_a_sum_of_partial_sums_or_zero_is_a_partial_sum():
    """A rank's share of a fused product's gradient is a sum of two partial sums over the same range
    (one per half); the mask keeps it one partial sum, and the ranks' shares sum to the masked whole."""
    b = Build()
    g, u, wg, wu = b.leaf("g", (5, 4)), b.leaf("u", (5, 4)), b.leaf("wg", (4, 3)), b.leaf("wu", (4, 3))
    m = b.op("gt", b.leaf("y", (5, 3)), b.scalar(0.0, (5, 3)))
    zero = b.scalar(0.0, (5, 3))
    shares = []
    for lo, hi in ((0, 2), (2, 4)):
        rank = b.add(b.op("matmul", b.sl(g, 1, lo, hi), b.sl(wg, 0, lo, hi)), b.op("matmul", b.sl(u, 1, lo, hi), b.sl(wu, 0, lo, hi)))
        shares.append(b.op("where", m, rank, zero))
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    whole = b.op("where", m, b.add(b.op("matmul", g, wg), b.op("matmul", u, wu)), zero)
    assert total.term == whole.term
    b.check(total)


def test_a_where_keeping_a_broadcast_cat_or_zero_is_cut_where_the_cat_is():
    """where(m, bcast(cat(a, c)), 0) is the cat of the masked parts, so a rank's packed rows of
    each part (a fused gate/up gradient) are regions of the reference's masked parts."""
    b = Build()
    a_, c, y = b.leaf("a", (6, 3)), b.leaf("c", (6, 3)), b.leaf("y", (3,))

    def masked(rows: list[V]) -> V:
        n = sum(r.shape[0] for r in rows)
        m = b.expand(b.view(b.op("gt", y, b.scalar(0.0, (3,))), (1, 1, 3)), (2, n, 3))
        value = b.expand(b.view(b.cat(rows, 0), (1, n, 3)), (2, n, 3))
        return b.op("where", m, value, b.scalar(0.0, (2, n, 3)))

    whole = masked([a_, c])
    packed = masked([b.sl(a_, 0, 0, 3), b.sl(c, 0, 0, 3)])
    b.check(whole)
    b.check(packed)
    assert b.op_of(whole) == b.op_of(packed) == "cat"
    assert [b.r.as_region(p)[0] for p in b.u[packed.term].args] == list(b.u[whole.term].args)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_gather_from_ranks_shares_joined_adds_up_to_the_gather_from_the_whole(tp):
    """A TP rank's share of each routed gate's gradient (one column per expert, each a product over
    the rank's block of the hidden, scaled or not), joined along the columns and read at each
    token's chosen experts (the router's top-k gather): the ranks' reads add up to the read of
    the whole columns."""
    b = Build()
    x, w = b.leaf("x", (6, 8)), b.leaf("w", (8, 3))
    ids = b.leaf("ids", (6, 2), value=torch.stack([torch.randperm(3, generator=b.gen)[:2] for _ in range(6)]))
    block = 8 // tp

    def read(lo: int, hi: int) -> V:
        parts = [b.op("matmul", b.sl(x, 1, lo, hi), b.sl(b.sl(w, 1, e, e + 1), 0, lo, hi)) for e in range(3)]
        scaled = [b.op("mul", p, b.scalar(0.25, p.shape)) if e else p for e, p in enumerate(parts)]
        return b.op("gather", b.cat(scaled, 1), ids, attrs=(1,))

    summed = b.add(*(read(r * block, (r + 1) * block) for r in range(tp)))
    b.check(summed)
    assert summed.term == read(0, 8).term


def test_embedding_is_linear_in_its_table() -> None:
    """A rank's rows of its partial product (`out[token_idx]` of a routed expert's output under
    tensor parallelism) are its share of the rows of the whole product: the shares sum to them."""
    b = Build()
    x, w = b.leaf("x", (5, 6)), b.leaf("w", (6, 3))
    idx = b.leaf("idx", (7,), torch.randint(0, 5, (7,), generator=b.gen))
    shares = [b.op("embedding", b.op("matmul", b.sl(x, 1, lo, hi), b.sl(w, 0, lo, hi)), idx) for lo, hi in ((0, 2), (2, 6))]
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    b.check(total)
    assert total.term == b.op("embedding", b.op("matmul", x, w), idx).term
