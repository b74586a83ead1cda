"""Numeric tests of the position-range laws (`rules/aranges.py`) and of what they serve: a causal
mask built from a context-parallel rank's own positions (zigzag chunks r and 2W-1-r) is the rows
of the reference's mask, so the rank's masked scores are the rows of the reference's."""

from __future__ import annotations

import torch

from test_rules import Build, V


def _arange(b: Build, lo: int, hi: int) -> V:
    return V(b.r.const(("arange", lo, hi, 1), (hi - lo,), "int64"), torch.arange(lo, hi))


def test_a_slice_of_an_arange_is_an_arange() -> None:
    b = Build()
    part = b.sl(_arange(b, 0, 16), 0, 4, 9)
    b.check(part)
    assert part.term == _arange(b, 4, 9).term


def test_adjacent_aranges_are_one() -> None:
    b = Build()
    joined = b.cat([_arange(b, 0, 8), _arange(b, 8, 16)], 0)
    b.check(joined)
    assert joined.term == _arange(b, 0, 16).term
    apart = b.cat([_arange(b, 0, 4), _arange(b, 12, 16)], 0)
    b.check(apart)
    assert b.op_of(apart) == "cat"


def _mask(b: Build, positions: V, seq: int) -> V:
    """positions[:, None] < arange(seq)[None, :]: the keys each query may not see."""
    n = positions.shape[0]
    rows = b.expand(b.view(positions, (n, 1)), (n, seq))
    keys = b.expand(b.view(_arange(b, 0, seq), (1, seq)), (n, seq))
    return b.op("lt", rows, keys)


def test_a_zigzag_ranks_masked_scores_are_rows_of_the_references() -> None:
    seq, heads, world = 16, 2, 4
    chunk = seq // (2 * world)
    b = Build()
    scores = b.leaf("scores", (heads, seq, seq))
    reference = b.op("where", b.expand(b.view(_mask(b, _arange(b, 0, seq), seq), (1, seq, seq)), (heads, seq, seq)),
                     b.scalar(float("-inf"), (heads, seq, seq)), scores)
    b.check(reference)
    for rank in range(world):
        first, second = (rank * chunk, (rank + 1) * chunk), ((2 * world - 1 - rank) * chunk, (2 * world - rank) * chunk)
        positions = b.cat([_arange(b, *first), _arange(b, *second)], 0)
        mask = b.expand(b.view(_mask(b, positions, seq), (1, 2 * chunk, seq)), (heads, 2 * chunk, seq))
        rows = b.cat([b.sl(scores, 1, *first), b.sl(scores, 1, *second)], 1)
        masked = b.op("where", mask, b.scalar(float("-inf"), (heads, 2 * chunk, seq)), rows)
        b.check(masked)
        assert masked.term == b.cat([b.sl(reference, 1, *first), b.sl(reference, 1, *second)], 1).term


def test_where_with_a_zero_branch_takes_the_scale_out() -> None:
    """where(m, 0, c (x - y)) = c where(m, 0, x - y): a rank's gradient scaled by its share of the
    loss meets the reference's, scaled by the whole."""
    b = Build()
    x, y = b.leaf("x", (4, 6)), b.leaf("y", (4, 6))
    mask = _mask(b, _arange(b, 0, 4), 6)
    zero = b.scalar(0.0, (4, 6))
    half = b.scalar(0.5, (4, 6))
    masked = b.op("where", mask, zero, b.sub(b.op("mul", x, half), b.op("mul", y, half)))
    b.check(masked)
    assert masked.term == b.op("mul", b.op("where", mask, zero, b.sub(x, y)), half).term
