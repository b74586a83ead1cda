"""Numeric tests of the log-sum-exp normal form and of the online-softmax merge law
(`rules/online_softmax.py`): attention over key blocks joined is the merge of the blocks'
attentions by log-sum-exp, whatever the order of the blocks, merged at once or one by one."""

from __future__ import annotations

import math

import pytest
import torch

from test_rules import Build, V

HEADS, QUERIES, KEYS, DIM = 2, 3, 12, 4


def _logsumexp(b: Build, x: V, dim: int) -> V:
    """torch.logsumexp as torch decomposes it: the max, guarded against infinities, shifts the exp."""
    shape = x.shape
    row = tuple(1 if d == dim else s for d, s in enumerate(shape))
    peak = b.op("amax", x, attrs=((dim,), True))
    infinite = b.op("eq", b.op("abs", peak), b.scalar(math.inf, row))
    shift = b.op("where", infinite, b.scalar(0.0, row), peak)
    total = b.op("sum", b.op("exp", b.sub(x, b.expand(shift, shape))), attrs=((dim,), False))
    return b.add(b.op("log", total), b.view(shift, tuple(s for d, s in enumerate(shape) if d != dim)))


def _block(b: Build, q: V, k: V, v: V) -> tuple[V, V]:
    """(softmax(s) @ v, logsumexp(s)) of one key block, s = q k^T / sqrt(d)."""
    scores = b.op("mul", b.op("matmul", q, b.permute(k, (0, 2, 1))), b.scalar(1 / math.sqrt(DIM), (HEADS, QUERIES, k.shape[1])))
    return b.op("matmul", b.op("softmax", scores, attrs=(2,)), v), _logsumexp(b, scores, 2)


def _merge(b: Build, out: V, lse: V, block_out: V, block_lse: V) -> tuple[V, V]:
    """The ring step: the new log-sum-exp of the two, each output weighted by exp(its lse - new)."""
    stacked = b.cat([b.view(lse, (1, *lse.shape)), b.view(block_lse, (1, *lse.shape))], 0)
    new = _logsumexp(b, stacked, 0)
    weight = lambda l: b.expand(b.view(b.op("exp", b.sub(l, new)), (*lse.shape, 1)), out.shape)  # noqa: E731
    return b.add(b.op("mul", weight(lse), out), b.op("mul", weight(block_lse), block_out)), new


def test_logsumexp_as_torch_decomposes_it_is_one_term() -> None:
    b = Build()
    x = b.leaf("x", (3, 5))
    lse = _logsumexp(b, x, 1)
    b.check(lse)
    assert b.op_of(lse) == "logsumexp"
    assert lse.term == b.op("logsumexp", x, attrs=(1,)).term


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1), (1, 2, 0)])
def test_merging_key_blocks_by_logsumexp_is_attention_over_all_keys(order: tuple[int, ...]) -> None:
    """Blocks merged one by one (a ring step each), in any order, give the attention and the
    log-sum-exp over the keys of all of them."""
    b = Build()
    q, k, v = b.leaf("q", (HEADS, QUERIES, DIM)), b.leaf("k", (HEADS, KEYS, DIM)), b.leaf("v", (HEADS, KEYS, DIM))
    whole_out, whole_lse = _block(b, q, k, v)
    cuts = [(0, 4), (4, 8), (8, 12)]
    blocks = [_block(b, q, b.sl(k, 1, *cuts[i]), b.sl(v, 1, *cuts[i])) for i in order]
    out, lse = blocks[0]
    for block_out, block_lse in blocks[1:]:
        out, lse = _merge(b, out, lse, block_out, block_lse)
    b.check(out)
    b.check(lse)
    assert out.term == whole_out.term
    assert lse.term == whole_lse.term
    assert any("finite" in a for a in b.r.assumptions)


def test_a_merge_with_a_stale_logsumexp_is_not_attention() -> None:
    """The law holds only with the merged log-sum-exp: a third block merged against the first
    block's (not updated after the second) stays apart, and the numbers differ."""
    b = Build()
    q, k, v = b.leaf("q", (HEADS, QUERIES, DIM)), b.leaf("k", (HEADS, KEYS, DIM)), b.leaf("v", (HEADS, KEYS, DIM))
    whole_out, _ = _block(b, q, k, v)
    blocks = [_block(b, q, b.sl(k, 1, lo, lo + 4), b.sl(v, 1, lo, lo + 4)) for lo in (0, 4, 8)]
    out, lse = blocks[0]
    out, _ = _merge(b, out, lse, *blocks[1])
    out, _ = _merge(b, out, lse, *blocks[2])
    b.check(out)
    assert out.term != whole_out.term
    assert not torch.allclose(out.value, whole_out.value)


def test_a_logsumexp_with_its_rows_permuted_is_that_of_the_scores_rows_permuted() -> None:
    b = Build()
    x = b.leaf("x", (HEADS, QUERIES, KEYS))
    rows_first = b.permute(_logsumexp(b, x, 2), (1, 0))
    b.check(rows_first)
    assert rows_first.term == b.op("logsumexp", b.permute(x, (1, 0, 2)), attrs=(2,)).term


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_merging_with_the_logsumexp_kept_as_queries_by_heads_is_attention_over_all_keys(order: tuple[int, ...]) -> None:
    """The ring flash-attention ports' merge: each block's (heads, queries) log-sum-exp transposed
    to (queries, heads), merged so, and the weights transposed back to weigh the outputs."""
    b = Build()
    q, k, v = b.leaf("q", (HEADS, QUERIES, DIM)), b.leaf("k", (HEADS, KEYS, DIM)), b.leaf("v", (HEADS, KEYS, DIM))
    whole_out, whole_lse = _block(b, q, k, v)
    blocks = [_block(b, q, b.sl(k, 1, 4 * i, 4 * i + 4), b.sl(v, 1, 4 * i, 4 * i + 4)) for i in order]
    out, lse = blocks[0][0], b.permute(blocks[0][1], (1, 0))
    for block_out, block_lse in blocks[1:]:
        block_lse = b.permute(block_lse, (1, 0))
        new = _logsumexp(b, b.cat([b.view(lse, (1, QUERIES, HEADS)), b.view(block_lse, (1, QUERIES, HEADS))], 0), 0)
        weight = lambda l: b.expand(b.view(b.permute(b.op("exp", b.sub(l, new)), (1, 0)), (HEADS, QUERIES, 1)), out.shape)  # noqa: E731
        out, lse = b.add(b.op("mul", weight(lse), out), b.op("mul", weight(block_lse), block_out)), new
    b.check(out)
    b.check(lse)
    assert out.term == whole_out.term
    assert lse.term == b.permute(whole_lse, (1, 0)).term
