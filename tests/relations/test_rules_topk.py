"""Numeric tests of the top-k rules (relations/rules/topk.py) and of the remainder of a position:
each built term evaluates to what torch computes, and the term says what the law says."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardproof.ir.aten_ops import Operand
from shardproof.relations.rules.topk import DISTINCT, TOPK
from test_rules import SETTINGS, Build, V, cuts


def top(b: Build, x: V, k: int, path: tuple[int, ...], dim: int = -1, by_keyword: bool = False) -> V:
    """One output of torch.topk(x, k, dim), as the lowering spells it (dim positional or keyword)."""
    attrs = ((Operand(0), k), (("dim", dim),), path) if by_keyword else ((Operand(0), k, dim), (), path)
    return b.op(TOPK, x, attrs=attrs)


def sampled(b: Build, logits: V, points: list[int], local_k: list[int], k: int, offsets: list[int] | None = None) -> tuple[V, V]:
    """Top-k sampling over vocab-parallel logits: each rank's top local_k over its columns [lo, hi),
    positions plus the rank's offset, both joined along the vocab dim (an all-gather), the top k of
    the joined values taken and the positions gathered at it."""
    offsets = points[:-1] if offsets is None else offsets
    values, positions = [], []
    for (lo, hi), kept, offset in zip(zip(points, points[1:]), local_k, offsets):
        shard = b.sl(logits, 1, lo, hi)
        values.append(top(b, shard, kept, (0,)))
        local = top(b, shard, kept, (1,))
        positions.append(b.add(local, b.scalar(offset, local.shape, torch.int64)))
    joined_values, joined_positions = b.cat(values, 1), b.cat(positions, 1)
    chosen = top(b, joined_values, k, (1,))
    return top(b, joined_values, k, (0,)), b.op("gather", joined_positions, chosen, attrs=(1,))


@SETTINGS
@given(st.integers(2, 9), st.data())
def test_the_top_k_of_the_ranks_top_candidates_is_the_top_k(size, data):
    b = Build()
    logits = b.leaf("logits", (3, size))
    points = data.draw(cuts(size))
    k = data.draw(st.integers(1, size))
    values, positions = sampled(b, logits, points, [min(k, hi - lo) for lo, hi in zip(points, points[1:])], k)
    b.check(values)
    b.check(positions)  # random logits: the top values are distinct
    assert values.term == top(b, logits, k, (0,)).term
    assert positions.term == top(b, logits, k, (1,)).term
    assert DISTINCT in b.r.assumptions


def test_a_rank_keeping_more_candidates_than_k_changes_nothing():
    b = Build()
    logits = b.leaf("logits", (2, 8))
    values, positions = sampled(b, logits, [0, 4, 8], [4, 3], 2)
    b.check(positions)
    assert (values.term, positions.term) == (top(b, logits, 2, (0,)).term, top(b, logits, 2, (1,)).term)


def test_tied_values_are_exact_and_only_the_positions_assume_distinct_values():
    b = Build()
    ties = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0]], dtype=torch.float64)
    logits = b.leaf("logits", (1, 6), ties)
    values = top(b, b.cat([top(b, b.sl(logits, 1, lo, hi), 2, (0,)) for lo, hi in ((0, 3), (3, 6))], 1), 2, (0,))
    b.check(values)
    assert values.term == top(b, logits, 2, (0,)).term
    assert not b.r.assumptions  # no positions were gathered


def test_one_rank_the_top_k_of_its_top_k_is_its_top_k():
    """World size 1: the candidates are the whole top k already."""
    b = Build()
    logits = b.leaf("logits", (3, 7))
    values, positions = sampled(b, logits, [0, 7], [3], 3)
    b.check(positions)
    assert (values.term, positions.term) == (top(b, logits, 3, (0,)).term, top(b, logits, 3, (1,)).term)


def test_one_spelling_of_topk_with_dim_by_keyword_or_negative():
    b = Build()
    logits = b.leaf("logits", (3, 7))
    assert top(b, logits, 2, (0,), dim=-1, by_keyword=True).term == top(b, logits, 2, (0,), dim=1).term


def test_the_top_k_of_a_shard_cut_along_other_dims_too():
    """Rows cut as well as columns: the rows of the piece of the top k of those rows' whole columns."""
    b = Build()
    logits = b.leaf("logits", (4, 8))
    rows = b.sl(logits, 0, 1, 3)
    values, positions = [], []
    for lo, hi in ((0, 5), (5, 8)):
        shard = b.sl(rows, 1, lo, hi)
        values.append(top(b, shard, 3, (0,)))
        local = top(b, shard, 3, (1,))
        positions.append(b.add(local, b.scalar(lo, local.shape, torch.int64)))
    joined = b.cat(values, 1)
    picked = b.op("gather", b.cat(positions, 1), top(b, joined, 3, (1,)), attrs=(1,))
    b.check(picked)
    assert picked.term == top(b, rows, 3, (1,)).term


