"""Which part of a dim is a rank's own chunk (relations/diagnose/shards.py)."""

from __future__ import annotations

from shardproof.relations.diagnose.shards import _is_rank_chunk
from shardproof.relations.diagnose.wrong_layout import LayoutFaults
from shardproof.relations.layout import box_along
from shardproof.relations.rules import Rules


def test_equal_chunks_are_the_ranks_own_modulo_their_count() -> None:
    assert _is_rank_chunk(1, (4, 8), (0, 8)) and _is_rank_chunk(3, (4, 8), (0, 8))
    assert not _is_rank_chunk(0, (4, 8), (0, 8))
    assert _is_rank_chunk(5, (0, 8), (0, 8))  # the whole is every rank's


def test_an_empty_part_is_no_ranks_chunk() -> None:
    """A rank whose head range came out empty (a wrong rank passed to the head split) holds [6:6):
    no rank's chunk, and no division by its zero width."""
    assert not _is_rank_chunk(0, (6, 6), (0, 12))
    assert _is_rank_chunk(0, (0, 0), (0, 0))


def test_consecutive_shards_stacked_along_a_new_axis_ahead_are_no_wrong_axis() -> None:
    """Sequence shards (2, 4, d) given a new axis and joined along it: ahead of the sequence
    (2, 1, 4, d) -> (2, 2, 4, d) is the whole, reshaped (XLA's all-gather of sequence shards);
    behind it (2, 4, 1, d) -> (2, 4, 2, d) interleaves the rows: the wrong axis."""
    class Probe(LayoutFaults):
        def __init__(self, rules: Rules) -> None:
            self.r = rules

    r = Rules()
    x = r.leaf("x", (2, 8, 3), "float32")
    shards = [r.slice(x, box_along((2, 8, 3), 1, 4 * i, 4 * i + 4)) for i in range(2)]
    ahead = r.cat([r.view(s, (2, 1, 4, 3)) for s in shards], 1)
    behind = r.cat([r.view(s, (2, 4, 1, 3)) for s in shards], 2)
    assert Probe(r)._wrong_axis(ahead) is None
    assert Probe(r)._wrong_axis(behind) == (2, 1)
    assert Probe(r)._wrong_axis(r.cat([r.view(s, (2, 1, 4, 3)) for s in reversed(shards)], 1)) == (1, 2)
