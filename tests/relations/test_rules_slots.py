"""Numeric tests of the slot laws (`rules/slots.py`) and the range laws they lean on (`rules/masks.py`,
`rules/elementwise.py`): expert parallelism with sentinel slots, as transformers' RouterParallel and
batched_mm experts spell it. Every routing slot runs through the rank's block of the stacked expert
weights at its id renumbered into the block (the other ranks' ids sent to a sentinel, then clamped),
and its routing weight is zeroed outside the block. Each value is computed both ways, torch and
normalised term, and must agree; where a law promises a form, it is asserted.
The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import pytest
import torch

from shardproof.ir.aten_ops import Operand
from shardproof.relations.rules.slots import row_masked, tiled_sum
from shardproof.relations.rules.topk import TOPK
from test_rules import Build, V

TOKENS, EXPERTS, TOP_K, HIDDEN, WIDTH = 5, 8, 2, 3, 4
SLOTS = TOKENS * TOP_K


def _routing(b: Build) -> tuple[V, V]:
    """(ids, weights): each token's top-k experts and their probabilities."""
    probs = b.op("softmax", b.leaf("scores", (TOKENS, EXPERTS)), attrs=(1,))
    ids, weights = (b.op(TOPK, probs, attrs=((Operand(0), TOP_K, 1, True, True), (), (path,))) for path in (1, 0))
    return ids, weights


def _int(b: Build, value: int, shape: tuple[int, ...]) -> V:
    return b.scalar(value, shape, torch.int64)


def _sentinel_rank(b: Build, ids: V, weights: V, lo: int, hi: int) -> tuple[V, V, V]:
    """(flat slot ids clamped into the block, flat masked weights, sentinel test): RouterParallel's
    renumbering and the experts' masking of the sentinel slots."""
    n = hi - lo
    local = b.op("logical_and", b.op("ge", ids, _int(b, lo, ids.shape)), b.op("lt", ids, _int(b, hi, ids.shape)))
    renumbered = b.op("where", local, b.sub(ids, _int(b, lo, ids.shape)), _int(b, n, ids.shape))
    scores = b.op("where", b.op("logical_not", local), b.scalar(0.0, ids.shape), weights)
    flat = b.view(renumbered, (SLOTS,))
    sentinel = b.op("ge", flat, _int(b, n, (SLOTS,)))
    clamped = b.op("minimum", flat, _int(b, n - 1, (SLOTS,)))
    masked = b.op("where", sentinel, b.scalar(0.0, (SLOTS,)), b.view(scores, (SLOTS,)))
    return clamped, masked, sentinel


def _experts_rows(b: Build, stack: V, slot_ids: V) -> V:
    """`stack[slot_ids]`, as the lowering spells it: the embedding of the stack's rows flattened."""
    rows = b.op("embedding", b.view(stack, (stack.shape[0], HIDDEN * WIDTH)), slot_ids)
    return b.view(rows, (SLOTS, HIDDEN, WIDTH))


def _expert_out(b: Build, x: V, rows: V, weights: V) -> V:
    """silu(x_slot @ W[id]) weighted by the slot's routing weight (batched_mm's per-slot bmm)."""
    out = b.view(b.op("matmul", b.view(x, (SLOTS, 1, HIDDEN)), rows), (SLOTS, WIDTH))
    return b.op("mul", b.op("silu", out), b.expand(b.view(weights, (SLOTS, 1)), (SLOTS, WIDTH)))


def test_a_comparison_each_branch_of_a_where_decides_is_its_condition() -> None:
    """where(lo <= ids < hi, ids - lo, n) >= n, a sentinel test, is ids outside [lo, hi)."""
    b = Build()
    ids, weights = _routing(b)
    for lo, hi in ((0, 4), (4, 8), (2, 5)):
        _, _, sentinel = _sentinel_rank(b, ids, weights, lo, hi)
        b.check(sentinel)
        assert b.op_of(sentinel) == "view" and b.u[b.u[sentinel.term].args[0]].op == "logical_not"


