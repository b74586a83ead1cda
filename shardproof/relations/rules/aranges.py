"""Position ranges: a slice of `arange` is an `arange`, two adjacent ones are one, and every
`arange` is a slice of a longer one. A rank of a context-parallel model builds its positions as
aranges over its own chunks (a zigzag rank holds chunks r and 2W-1-r); these laws let its causal
mask, built from them, meet the rows of the reference's mask built from `arange(seq)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.relations.layout import Box

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


def _start_step(r: Rules, t: int) -> tuple[int, int] | None:
    """(start, step) of a 1-D integer arange constant."""
    term = r.u[t]
    if term.op != "const" or term.attrs[0] != "arange" or len(term.shape) != 1:
        return None
    start, _, step = term.attrs[1:]
    if not (isinstance(start, int) and isinstance(step, int)):
        return None
    return start, step


def _arange(r: Rules, start: int, size: int, step: int, dtype: str) -> int:
    return r.const(("arange", start, start + size * step, step), (size,), dtype)


def sliced(r: Rules, t: int, box: Box) -> int | None:
    """arange(a, b, s)[lo:hi] = arange(a + lo*s, a + hi*s, s)."""
    found = _start_step(r, t)
    if found is None:
        return None
    (lo, hi), (start, step) = box[0], found
    return _arange(r, start + lo * step, hi - lo, step, r.u[t].dtype)


def joined(r: Rules, a: int, b: int) -> int | None:
    """arange(x, y, s) followed by arange(y, z, s) is arange(x, z, s)."""
    first, second = _start_step(r, a), _start_step(r, b)
    if first is None or second is None or first[1] != second[1] or r.u[a].dtype != r.u[b].dtype:
        return None
    size = r.shape(a)[0]
    if first[0] + size * first[1] != second[0]:
        return None
    return _arange(r, first[0], size + r.shape(b)[0], first[1], r.u[a].dtype)


def widened(r: Rules, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
    """The arange X of `global_shape` with X[box] == t: the same progression, extended both ways."""
    found = _start_step(r, t)
    if found is None or len(global_shape) != 1:
        return None
    (start, step), lo = found, box[0][0]
    return _arange(r, start - lo * step, global_shape[0], step, r.u[t].dtype)
