"""Terms rebuilt under assumptions (`shardproof.relations.assume`): the rebuilt term must equal the
original on every input that satisfies the assumption."""

from __future__ import annotations

from fractions import Fraction

import torch
from hypothesis import given
from hypothesis import strategies as st

from shardproof.relations.assume import interval, rebuild
from test_rules import SETTINGS, Build


def _clamped_shift(b: Build, ids, lo: int, hi: int):
    shape = ids.shape
    shifted = b.sub(ids, b.scalar(lo, shape, torch.int64))
    low = b.op("maximum", shifted, b.scalar(0, shape, torch.int64))
    return shifted, b.op("minimum", low, b.scalar(hi - lo - 1, shape, torch.int64))


@SETTINGS
@given(st.integers(0, 6), st.integers(1, 6), st.integers(0, 2**16))
def test_a_clamp_the_range_decides_is_dropped(lo, width, seed):
    hi = lo + width
    b = Build()
    inside = torch.randint(lo, hi, (2, 3), generator=torch.Generator().manual_seed(seed))
    ids = b.leaf("ids", (2, 3), value=inside)
    shifted, clamped = _clamped_shift(b, ids, lo, hi)
    known = {ids.term: (Fraction(lo), Fraction(hi - 1))}
    assert interval(b.r, clamped.term, known) == (0, width - 1)
    assert rebuild(b.r, clamped.term, {}, known) == shifted.term
    torch.testing.assert_close(clamped.value, shifted.value)  # equal where the assumption holds


def test_a_clamp_without_known_ranges_stays():
    b = Build()
    ids = b.leaf("ids", (2, 3), value=torch.randint(0, 9, (2, 3)))
    _, clamped = _clamped_shift(b, ids, 2, 5)
    assert rebuild(b.r, clamped.term, {}, {}) == clamped.term
    assert interval(b.r, clamped.term, {}) is None


def test_a_replaced_mask_renormalizes_what_it_selects():
    b = Build()
    x, mask = b.leaf("x", (2, 3)), b.leaf("mask", (2, 3), value=torch.rand(2, 3) > 0.5)
    picked = b.op("where", mask, b.scalar(0.0, x.shape), b.op("exp", x))
    false = b.r.const(("full", False), x.shape, "bool")
    assert rebuild(b.r, picked.term, {mask.term: false}, {}) == b.op("exp", x).term