def test_comparisons_and_clamps_the_range_of_top_k_positions_decides_fold() -> None:
    b = Build()
    ids, _ = _routing(b)
    for op, bound, value in (("ge", 0, True), ("lt", EXPERTS, True), ("ge", EXPERTS, False), ("lt", 0, False)):
        test = b.op(op, ids, _int(b, bound, ids.shape))
        b.check(test)
        assert b.r.full_value(test.term) is value
    clamped = b.op("minimum", ids, _int(b, EXPERTS - 1, ids.shape))
    b.check(clamped)
    assert clamped.term == ids.term
    assert b.op("minimum", ids, _int(b, 3, ids.shape)).term != ids.term  # a clamp that bites stays


@pytest.mark.parametrize("cuts", [(0, 4, 8), (0, 2, 4, 6, 8), tuple(range(9)), (0, 3, 8)])
def test_ranks_sentinel_slots_through_their_experts_sum_to_the_reference(cuts) -> None:
    """Each rank's slots through its block at the clamped renumbered ids, weighted by the masked
    weights: slot by slot the lookups are the whole stack's, and the ranks' masks sum to the weights."""
    b = Build()
    ids, weights = _routing(b)
    x, stack = b.leaf("x", (SLOTS, HIDDEN)), b.leaf("w", (EXPERTS, HIDDEN, WIDTH))
    ranks = []
    for lo, hi in zip(cuts, cuts[1:]):
        clamped, masked, _ = _sentinel_rank(b, ids, weights, lo, hi)
        ranks.append(_expert_out(b, x, _experts_rows(b, b.sl(stack, 0, lo, hi), clamped), masked))
        b.check(ranks[-1])
    total = b.add(*ranks)
    b.check(total)
    reference = _expert_out(b, x, _experts_rows(b, stack, b.view(ids, (SLOTS,))), b.view(weights, (SLOTS,)))
    torch.testing.assert_close(total.value, reference.value)
    assert total.term == reference.term


def test_a_value_that_mixes_slots_keeps_the_ranks_lookups() -> None:
    """Summed over the slots before the mask, a slot's value reads other slots' rows: no law applies."""
    b = Build()
    ids, weights = _routing(b)
    x, stack = b.leaf("x", (SLOTS, HIDDEN)), b.leaf("w", (EXPERTS, HIDDEN, WIDTH))
    clamped, masked, _ = _sentinel_rank(b, ids, weights, 0, 4)
    rows = _experts_rows(b, b.sl(stack, 0, 0, 4), clamped)
    out = b.view(b.op("matmul", b.view(x, (SLOTS, 1, HIDDEN)), rows), (SLOTS, WIDTH))
    pooled = b.expand(b.view(b.op("sum", out, attrs=((0,), False)), (1, WIDTH)), (SLOTS, WIDTH))
    weighted = b.op("mul", pooled, b.expand(b.view(masked, (SLOTS, 1)), (SLOTS, WIDTH)))
    b.check(weighted)
    assert "slice" in b.ops_in(weighted)  # still the rank's block


def test_ranks_masks_over_blocks_that_miss_ids_are_no_sum_of_the_whole() -> None:
    b = Build()
    ids, weights = _routing(b)
    masks = [_sentinel_rank(b, ids, weights, lo, hi)[1] for lo, hi in ((0, 4), (4, 6))]
    assert tiled_sum(b.r, [m.term for m in masks]) is None
    total = b.add(*masks)
    b.check(total)
    assert total.term != b.view(weights, (SLOTS,)).term


