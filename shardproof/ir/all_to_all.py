"""`all_to_all` (c10d's `all_to_all_single`): what each member of the group receives.

Member p of the group splits its input along dim 0 into one piece per member, `input_splits[j]`
rows for member j, and receives, concatenated along dim 0 in group order, piece p of every
member's input: output piece j on member p is input piece p on member j. The pieces only move, so
the inverse all_to_all (the split lists swapped) puts every row back. Both executors (the
symbolic one in relations/execute.py, the numeric one in ir/run.py) and the shape check read
this one definition.

Every member must receive exactly what is sent to it: `output_splits[j]` on member p must be
`input_splits[p]` on member j. Otherwise a real run fails, hangs or reads the wrong rows;
`mismatched_splits` names the first pair that disagrees.
"""

from __future__ import annotations

from typing import Sequence

Splits = tuple[int, ...]


def even_splits(rows: int, members: int) -> Splits:
    """The split an empty split list means: dim 0 cut into equal pieces."""
    return (rows // members,) * members


def pieces(input_splits: Sequence[Splits], position: int) -> list[tuple[int, int, int]]:
    """(member j, first row, end row) of each piece of member j's input that the member at
    `position` receives, in group order (`input_splits[j]`: member j's input splits)."""
    found = []
    for j, splits in enumerate(input_splits):
        start = sum(splits[:position])
        found.append((j, start, start + splits[position]))
    return found


def mismatched_splits(input_splits: Sequence[Splits], output_splits: Sequence[Splits]) -> tuple[int, int] | None:
    """(receiver p, sender j) of the first piece member p expects in another size than member j
    sends it; None when every member receives what is sent to it."""
    members = len(input_splits)
    for p in range(members):
        for j in range(members):
            if len(output_splits[p]) != members or len(input_splits[j]) != members or output_splits[p][j] != input_splits[j][p]:
                return p, j
    return None
