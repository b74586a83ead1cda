"""Numeric tests of the laws of keys a mask hides (`rules/masked_keys.py`): a constant mask decided
over a region by the ranges it compares, the attention of the keys a causal mask leaves equal to the
whole row's, blocks no key of which is masked joined with masked ones, and a causal ring (the blocks
the mask hides skipped, the others merged by log-sum-exp) equal to causal attention."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from shardproof.relations.rules import masked_keys
from test_rules import Build, V
from test_rules_online_softmax import _logsumexp, _merge

HEADS, SEQ, DIM, BLOCK = 2, 12, 4, 4
NEG_INF = float("-inf")


def _triu(b: Build, rows: int, cols: int, diagonal: int = 1) -> V:
    """torch.ones(rows, cols, dtype=bool).triu(diagonal): the keys a query may not see."""
    return b.op("triu", b.scalar(True, (rows, cols), torch.bool), attrs=(diagonal,))


def _later(b: Build, q_lo: int, k_lo: int) -> V:
    """positions[:, None] < key_positions[None, :] over a block of queries and one of keys."""
    q = b.view(V(b.r.const(("arange", q_lo, q_lo + BLOCK, 1), (BLOCK,), "int64"), torch.arange(q_lo, q_lo + BLOCK)), (BLOCK, 1))
    k = b.view(V(b.r.const(("arange", k_lo, k_lo + BLOCK, 1), (BLOCK,), "int64"), torch.arange(k_lo, k_lo + BLOCK)), (1, BLOCK))
    return b.op("lt", b.expand(q, (BLOCK, BLOCK)), b.expand(k, (BLOCK, BLOCK)))


def _scores(b: Build, q: V, k: V, mask: V | None) -> V:
    """q k^T / sqrt(d), -inf where `mask` is True."""
    shape = (HEADS, q.shape[1], k.shape[1])
    scores = b.op("mul", b.op("matmul", q, b.permute(k, (0, 2, 1))), b.scalar(1 / math.sqrt(DIM), shape))
    if mask is None:
        return scores
    return b.op("where", b.expand(b.view(mask, (1, *mask.shape)), shape), b.scalar(NEG_INF, shape), scores)


def _attention(b: Build, scores: V, v: V) -> tuple[V, V]:
    return b.op("matmul", b.op("softmax", scores, attrs=(2,)), v), _logsumexp(b, scores, 2)


def _qkv(b: Build) -> tuple[V, V, V]:
    return tuple(b.leaf(name, (HEADS, SEQ, DIM)) for name in "qkv")


def _rows(b: Build, x: V, block: int) -> V:
    return b.sl(x, 1, block * BLOCK, (block + 1) * BLOCK)


@pytest.mark.parametrize(("rows", "keys", "diagonal"), [((0, 4), (0, 4), 1), ((4, 8), (0, 8), 5), ((4, 8), (0, 12), 5)])
def test_causal_attention_of_a_block_of_rows_is_over_their_visible_keys(rows, keys, diagonal) -> None:
    """Rows of causal attention over 12 keys see only the keys up to their own: the attention of
    those alone (masked by the rows' own triangle) is the whole's."""
    b = Build()
    q, k, v = _qkv(b)
    whole, _ = _attention(b, _scores(b, q, k, _triu(b, SEQ, SEQ)), v)
    k_part, v_part = (b.sl(x, 1, *keys) for x in (k, v))
    mask = _triu(b, rows[1] - rows[0], keys[1] - keys[0], diagonal)
    local, _ = _attention(b, _scores(b, b.sl(q, 1, *rows), k_part, mask), v_part)
    b.check(local)
    assert local.term == b.sl(whole, 1, *rows).term
    assert masked_keys.VISIBLE_ROWS in b.r.assumptions or keys == (0, 12)


def test_keys_a_mask_hides_only_in_part_are_not_dropped() -> None:
    """Rows [4, 8) see key 4 to 7 in part: attention over keys [0, 4) alone is not the whole's."""
    b = Build()
    q, k, v = _qkv(b)
    whole, _ = _attention(b, _scores(b, q, k, _triu(b, SEQ, SEQ)), v)
    local, _ = _attention(b, _scores(b, _rows(b, q, 1), _rows(b, k, 0), None), _rows(b, v, 0))
    b.check(local)
    assert local.term != b.sl(whole, 1, 4, 8).term
    assert not torch.allclose(local.value, b.sl(whole, 1, 4, 8).value)


@pytest.mark.parametrize(("q_block", "k_block"), list(itertools.product(range(3), repeat=2)))
def test_a_mask_of_positions_is_decided_over_blocks_by_their_ranges(q_block: int, k_block: int) -> None:
    b = Build()
    later = _later(b, q_block * BLOCK, k_block * BLOCK)
    whole = (0, BLOCK), (0, BLOCK)
    expected = True if k_block > q_block else False if k_block < q_block else None
    assert masked_keys.truth(b.r, later.term, whole) is expected
    assert expected is None or bool(later.value.all() if expected else not later.value.any())
    triangle = _triu(b, SEQ, SEQ)
    box = ((q_block * BLOCK, (q_block + 1) * BLOCK), (k_block * BLOCK, (k_block + 1) * BLOCK))
    assert masked_keys.truth(b.r, triangle.term, box) is expected


def _ring(b: Build, q: V, k: V, v: V, rank: int, visible) -> V:
    """Rank `rank`'s queries (block `rank`) over the key blocks of ranks rank, rank - 1, ...: its
    own masked by the triangle, the ones `visible` keeps unmasked, merged by log-sum-exp."""
    q_r = _rows(b, q, rank)
    out, lse = _attention(b, _scores(b, q_r, _rows(b, k, rank), _triu(b, BLOCK, BLOCK)), _rows(b, v, rank))
    for step in range(1, SEQ // BLOCK):
        source = (rank - step) % (SEQ // BLOCK)
        if visible(source, rank):
            block = _attention(b, _scores(b, q_r, _rows(b, k, source), None), _rows(b, v, source))
            out, lse = _merge(b, out, lse, *block)
    return out


@pytest.mark.parametrize("rank", range(3))
def test_a_causal_ring_is_causal_attention(rank: int) -> None:
    """The blocks of later positions skipped, the earlier ones unmasked, merged in ring order."""
    b = Build()
    q, k, v = _qkv(b)
    whole, _ = _attention(b, _scores(b, q, k, _triu(b, SEQ, SEQ)), v)
    out = _ring(b, q, k, v, rank, lambda source, rank: source < rank)
    b.check(out)
    assert out.term == _rows(b, whole, rank).term


def test_a_causal_ring_that_skips_a_visible_block_is_not_causal_attention() -> None:
    b = Build()
    q, k, v = _qkv(b)
    whole, _ = _attention(b, _scores(b, q, k, _triu(b, SEQ, SEQ)), v)
    out = _ring(b, q, k, v, 2, lambda source, rank: source == rank - 1)
    b.check(out)
    assert out.term != _rows(b, whole, 2).term


def test_a_block_the_mask_hides_entirely_is_not_merged() -> None:
    """Its softmax is over no key (NaN in torch), not nothing: the merge law does not take it."""
    b = Build()
    q, k, v = _qkv(b)
    later = _scores(b, _rows(b, q, 0), _rows(b, k, 1), _later(b, 0, BLOCK))
    assert masked_keys.hidden(b.r, later.term, ((0, HEADS), (0, BLOCK), (0, BLOCK)))
    own = _attention(b, _scores(b, _rows(b, q, 0), _rows(b, k, 0), _triu(b, BLOCK, BLOCK)), _rows(b, v, 0))
    out, _ = _merge(b, *own, *_attention(b, later, _rows(b, v, 1)))
    assert torch.isnan(out.value).all()
    assert b.r.u[out.term].op == "lin"
