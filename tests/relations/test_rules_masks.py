"""Numeric tests of the boolean-mask rules (how vLLM spells its vocab-parallel embedding) and of the
region rules for rotate-half rotary embeddings of a rank's heads. Each value is computed both
ways, torch and normalised term, and must agree; where a rule promises a form, it is asserted."""

from __future__ import annotations

import torch

from test_rules import Build, V

IDS = torch.tensor([0, 3, 5, 9, 11, 2, 7])


def _ids(b: Build) -> V:
    return b.leaf("ids", tuple(IDS.shape), value=IDS.clone())


def _range(b: Build, ids: V, lo: int, hi: int) -> V:
    """ids >= lo & ids < hi, as vLLM writes its vocabulary masks."""
    return b.op("logical_and", b.op("ge", ids, b.scalar(lo, ids.shape, torch.int64)), b.op("lt", ids, b.scalar(hi, ids.shape, torch.int64)))


def test_an_empty_range_mask_is_false_and_folds_away() -> None:
    b = Build()
    ids = _ids(b)
    empty = _range(b, ids, 12, 12)
    b.check(empty)
    assert b.r.full_value(empty.term) is False
    inside = _range(b, ids, 4, 8)
    either = b.op("logical_or", inside, empty)
    b.check(either)
    assert either.term == inside.term
    both = b.op("logical_and", inside, b.op("logical_not", empty))
    b.check(both)
    assert both.term == inside.term


def test_double_negation() -> None:
    b = Build()
    inside = _range(b, _ids(b), 4, 8)
    twice = b.op("logical_not", b.op("logical_not", inside))
    b.check(twice)
    assert twice.term == inside.term


def test_numbers_times_a_mask_are_masked_out_where_it_is_false() -> None:
    b = Build()
    ids = _ids(b)
    inside = _range(b, ids, 4, 8)
    scaled = b.op("mul", inside, b.scalar(5, ids.shape, torch.int64))
    masked = b.op("mul", inside, ids)
    b.check(scaled)
    b.check(masked)
    assert b.op_of(masked) == "where"


def test_where_reads_its_condition_in_each_branch() -> None:
    """vLLM's shifted ids: mask * (ids - start * mask) is ids - start where the mask holds."""
    b = Build()
    ids = _ids(b)
    inside = _range(b, ids, 4, 8)
    offset = b.op("mul", inside, b.scalar(4, ids.shape, torch.int64))
    shifted = b.op("mul", inside, b.sub(ids, offset))
    b.check(shifted)
    direct = b.op("mul", inside, b.sub(ids, b.scalar(4, ids.shape, torch.int64)))
    assert shifted.term == direct.term


def test_where_with_a_known_condition_is_a_branch() -> None:
    b = Build()
    ids = _ids(b)
    empty = _range(b, ids, 3, 3)
    x = b.leaf("x", ids.shape)
    y = b.leaf("y", ids.shape)
    picked = b.op("where", empty, x, y)
    b.check(picked)
    assert picked.term == y.term


def test_vllm_vocab_parallel_embedding_sums_to_the_lookup() -> None:
    """Each rank masks ids outside its rows [lo, hi), looks up its shard at ids - lo, zeroes the
    masked rows; the all-reduce (a sum) of the ranks is the full lookup."""
    b = Build()
    ids = _ids(b)
    weight = b.leaf("weight", (12, 3))
    reference = b.op("embedding", weight, ids)
    b.r.reference_size = len(b.u)
    parts = []
    for lo, hi in ((0, 6), (6, 12)):
        vocab = b.op("logical_or", _range(b, ids, lo, hi), _range(b, ids, 12, 12))  # no added vocabulary
        offset = b.op("mul", _range(b, ids, lo, hi), b.scalar(lo, ids.shape, torch.int64))
        local_ids = b.op("mul", vocab, b.sub(ids, offset))
        rows = b.op("embedding", b.sl(weight, 0, lo, hi), local_ids)
        hidden = b.expand(b.view(b.op("logical_not", vocab), (7, 1)), (7, 3))
        parts.append(b.op("where", hidden, b.scalar(0.0, (7, 3)), rows))
    total = b.add(*parts)
    b.check(total)
    assert total.term == reference.term


def test_rotate_half_of_a_ranks_heads_is_a_slice_of_the_references() -> None:
    """cat(x1*cos - x2*sin, x2*cos + x1*sin) on heads [h0, h1): a region of the reference's on all
    heads, also after a reshape that splits the heads."""
    b = Build()
    x = b.leaf("x", (5, 4, 6))  # tokens, heads, head dim
    cos, sin = b.leaf("cos", (5, 1, 3)), b.leaf("sin", (5, 1, 3))

    def rotate(heads: V) -> V:
        n = heads.shape[1]
        c, s = b.expand(cos, (5, n, 3)), b.expand(sin, (5, n, 3))
        x1, x2 = b.sl(heads, 2, 0, 3), b.sl(heads, 2, 3, 6)
        return b.cat([b.sub(b.op("mul", x1, c), b.op("mul", x2, s)), b.add(b.op("mul", x2, c), b.op("mul", x1, s))], 2)

    reference = rotate(x)
    grouped = b.view(reference, (5, 2, 2, 6))
    b.r.reference_size = len(b.u)
    rank = rotate(b.sl(x, 1, 2, 4))
    b.check(rank)
    regrouped = b.view(rank, (5, 1, 2, 6))
    b.check(regrouped)
    assert b.r.as_region(rank.term)[0] == reference.term
    assert b.r.as_region(regrouped.term) == (grouped.term, ((0, 5), (1, 2), (0, 2), (0, 6)))
