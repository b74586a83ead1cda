"""Numeric tests of the one-hot rules (`rules/one_hot.py`): scatters of one entry per row, and a
rank's one-hot of the ids in its vocab range.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import pytest
import torch

from test_rules import Build, V, column, labels, masked_local_ids, one_hot


def megatron_rank_one_hot(b: Build, ids: V, lo: int, hi: int, spelling: str) -> V:
    """One rank's [lo, hi) share of the one-hot of -1 at ids, as vocab-parallel backwards spell it."""
    mask, local = masked_local_ids(b, ids, lo, hi)
    if spelling == "megatron":  # grad_2d[arange, masked_target] -= 1 - target_mask.float()
        update = b.sub(b.scalar(1.0, ids.shape), b.op("convert", mask, attrs=("float64",)))
        return one_hot(b, local, b.op("neg", update), hi - lo, op="scatter")
    # gather backward of a clamped local index, the gradient masked to the owner (ms-swift)
    shifted = b.sub(ids, b.scalar(lo, ids.shape, torch.int64))
    clamped = b.op("minimum", b.op("maximum", shifted, b.scalar(0, ids.shape, torch.int64)),
                   b.scalar(hi - lo - 1, ids.shape, torch.int64))
    inside = b.op("logical_and", b.op("ge", ids, b.scalar(lo, ids.shape, torch.int64)),
                  b.op("lt", ids, b.scalar(hi, ids.shape, torch.int64)))
    values = b.op("mul", b.scalar(-1.0, ids.shape), b.op("convert", inside, attrs=("float64",)))
    return one_hot(b, clamped, values, hi - lo)


def test_scatter_into_zeros_is_the_one_hot():
    b = Build()
    ids, values = labels(b, "ids", (2, 3), 5), b.leaf("v", (2, 3))
    written = one_hot(b, ids, values, 5, op="scatter")
    b.check(written)
    assert written.term == one_hot(b, ids, values, 5).term


def test_scatter_into_a_tensor_is_it_plus_the_one_hot_of_the_change():
    """Megatron's `grad_2d[arange, target] -= 1`: read, change, write back one entry per row."""
    b = Build()
    x, ids, v = b.leaf("x", (2, 3, 5)), labels(b, "ids", (2, 3), 5), b.leaf("v", (2, 3))
    here = b.view(b.op("gather", x, column(b, ids), attrs=(2,)), (2, 3))
    written = b.op("scatter", x, column(b, ids), column(b, b.sub(here, v)), attrs=(2,))
    b.check(written)
    assert written.term == b.sub(x, one_hot(b, ids, v, 5)).term


@pytest.mark.parametrize("keepdim", [False, True])
def test_sum_of_a_one_hot_over_its_dim_is_the_values(keepdim):
    b = Build()
    ids, values = labels(b, "ids", (2, 3), 5), b.leaf("v", (2, 3))
    total = b.op("sum", one_hot(b, ids, values, 5), attrs=((2,), keepdim))
    b.check(total)
    assert total.term == (column(b, values) if keepdim else values).term


def test_one_hot_absorbs_factors_constant_along_its_dim_and_scales():
    b = Build()
    x, ids, v, y = b.leaf("x", (2, 3, 5)), labels(b, "ids", (2, 3), 5), b.leaf("v", (2, 3)), b.leaf("y", (2, 3))
    rows = b.expand(column(b, y), (2, 3, 5))
    scaled = b.op("mul", one_hot(b, ids, v, 5), rows)
    b.check(scaled)
    assert scaled.term == one_hot(b, ids, b.op("mul", v, y), 5).term
    both = b.op("mul", b.add(x, one_hot(b, ids, v, 5)), rows)
    b.check(both)
    assert b.op_of(both) == "lin"
    negated = one_hot(b, ids, b.op("neg", v), 5)
    assert negated.term == b.op("neg", one_hot(b, ids, v, 5)).term


@pytest.mark.parametrize("spelling", ["megatron", "clamped"])
@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9)), (10, (0, 7, 10))])
def test_vocab_parallel_one_hot_is_a_slice_of_the_reference_one(vocab, cuts_, spelling):
    b = Build()
    ids = labels(b, "ids", (2, 3), vocab)
    whole = one_hot(b, ids, b.scalar(-1.0, ids.shape), vocab)
    b.r.reference_size = len(b.u)  # the reference wrote that one-hot; the ranks come after
    ranks = [megatron_rank_one_hot(b, ids, lo, hi, spelling) for lo, hi in zip(cuts_, cuts_[1:])]
    for rank, (lo, hi) in zip(ranks, zip(cuts_, cuts_[1:])):
        b.check(rank)
        assert rank.term == b.r.slice(whole.term, ((0, 2), (0, 3), (lo, hi)))
    assert b.cat(ranks, 2).term == whole.term


