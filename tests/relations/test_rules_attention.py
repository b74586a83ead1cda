"""Numeric tests of the rules that relate head-parallel attention written the Megatron way (batch
and heads flattened into one bmm batch, q/k/v split from one fused per-head projection): reshapes
of a batched matmul's batch dims, reshapes of slices restricted on a merged inner dim, and
matmuls over regions the reference sliced out. Each builds the reference and a rank's share both
ways (torch and normalised terms), checks the values, and checks the rank's term is a slice of
the reference's."""

from __future__ import annotations

from test_rules import Build


def test_view_of_a_batched_matmul_reshapes_its_operands_batch() -> None:
    b = Build()
    x = b.leaf("x", (6, 3, 4))
    y = b.leaf("y", (6, 4, 5))
    flat = b.view(b.op("matmul", x, y), (2, 3, 3, 5))
    direct = b.op("matmul", b.view(x, (2, 3, 3, 4)), b.view(y, (2, 3, 4, 5)))
    b.check(flat)
    assert flat.term == direct.term


def test_view_of_a_batched_matmul_with_a_broadcast_operand_stays_literal() -> None:
    b = Build()
    x = b.leaf("x", (6, 3, 4))
    w = b.leaf("w", (4, 5))
    out = b.view(b.op("matmul", x, w), (2, 3, 3, 5))
    b.check(out)


def test_view_merging_a_slice_restricted_on_the_inner_dim() -> None:
    """v columns [6:9] of a fused per-head projection, heads merged: the rank's heads [0:2] are
    a slice of the reference's merge of the same columns."""
    b = Build()
    fused = b.leaf("fused", (4, 3, 9))  # (tokens, heads, q|k|v per head)
    reference = b.view(b.sl(fused, 2, 6, 9), (4, 9))
    rank = b.view(b.box(fused, ((0, 4), (0, 2), (6, 9))), (4, 6))
    b.check(reference)
    b.check(rank)
    assert b.is_slice_of(rank, reference)


def _attention(b: Build, qkv, heads: tuple[int, int], batch: int, seq: int, head_dim: int):
    """Megatron's core attention on heads [h0:h1] of a fused [seq, batch, heads, 3*head_dim]."""
    h0, h1 = heads
    local = b.box(qkv, ((0, seq), (0, batch), (h0, h1), (0, 3 * head_dim)))
    q, k, v = (b.sl(local, 3, i * head_dim, (i + 1) * head_dim) for i in range(3))
    n = h1 - h0
    q = b.permute(b.view(q, (seq, batch * n, head_dim)), (1, 0, 2))
    k = b.permute(b.view(k, (seq, batch * n, head_dim)), (1, 2, 0))
    scores = b.view(b.op("matmul", q, k), (batch, n, seq, seq))
    probs = b.op("softmax", scores, attrs=(3,))
    v = b.permute(b.view(v, (seq, batch * n, head_dim)), (1, 0, 2))
    context = b.view(b.op("matmul", b.view(probs, (batch * n, seq, seq)), v), (batch, n, seq, head_dim))
    return scores, b.view(b.permute(context, (2, 0, 1, 3)), (seq, batch, n * head_dim))


def test_a_ranks_heads_of_flattened_attention_are_slices_of_the_reference() -> None:
    b = Build()
    qkv = b.leaf("qkv", (3, 2, 4, 6))
    ref_scores, ref_context = _attention(b, qkv, (0, 4), batch=2, seq=3, head_dim=2)
    b.r.reference_size = len(b.u)
    rank_scores, rank_context = _attention(b, qkv, (2, 4), batch=2, seq=3, head_dim=2)
    for value in (ref_scores, ref_context, rank_scores, rank_context):
        b.check(value)
    assert b.is_slice_of(rank_scores, ref_scores)
    assert b.is_slice_of(rank_context, ref_context)