def test_too_few_candidates_are_no_top_k():
    """A rank keeping 1 of its 3 columns where the top 2 lie in them: the second value is missed."""
    b = Build()
    first_half_wins = torch.tensor([[5.0, 4.0, 0.0, 1.0, 2.0, 0.5]], dtype=torch.float64)
    logits = b.leaf("logits", (1, 6), first_half_wins)
    values, positions = sampled(b, logits, [0, 3, 6], [1, 1], 2)
    assert not torch.equal(values.value, first_half_wins.topk(2).values)
    assert values.term != top(b, logits, 2, (0,)).term
    assert positions.term != top(b, logits, 2, (1,)).term


@pytest.mark.parametrize("offsets", [[0, 0], [0, 2], [3, 4]])
def test_positions_without_the_ranks_offsets_are_no_top_k_positions(offsets):
    b = Build()
    second_half_wins = torch.tensor([[0.0, 1.0, 2.0, 5.0, 3.0, 4.0]], dtype=torch.float64)
    logits = b.leaf("logits", (1, 6), second_half_wins)
    positions = sampled(b, logits, [0, 3, 6], [2, 2], 2, offsets)[1]
    assert not torch.equal(positions.value, second_half_wins.topk(2).indices)
    assert positions.term != top(b, logits, 2, (1,)).term


def test_ranks_joined_out_of_order_are_left_alone():
    """The law wants the shards joined in the order of their ranges."""
    b = Build()
    logits = b.leaf("logits", (2, 6))
    values = []
    for lo, hi in ((3, 6), (0, 3)):
        values.append(top(b, b.sl(logits, 1, lo, hi), 2, (0,)))
    joined = top(b, b.cat(values, 1), 2, (0,))
    assert joined.term != top(b, logits, 2, (0,)).term


# --- remainder: take_along_dim wraps its indices by the dim's size ------------------------------
def remainder(b: Build, x: V, n: int) -> V:
    return b.op("aten.remainder.Scalar", x, attrs=((Operand(0), n), (), ()))


def test_the_remainder_of_an_argmax_by_its_dim_size_is_the_argmax():
    b = Build()
    x = b.leaf("x", (4, 5))
    position = b.op("argmax", x, attrs=((0,), False))
    wrapped = remainder(b, position, 4)
    b.check(wrapped)
    assert wrapped.term == position.term
    joined = b.cat([position, b.op("argmax", x, attrs=((1,), False))], 0)  # positions in [0, 4) and [0, 5)
    assert remainder(b, joined, 5).term == joined.term


def test_a_remainder_that_wraps_stays():
    b = Build()
    x = b.leaf("x", (4, 5))
    position = b.op("argmax", x, attrs=((0,), False))
    shifted = b.add(position, b.scalar(2, position.shape, torch.int64))  # in [2, 6)
    wrapped = remainder(b, shifted, 4)
    b.check(wrapped)
    assert wrapped.term != shifted.term
    assert remainder(b, position, 3).term != position.term  # an argmax over 4 rows may be 3