@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9))])
def test_a_reference_running_the_masked_code_over_the_whole_vocab_writes_the_plain_one_hot(vocab, cuts_):
    """Megatron on one rank: the mask `ids < 0 | ids >= vocab` and the shift by 0 still spelled."""
    b = Build()
    ids = labels(b, "ids", (2, 3), vocab)
    whole = megatron_rank_one_hot(b, ids, 0, vocab, "megatron")
    b.check(whole)
    assert whole.term == one_hot(b, ids, b.scalar(-1.0, ids.shape), vocab).term
    b.r.reference_size = len(b.u)
    ranks = [megatron_rank_one_hot(b, ids, lo, hi, "megatron") for lo, hi in zip(cuts_, cuts_[1:])]
    for rank in ranks:
        b.check(rank)
    assert b.cat(ranks, 2).term == whole.term


def test_rank_one_hot_without_a_reference_one_stays_literal():
    """The axis width is not visible on a rank: without the reference's one-hot it is left alone."""
    b = Build()
    ids = labels(b, "ids", (2, 3), 8)
    b.r.reference_size = len(b.u)
    rank = megatron_rank_one_hot(b, ids, 4, 8, "megatron")
    b.check(rank)
    assert b.op_of(rank) == "scatter_add"


def _rows_summed_by_ids(b: Build, ids: V, rows: V, width: int) -> V:
    """An embedding's weight gradient as the lowering spells it: onehot(ids)^T @ rows."""
    count = ids.shape[0]
    hot = b.op("scatter_add", b.scalar(0.0, (count, width)), b.view(ids, (count, 1)), b.scalar(1.0, (count, 1)),
               attrs=(1,))
    return b.op("matmul", b.permute(hot, (1, 0)), rows)


@pytest.mark.parametrize("form", ["where", "float mask"])
@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (9, (0, 3, 6, 9))])
def test_a_row_mask_of_the_rows_summed_by_a_one_hot_moves_into_it(vocab, cuts_, form):
    """torchtitan's vocab-parallel embedding scales its rows by float(lo <= id < hi), so its weight
    gradient sums masked rows at the clamped local ids: the rank's rows [lo, hi) of the reference's."""
    b = Build()
    tokens, width = (2, 3), 4
    ids = labels(b, "ids", tokens, vocab)
    grad = b.leaf("grad", tokens + (width,))
    flat_ids = b.view(ids, (6,))
    whole = _rows_summed_by_ids(b, flat_ids, b.view(grad, (6, width)), vocab)
    b.r.reference_size = len(b.u)
    for lo, hi in zip(cuts_, cuts_[1:]):
        inside = b.op("logical_and", b.op("ge", ids, b.scalar(lo, tokens, torch.int64)),
                      b.op("lt", ids, b.scalar(hi, tokens, torch.int64)))
        wide = b.expand(b.view(inside, tokens + (1,)), grad.shape)
        masked = (b.op("where", wide, grad, b.scalar(0.0, grad.shape)) if form == "where"
                  else b.op("mul", grad, b.op("convert", wide, attrs=("float64",))))
        shifted = b.sub(flat_ids, b.scalar(lo, (6,), torch.int64))
        clamped = b.op("minimum", b.op("maximum", shifted, b.scalar(0, (6,), torch.int64)),
                       b.scalar(hi - lo - 1, (6,), torch.int64))
        rank = _rows_summed_by_ids(b, clamped, b.view(masked, (6, width)), hi - lo)
        b.check(rank)
        assert rank.term == b.sl(whole, 0, lo, hi).term


@pytest.mark.parametrize("values", ["rows", "ones"])
def test_a_one_hot_of_some_rows_of_the_ids_is_those_rows_of_the_one_hot(values):
    """A microbatch's rows of the ids (and of the values, or constant ones, an embedding's backward)
    scattered along the last dim are those rows of the batch's one-hot."""
    b = Build()
    ids, v = labels(b, "ids", (4, 3), 5), b.leaf("v", (4, 3))
    rows = b.sl(v, 0, 1, 3) if values == "rows" else b.scalar(1.0, (2, 3))
    written = one_hot(b, b.sl(ids, 0, 1, 3), rows, 5)
    b.check(written)
    whole = one_hot(b, ids, v if values == "rows" else b.scalar(1.0, (4, 3)), 5)
    assert b.is_slice_of(written, whole)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_scatter_of_ranks_shares_into_zeros_adds_up_to_the_scatter_of_the_sum(tp):
    """Written into zeros, a TP rank's share of a product (its gates' gradient through the
    router's top-k scatter) stays a share: the ranks' scatters add up to the whole's."""
    b = Build()
    x, w = b.leaf("x", (5, 8)), b.leaf("w", (8, 2))
    ids = b.leaf("ids", (5, 2), value=torch.stack([torch.randperm(4, generator=b.gen)[:2] for _ in range(5)]))
    block = 8 // tp

    def scattered(lo: int, hi: int) -> V:
        share = b.op("matmul", b.sl(x, 1, lo, hi), b.sl(w, 0, lo, hi))
        return b.op("scatter", b.scalar(0.0, (5, 4)), ids, share, attrs=(1,))

    summed = b.add(*(scattered(r * block, (r + 1) * block) for r in range(tp)))
    b.check(summed)
    assert summed.term == scattered(0, 8).term
