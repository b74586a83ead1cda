"""Numeric tests of the flash-attention backward laws (`rules/flash_backward.py`): the gradients of
causal attention recomputed from the output and the log-sum-exp, as flash and ring attention do,
are the reference's softmax backward (torch's decomposition of it, masked_fill's backward after)."""

from __future__ import annotations

import math

import pytest

from test_rules import Build, V
from test_rules_masked_keys import BLOCK, HEADS, NEG_INF, SEQ, _qkv, _triu
from test_rules_online_softmax import _logsumexp

SCALE = 0.5


def _masked_scores(b: Build, q: V, k: V, mask: V) -> V:
    shape = (HEADS, q.shape[1], k.shape[1])
    scores = b.op("mul", b.op("matmul", q, b.permute(k, (0, 2, 1))), b.scalar(SCALE, shape))
    return b.op("where", b.expand(b.view(mask, (1, *mask.shape)), shape), b.scalar(NEG_INF, shape), scores)


def _t(b: Build, x: V) -> V:
    return b.permute(x, (0, 2, 1))


def _reference_backward(b: Build, q: V, k: V, v: V, mask: V, grad_out: V) -> tuple[V, V, V]:
    """autograd of softmax(where(mask, -inf, q k^T * scale)) @ v, the softmax backward as torch
    decomposes it: dS = dP * P - P * sum(dP * P)."""
    scores = _masked_scores(b, q, k, mask)
    probs = b.op("softmax", scores, attrs=(2,))
    grad_v = b.op("matmul", _t(b, probs), grad_out)
    grad_probs = b.op("matmul", grad_out, _t(b, v))
    weighted = b.op("mul", grad_probs, probs)
    total = b.op("sum", weighted, attrs=((2,), True))
    grad_scores = b.sub(weighted, b.op("mul", probs, b.expand(total, probs.shape)))
    shape = grad_scores.shape
    grad_scores = b.op("where", b.expand(b.view(mask, (1, *mask.shape)), shape), b.scalar(0.0, shape), grad_scores)
    grad_scores = b.op("mul", grad_scores, b.scalar(SCALE, shape))
    return b.op("matmul", grad_scores, k), b.op("matmul", _t(b, grad_scores), q), grad_v


def _flash_backward(b: Build, q: V, k: V, v: V, mask: V, grad_out: V) -> tuple[V, V, V]:
    """The probabilities recomputed from the log-sum-exp, delta = rowsum(dO * O)."""
    scores = _masked_scores(b, q, k, mask)
    out = b.op("matmul", b.op("softmax", scores, attrs=(2,)), v)
    lse = _logsumexp(b, scores, 2)
    probs = b.op("exp", b.sub(scores, b.expand(b.view(lse, (*lse.shape, 1)), scores.shape)))
    delta = b.op("sum", b.op("mul", grad_out, out), attrs=((2,), True))
    grad_probs = b.op("matmul", grad_out, _t(b, v))
    grad_scores = b.sub(b.op("mul", probs, grad_probs), b.op("mul", probs, b.expand(delta, probs.shape)))
    scale = b.scalar(SCALE, (HEADS, q.shape[1], k.shape[2]))
    grad_q = b.op("mul", b.op("matmul", grad_scores, k), scale)
    grad_k = b.op("mul", b.op("matmul", _t(b, grad_scores), q), scale)
    return grad_q, grad_k, b.op("matmul", _t(b, probs), grad_out)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_flash_backward_of_causal_attention_is_the_reference_backward(which: str) -> None:
    b = Build()
    q, k, v = _qkv(b)
    grad_out = b.leaf("grad_out", q.shape)
    mask = _triu(b, SEQ, SEQ)
    expected = dict(zip("qkv", _reference_backward(b, q, k, v, mask, grad_out)))[which]
    got = dict(zip("qkv", _flash_backward(b, q, k, v, mask, grad_out)))[which]
    b.check(got)
    assert got.term == expected.term


def _ring_backward(b: Build, q: V, k: V, v: V, grad_out: V) -> tuple[list[V], list[V]]:
    """A causal ring's backward over blocks of BLOCK rows: rank r recomputes the probabilities of
    its own block (masked) and of each earlier block from the merged log-sum-exp of its rows, adds
    dS @ K to its dQ and dS^T @ Q to the gradient travelling with the block.
    Returns every rank's dQ and every block's dK (summed over the ranks that saw it)."""
    mask = _triu(b, SEQ, SEQ)
    whole = _masked_scores(b, q, k, mask)
    out = b.op("matmul", b.op("softmax", whole, attrs=(2,)), v)
    blocks = SEQ // BLOCK
    grad_q, grad_k = [], [[] for _ in range(blocks)]
    for rank in range(blocks):
        rows = lambda x, i=rank: b.sl(x, 1, i * BLOCK, (i + 1) * BLOCK)  # noqa: E731
        q_r, o_r, do_r = rows(q), rows(out), rows(grad_out)
        own = _masked_scores(b, q_r, rows(k), _triu(b, BLOCK, BLOCK))
        parts = [own] + [_scores(b, q_r, b.sl(k, 1, j * BLOCK, (j + 1) * BLOCK)) for j in range(rank)]
        stacked = b.cat([b.view(_logsumexp(b, s, 2), (1, HEADS, BLOCK)) for s in parts], 0)
        lse = _logsumexp(b, stacked, 0)
        delta = b.op("sum", b.op("mul", do_r, o_r), attrs=((2,), True))
        total = None
        for j, scores in zip([rank, *range(rank)], parts):
            k_j, v_j = (b.sl(x, 1, j * BLOCK, (j + 1) * BLOCK) for x in (k, v))
            probs = b.op("exp", b.sub(scores, b.expand(b.view(lse, (HEADS, BLOCK, 1)), scores.shape)))
            grad_probs = b.op("matmul", do_r, _t(b, v_j))
            grad_scores = b.sub(b.op("mul", probs, grad_probs), b.op("mul", probs, b.expand(delta, probs.shape)))
            part = b.op("mul", b.op("matmul", grad_scores, k_j), b.scalar(SCALE, q_r.shape))
            total = part if total is None else b.add(total, part)
            grad_k[j].append(b.op("mul", b.op("matmul", _t(b, grad_scores), q_r), b.scalar(SCALE, k_j.shape)))
        grad_q.append(total)
    return grad_q, [b.add(*parts) for parts in grad_k]


def _scores(b: Build, q: V, k: V) -> V:
    return b.op("mul", b.op("matmul", q, _t(b, k)), b.scalar(SCALE, (HEADS, q.shape[1], k.shape[1])))


def test_a_causal_ring_backward_is_the_reference_backward() -> None:
    """Each rank's dQ, and each block's dK summed round the ring, are rows of the reference's: a
    block's probabilities vanish for the keys and queries the mask hides, so the ranks' pieces of
    each contraction are the whole product."""
    b = Build()
    q, k, v = _qkv(b)
    grad_out = b.leaf("grad_out", q.shape)
    expected_q, expected_k, _ = _reference_backward(b, q, k, v, _triu(b, SEQ, SEQ), grad_out)
    grad_q, grad_k = _ring_backward(b, q, k, v, grad_out)
    for block, (dq, dk) in enumerate(zip(grad_q, grad_k)):
        b.check(dq)
        b.check(dk)
        assert dq.term == b.sl(expected_q, 1, block * BLOCK, (block + 1) * BLOCK).term
        assert dk.term == b.sl(expected_k, 1, block * BLOCK, (block + 1) * BLOCK).term
