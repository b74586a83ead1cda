"""Which part of a dim is a rank's own chunk (relations/diagnose/shards.py)."""

from __future__ import annotations

from shardproof.relations.diagnose.shards import _is_rank_chunk


def test_equal_chunks_are_the_ranks_own_modulo_their_count() -> None:
    assert _is_rank_chunk(1, (4, 8), (0, 8)) and _is_rank_chunk(3, (4, 8), (0, 8))
    assert not _is_rank_chunk(0, (4, 8), (0, 8))
    assert _is_rank_chunk(5, (0, 8), (0, 8))  # the whole is every rank's


def test_an_empty_part_is_no_ranks_chunk() -> None:
    """A rank whose head range came out empty (a wrong rank passed to the head split) holds [6:6):
    no rank's chunk, and no division by its zero width."""
    assert not _is_rank_chunk(0, (6, 6), (0, 12))
    assert _is_rank_chunk(0, (0, 0), (0, 0))
