"""Numeric tests of the box algebra in `shardproof.relations.layout`.

`reshape_groups` must split a reshape into groups of equal size that really are independent, and
`view_of_box` must only claim `view(X[box], dst) == view(X, G)[B]` when that holds on real tensors.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardproof.relations.layout import box_shape, compose, full_box, reshape_groups, source_box, view_of_box

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PRIMES = (2, 3, 5)


def _factors(n: int) -> list[int]:
    out = []
    for p in PRIMES:
        while n % p == 0:
            out.append(p)
            n //= p
    assert n == 1
    return out


@st.composite
def shapes(draw, min_dims: int = 1, max_dims: int = 4):
    return tuple(draw(st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=min_dims, max_size=max_dims)))


@st.composite
def reshapes_of(draw, shape: tuple[int, ...]):
    """A random shape with the same number of elements: prime factors, maybe shuffled, regrouped,
    with size-1 dims sprinkled in."""
    factors = [f for s in shape for f in _factors(s)]
    if draw(st.booleans()):
        factors = draw(st.permutations(factors))
    dims: list[int] = []
    for f in factors:
        if dims and draw(st.booleans()):
            dims[-1] *= f
        else:
            dims.append(f)
    for _ in range(draw(st.integers(0, 2))):
        dims.insert(draw(st.integers(0, len(dims))), 1)
    return tuple(dims)


@st.composite
def boxes(draw, shape: tuple[int, ...]):
    out = []
    for s in shape:
        lo = draw(st.integers(0, s - 1))
        hi = draw(st.integers(lo + 1, s))
        out.append((lo, hi))
    return tuple(out)


@st.composite
def aligned_boxes(draw, shape: tuple[int, ...]):
    """Boxes restricting only one dim (the common sharding case), often at block boundaries."""
    box = list(full_box(shape))
    d = draw(st.integers(0, len(shape) - 1))
    s = shape[d]
    divisors = [k for k in range(1, s + 1) if s % k == 0]
    block = draw(st.sampled_from(divisors))
    i = draw(st.integers(0, s // block - 1))
    j = draw(st.integers(i + 1, s // block))
    box[d] = (i * block, j * block)
    return tuple(box)


def _region(x: torch.Tensor, box) -> torch.Tensor:
    return x[tuple(slice(lo, hi) for lo, hi in box)]


# --- reshape_groups -------------------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_reshape_groups_partition_both_shapes_into_equal_products(data):
    src = data.draw(shapes())
    dst = data.draw(reshapes_of(src))
    groups = reshape_groups(src, dst)
    if groups is None:
        return
    assert sorted(d for gi, _ in groups for d in gi) == list(range(len(src)))
    assert sorted(d for _, gj in groups for d in gj) == list(range(len(dst)))
    for gi, gj in groups:
        assert gi == sorted(gi) and gj == sorted(gj)
        assert all(b == a + 1 for a, b in zip(gi, gi[1:])) and all(b == a + 1 for a, b in zip(gj, gj[1:]))
        assert math.prod(src[d] for d in gi) == math.prod(dst[d] for d in gj)
    # groups come in order: concatenating them walks both shapes front to back
    assert [d for gi, _ in groups for d in gi] == list(range(len(src)))
    assert [d for _, gj in groups for d in gj] == list(range(len(dst)))


def _flat(idx, shape) -> int:
    out = 0
    for i, s in zip(idx, shape):
        out = out * s + i
    return out


def _unflat(flat: int, shape) -> tuple[int, ...]:
    out = []
    for s in reversed(shape):
        out.append(flat % s)
        flat //= s
    return tuple(reversed(out))


@SETTINGS
@given(st.data())
def test_reshape_groups_are_independent_numerically(data):
    """Every element's source index follows from its destination index group by group: reshaping
    each group on its own is the whole reshape."""
    src = data.draw(shapes())
    dst = data.draw(reshapes_of(src))
    groups = reshape_groups(src, dst)
    if groups is None:
        return
    x = torch.randn(src, dtype=torch.float64)
    y = x.reshape(dst)
    for flat in range(math.prod(dst)):
        idx = _unflat(flat, dst)
        source = [0] * len(src)
        for gi, gj in groups:
            offset = _flat([idx[d] for d in gj], [dst[d] for d in gj])
            for d, i in zip(gi, _unflat(offset, [src[d] for d in gi])):
                source[d] = i
        assert y[idx] == x[tuple(source)]


def test_reshape_groups_examples():
    assert reshape_groups((6, 8), (6, 2, 4)) == [([0], [0]), ([1], [1, 2])]
    assert reshape_groups((2, 3, 4), (6, 4)) == [([0, 1], [0]), ([2], [1])]
    assert reshape_groups((4, 6), (6, 4)) == [([0, 1], [0, 1])]
    assert reshape_groups((3, 4), (3, 1, 4)) == [([0], [0]), ([], [1]), ([1], [2])]
    assert reshape_groups((2, 3), (7,)) is None


# --- view_of_box -------------------------------------------------------------------------------------
READINGS = [{}, {"ones_split": True}, {"ones_last": True}]  # view_of_box's readings: each must be sound


def _check_view_of_box(src, box, dst, **reading: bool) -> bool:
    found = view_of_box(src, box, dst, **reading)
    if found is None:
        return False
    g, b = found
    assert math.prod(g) == math.prod(src)
    assert box_shape(b) == tuple(dst)
    assert all(0 <= lo < hi <= s for (lo, hi), s in zip(b, g))
    x = torch.randn(src, dtype=torch.float64)
    torch.testing.assert_close(_region(x, box).reshape(dst), _region(x.reshape(g), b), rtol=0, atol=0)
    return True


@SETTINGS
@given(st.data(), st.sampled_from(READINGS))
def test_view_of_box_is_sound_on_random_boxes(data, reading):
    src = data.draw(shapes())
    box = data.draw(boxes(src))
    dst = data.draw(reshapes_of(box_shape(box)))
    _check_view_of_box(src, box, dst, **reading)


@SETTINGS
@given(st.data(), st.sampled_from(READINGS))
def test_view_of_box_is_sound_on_aligned_boxes(data, reading):
    src = data.draw(shapes())
    box = data.draw(aligned_boxes(src))
    dst = data.draw(reshapes_of(box_shape(box)))
    _check_view_of_box(src, box, dst, **reading)


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.data())
def test_view_of_box_finds_head_splits(batch, heads, head_dim, seq, data):
    """(b, s, H*d)[..., h0*d:h1*d] -> (b, s, h1-h0, d) is always found: heads h0:h1 of (b, s, H, d)."""
    h0 = data.draw(st.integers(0, heads - 1))
    h1 = data.draw(st.integers(h0 + 1, heads))
    src = (batch, seq, heads * head_dim)
    box = ((0, batch), (0, seq), (h0 * head_dim, h1 * head_dim))
    dst = (batch, seq, h1 - h0, head_dim)
    assert _check_view_of_box(src, box, dst, ones_split=False)
    g, b = view_of_box(src, box, dst)
    if head_dim > 1 and h1 - h0 > 1:
        assert g == (batch, seq, heads, head_dim) and b[2] == (h0, h1)


@SETTINGS
@given(st.integers(2, 4), st.integers(1, 3), st.integers(1, 3), st.data())
def test_view_of_box_finds_merges_of_an_outer_range(a, m, n, data):
    lo = data.draw(st.integers(0, a - 1))
    hi = data.draw(st.integers(lo + 1, a))
    src, box = (a, m, n), ((lo, hi), (0, m), (0, n))
    for dst in (((hi - lo) * m * n,), ((hi - lo) * m, n)):
        assert _check_view_of_box(src, box, dst, ones_split=False)


def test_view_of_box_head_split_with_a_size_one_dim():
    """(s, 4) -> (s, 1, 4) of columns [36:40): head 9 of (s, 12, 4) with ones_split, a column range
    of (s, 1, 48) without; both are true."""
    src, box, dst = (3, 48), ((0, 3), (36, 40)), (3, 1, 4)
    assert view_of_box(src, box, dst, ones_split=True) == ((3, 12, 4), ((0, 3), (9, 10), (0, 4)))
    assert view_of_box(src, box, dst) == ((3, 1, 48), ((0, 3), (0, 1), (36, 40)))
    assert _check_view_of_box(src, box, dst, ones_split=True)
    assert _check_view_of_box(src, box, dst, ones_split=False)


def test_view_of_box_ones_last_pairs_size_one_dims_from_the_end():
    """One head of a batch of one: the batch is the size-1 dim dropped, or added, not the head."""
    src, box, dst = (1, 6, 4, 3), ((0, 1), (2, 3), (0, 4), (0, 3)), (1, 4, 3)
    assert view_of_box(src, box, dst, ones_last=True) == ((6, 4, 3), ((2, 3), (0, 4), (0, 3)))
    assert view_of_box(src, box, dst) == ((1, 24, 3), ((0, 1), (8, 12), (0, 3)))
    src, box, dst = (6, 4, 4), ((2, 3), (0, 4), (0, 4)), (1, 1, 4, 4)
    assert view_of_box(src, box, dst, ones_last=True) == ((1, 6, 4, 4), ((0, 1), (2, 3), (0, 4), (0, 4)))
    assert view_of_box(src, box, dst) == ((6, 1, 4, 4), ((2, 3), (0, 1), (0, 4), (0, 4)))


def test_view_of_box_one_selected_row_moves_to_a_size_one_dim():
    src, box, dst = (5, 6), ((2, 3), (0, 6)), (1, 2, 3)
    assert _check_view_of_box(src, box, dst, ones_split=False)
    assert view_of_box(src, box, dst) == ((5, 2, 3), ((2, 3), (0, 2), (0, 3)))


def test_view_of_box_refuses_what_is_not_a_box():
    # an inner dim restricted before a merge: the elements are not contiguous in the merged dim
    assert view_of_box((4, 6), ((0, 4), (0, 3)), (12,)) is None
    # a split not aligned to the inner destination size
    assert view_of_box((12,), ((0, 6),), (3, 2)) == ((6, 2), ((0, 3), (0, 2)))
    assert view_of_box((12,), ((1, 7),), (3, 2)) is None


# --- compose ----------------------------------------------------------------------------------------------
@SETTINGS
@given(st.data())
def test_compose_is_slice_of_slice(data):
    src = data.draw(shapes())
    outer = data.draw(boxes(src))
    inner = data.draw(boxes(box_shape(outer)))
    x = torch.randn(src, dtype=torch.float64)
    torch.testing.assert_close(_region(_region(x, outer), inner), _region(x, compose(outer, inner)), rtol=0, atol=0)


@pytest.mark.parametrize("src, dst, box, expected", [
    ((2, 54), (108,), ((0, 48),), ((0, 1), (0, 48))),  # one parameter's chunk of rank 0's row
    ((2, 54), (108,), ((54, 102),), ((1, 2), (0, 48))),  # of rank 1's row
    ((2, 54), (108,), ((48, 60),), None),  # across two rows: no box
    ((2, 3, 4), (24,), ((12, 24),), ((1, 2), (0, 3), (0, 4))),
    ((2, 3, 4), (6, 4), ((3, 5), (1, 4)), ((1, 2), (0, 2), (1, 4))),
    ((2, 0), (0,), ((0, 0),), None),  # empty
])
def test_source_box_is_the_box_a_view_s_box_reads(src, dst, box, expected) -> None:
    assert source_box(src, dst, box) == expected
    if expected is not None:
        x = torch.arange(math.prod(src)).reshape(src)
        read = x.reshape(dst)[tuple(slice(lo, hi) for lo, hi in box)]
        inner = x[tuple(slice(lo, hi) for lo, hi in expected)]
        assert torch.equal(read, inner.reshape(read.shape))