@pytest.mark.parametrize("cuts", [(0, 4, 8), tuple(range(9))])
def test_a_ranks_expert_gradient_through_its_one_hot_is_a_block_of_the_references(cuts) -> None:
    """The backward of `stack[slot_ids]`: the one-hot of the clamped renumbered ids, transposed,
    times the slots' gradient rows, which the masked weights zero outside the block (a block of one
    expert transposes its one column by a reshape)."""
    b = Build()
    ids, weights = _routing(b)
    x, grad, stack = b.leaf("x", (SLOTS, HIDDEN)), b.leaf("g", (SLOTS, WIDTH)), b.leaf("w", (EXPERTS, HIDDEN, WIDTH))
    flat_ids = b.view(ids, (SLOTS,))

    def expert_grad(slot_ids: V, slot_weights: V, table: V) -> V:
        rows = _experts_rows(b, table, slot_ids)
        out = b.view(b.op("matmul", b.view(x, (SLOTS, 1, HIDDEN)), rows), (SLOTS, WIDTH))
        weighted = b.op("mul", grad, b.expand(b.view(slot_weights, (SLOTS, 1)), (SLOTS, WIDTH)))
        grad_out = b.op("mul", weighted, b.op("sigmoid", out))  # a slot-by-slot factor of the rank's rows
        per_slot = b.op("matmul", b.permute(b.view(x, (SLOTS, 1, HIDDEN)), (0, 2, 1)), b.view(grad_out, (SLOTS, 1, WIDTH)))
        size = table.shape[0]
        hot = b.op("scatter_add", b.scalar(0.0, (SLOTS, size)), b.view(slot_ids, (SLOTS, 1)), b.scalar(1.0, (SLOTS, 1)), attrs=(1,))
        flat = b.op("matmul", b.permute(hot, (1, 0)), b.view(per_slot, (SLOTS, HIDDEN * WIDTH)))
        return b.view(flat, (size, HIDDEN, WIDTH))

    reference = expert_grad(flat_ids, b.view(weights, (SLOTS,)), stack)
    b.r.reference_size = len(b.u)
    for lo, hi in zip(cuts, cuts[1:]):
        clamped, masked, _ = _sentinel_rank(b, ids, weights, lo, hi)
        local = expert_grad(clamped, masked, b.sl(stack, 0, lo, hi))
        b.check(local)
        assert b.is_slice_of(local, reference) or (local.term == reference.term and (lo, hi) == (0, EXPERTS))


def test_rows_zeroed_by_a_per_row_test_read_as_the_test_and_the_rows() -> None:
    b = Build()
    ids, weights = _routing(b)
    _, masked, _ = _sentinel_rank(b, ids, weights, 2, 6)
    rows = b.op("mul", b.leaf("g", (SLOTS, WIDTH)), b.expand(b.view(masked, (SLOTS, 1)), (SLOTS, WIDTH)))
    keep, kept = row_masked(b.r, rows.term)
    inside = (ids.value >= 2) & (ids.value < 6)
    assert torch.equal(b.value_of(V(keep, inside)).reshape(-1), inside.reshape(-1))
    expected = rows.value
    torch.testing.assert_close(torch.where(inside.reshape(SLOTS, 1), b.value_of(V(kept, expected)), 0.0), expected)


def test_ranks_masks_laid_out_differently_are_no_sum_of_the_whole() -> None:
    """One rank's test broadcast along the rows, the other's along the columns: each element is kept
    by one rank, or by both or neither: no law applies."""
    b = Build()
    ids, weights = _routing(b)
    x = b.leaf("x", (SLOTS, SLOTS))
    masks = []
    for (lo, hi), dim in (((0, 4), 0), ((4, 8), 1)):
        sentinel = _sentinel_rank(b, ids, weights, lo, hi)[2]
        along = (SLOTS, 1) if dim == 0 else (1, SLOTS)
        masks.append(b.op("where", b.expand(b.view(sentinel, along), (SLOTS, SLOTS)), b.scalar(0.0, (SLOTS, SLOTS)), x))
    assert tiled_sum(b.r, [m.term for m in masks]) is None
    total = b.add(*masks)
    b.check(total)
    assert total.term != x.term


@pytest.mark.parametrize("context", ["added", "joined", "written"])
def test_ranks_masks_in_an_affine_context_are_no_sum_of_the_whole(context) -> None:
    """Each rank adds a shared term to its mask (or joins it to one, or writes into it): summed over
    ranks that term counts once per rank, so the context of the unmasked value is not the sum."""
    b = Build()
    ids, weights = _routing(b)
    shared = b.leaf("a", (SLOTS,))
    ranks = []
    for lo, hi in ((0, 4), (4, 8)):
        mask = _sentinel_rank(b, ids, weights, lo, hi)[1]
        if context == "added":
            ranks.append(b.add(shared, mask))
        elif context == "joined":
            ranks.append(b.cat([shared, mask], 0))
        else:
            ranks.append(b.op("scatter_add", shared, b.view(ids, (SLOTS,)), mask, attrs=(0,)))  # (ids < SLOTS)
    total = b.add(*ranks)
    b.check(total)
