"""Numeric tests of the rules a vocab-parallel cross entropy's gradient needs: reductions of
constants, float constants read as the fractions they round, and Megatron's label-smoothed
backward on each rank's vocab shard against autograd's backward of the reference loss. Each value
is computed both ways, torch and normalised term, and must agree; where a rule promises a form,
it is asserted."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardproof.relations.rules import intended
from test_rules import SETTINGS, Build, V, column, labels, masked_local_ids, one_hot

N_TOKENS = 6  # (2, 3) tokens: the mean over them scales each token's gradient by 1/6


@pytest.mark.parametrize("op", ["sum", "amax"])
@pytest.mark.parametrize("dims,keepdim", [((2,), False), ((2,), True), ((0, 2), False)])
def test_reducing_a_constant_is_a_constant(op, dims, keepdim):
    b = Build()
    reduced = b.op(op, b.scalar(0.25, (2, 3, 5)), attrs=(dims, keepdim))
    b.check(reduced)
    assert b.r.full_value(reduced.term) is not None


@SETTINGS
@given(st.integers(-1000, 1000), st.integers(1, 1000), st.integers(1, 1000))
def test_a_float_constant_reads_as_the_simple_fraction_python_rounded(p, q, k):
    """p/q computed as (p * k / q) / k: rounded twice, read back as p/q."""
    value = p * k / q / k
    assert Fraction(intended(value)) == Fraction(p, q)


@SETTINGS
@given(st.floats(allow_nan=False, allow_infinity=False))
def test_every_float_constant_keeps_its_value_up_to_rounding(value):
    read = Fraction(intended(value))
    assert read == Fraction(value) or abs(read - Fraction(value)) <= 8 * Fraction(math.ulp(value))


def test_complementary_float_coefficients_add_up_to_one():
    """`1.0 - s` and `s` each rounded by Python, read back as the fractions the program meant."""
    b = Build()
    s = 0.1 * 16 / 15
    x = b.leaf("x", (2, 3))
    total = b.add(b.op("mul", x, b.scalar(1.0 - s, x.shape)), b.op("mul", x, b.scalar(s, x.shape)))
    b.check(total)
    assert total.term == x.term


def _softmax_rows(b: Build, logits: V) -> V:
    peak = b.expand(b.op("amax", logits, attrs=((2,), True)), logits.shape)
    powers = b.op("exp", b.sub(logits, peak))
    return b.op("div", powers, b.expand(b.op("sum", powers, attrs=((2,), True)), logits.shape))


def _reference_gradient(b: Build, logits: V, target: V, smoothing: float) -> V:
    """Autograd's gradient of mean((1 - s) * nll - s * mean(log_probs)) with respect to the logits:
    the gradient of the log-probs, then log_softmax's backward g - softmax * sum(g)."""
    vocab = logits.shape[-1]
    per_token = b.scalar(1.0 / N_TOKENS, target.shape)
    at_target = one_hot(b, target, b.op("mul", b.op("neg", per_token), b.scalar(1.0 - smoothing, target.shape)), vocab)
    spread = b.op("div", b.expand(column(b, b.op("mul", per_token, b.scalar(-smoothing, target.shape))), logits.shape),
                  b.scalar(vocab, logits.shape))
    grad = b.add(at_target, spread)
    probs = b.op("exp", b.op("log_softmax", logits, attrs=(2,)))
    return b.sub(grad, b.op("mul", probs, b.expand(b.op("sum", grad, attrs=((2,), True)), logits.shape)))


def _megatron_rank_gradient(b: Build, softmax: V, target: V, lo: int, hi: int, smoothing: float, vocab: int) -> V:
    """Megatron's backward on the [lo, hi) shard: grad[arange, masked_target] -= (1 - s) * (1 - mask),
    grad[arange, :] -= s / vocab, grad *= grad_output."""
    mask, local = masked_local_ids(b, target, lo, hi)
    update = b.sub(b.scalar(1.0, target.shape), b.op("convert", mask, attrs=("float64",)))
    here = b.view(b.op("gather", softmax, column(b, local), attrs=(2,)), target.shape)
    change = b.sub(here, b.op("mul", b.scalar(1.0 - smoothing, target.shape), update))
    grad = b.op("scatter", softmax, column(b, local), column(b, change), attrs=(2,))
    grad = b.sub(grad, b.scalar(smoothing / vocab, softmax.shape))
    return b.op("mul", grad, b.expand(column(b, b.scalar(1.0 / N_TOKENS, target.shape)), softmax.shape))


@pytest.mark.parametrize("vocab,cuts_", [(8, (0, 4, 8)), (12, (0, 3, 6, 9, 12)), (10, (0, 10))])
@pytest.mark.parametrize("alpha", [0.1, 0.0])
def test_label_smoothed_vocab_parallel_gradient_is_a_slice_of_the_reference_one(vocab, cuts_, alpha):
    b = Build()
    logits, target = b.leaf("logits", (2, 3, vocab)), labels(b, "target", (2, 3), vocab)
    smoothing = alpha * vocab / (vocab - 1)
    reference = _reference_gradient(b, logits, target, smoothing)
    b.check(reference)
    b.r.reference_size = len(b.u)
    shards = [b.sl(logits, 2, lo, hi) for lo, hi in zip(cuts_, cuts_[1:])]
    peak = b.max_over(*(b.op("amax", s, attrs=((2,), True)) for s in shards))
    powers = [b.op("exp", b.sub(s, b.expand(peak, s.shape))) for s in shards]
    total = b.add(*(b.op("sum", p, attrs=((2,), True)) for p in powers))
    for (lo, hi), p in zip(zip(cuts_, cuts_[1:]), powers):
        softmax = b.op("div", p, b.expand(total, p.shape))
        rank = _megatron_rank_gradient(b, softmax, target, lo, hi, smoothing, vocab)
        b.check(rank)
        assert rank.term == b.r.slice(reference.term, ((0, 2), (0, 3), (lo, hi)))


def test_a_local_vocab_size_in_the_smoothing_term_is_not_the_reference():
    """The buggy twin's spread s / (local vocab size): the terms must not meet."""
    b = Build()
    vocab, smoothing = 8, 0.1 * 8 / 7
    logits, target = b.leaf("logits", (2, 3, vocab)), labels(b, "target", (2, 3), vocab)
    reference = _reference_gradient(b, logits, target, smoothing)
    b.r.reference_size = len(b.u)
    shard = b.sl(logits, 2, 0, 4)
    softmax = b.op("div", b.op("exp", shard), b.expand(b.op("sum", b.op("exp", logits), attrs=((2,), True)), shard.shape))
    rank = _megatron_rank_gradient(b, softmax, target, 0, 4, smoothing, 4)
    b.check(rank)
    assert rank.term != b.r.slice(reference.term, ((0, 2), (0, 3), (0, 4)))
