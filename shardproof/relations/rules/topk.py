"""Top-k split over ranks: the top k of a shard of an axis is a `top_piece` of the top k of the whole
axis, and the top k of the ranks' candidates joined along the axis is the top k over the union of
their shards (top-k sampling over vocab-parallel logits).

The values are exact, ties included: the k largest values of a union are the k largest of the
parts' k largest. Which of several tied entries torch's topk returns is unspecified, so the
positions are the reference's where the top k values are distinct; `Rules.assumptions` records
that a proof used this.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from typing import TYPE_CHECKING

from shardproof.ir.aten_ops import Operand, argument, overload
from shardproof.relations.rules.open_linear import by_blocks

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

TOPK = "aten.topk.default"
VALUES, POSITIONS = (0,), (1,)  # the output paths of torch.topk
DISTINCT = ("top-k positions: equal to the reference's where the top k values are distinct (torch leaves "
            "the order of tied values unspecified); the values themselves are proven exactly")


@dataclass(frozen=True)
class Call:
    """One torch.topk call: its operand and arguments (dim non-negative) and which output it is."""

    x: int
    k: int
    dim: int
    largest: bool
    sorted: bool
    path: tuple[int, ...]

    def attrs(self) -> tuple:
        return (Operand(0), self.k, self.dim, self.largest, self.sorted), (), self.path


def topk(r: Rules, args, attrs, shape, dtype) -> int:
    """torch.topk in one spelling (every argument given, dim non-negative), then: over a shard
    [lo, hi) of its axis (whole on the others), the top k of the whole axis' piece (positions less
    lo); over the ranks' top candidates joined along the axis, the top k of their union's piece;
    else an open op (a rank's rows of tokens: the rows of the whole's top k)."""
    target = overload(TOPK)
    call = Call(args[0], argument(target, attrs, "k"), argument(target, attrs, "dim") % len(r.shape(args[0])),
                bool(argument(target, attrs, "largest")), bool(argument(target, attrs, "sorted")), attrs[2])
    if attrs != call.attrs():
        return r.build(TOPK, args, call.attrs(), shape, dtype)
    found = _of_shard(r, call, shape, dtype) if call.largest else None
    if found is None and call.largest and call.sorted and call.path == VALUES:
        parts = candidates(r, call.x, call.dim)
        found = None if parts is None else _top_of(r, parts, call, shape, dtype, VALUES)
    # a rank's rows of the reference's scores: those rows of its top k (candidates' laws meet the rest)
    found = by_blocks(r, TOPK, args, attrs, shape, dtype, of_reference=True) if found is None else found
    return found if found is not None else r.literal(TOPK, args, attrs, shape, dtype)


def _of_shard(r: Rules, call: Call, shape, dtype) -> int | None:
    root, box = r.as_region(call.x)
    size = r.shape(root)[call.dim]
    lo, hi = box[call.dim]
    if root == call.x or (lo, hi) == (0, size):
        return None
    whole_axis = r.slice(root, tuple((0, size) if d == call.dim else b for d, b in enumerate(box)))
    whole = r.build(TOPK, (whole_axis,), call.attrs(), shape, dtype)
    piece = r.top_piece(whole, ("topk", call.dim, whole_axis), lo, hi, size)
    if call.path == VALUES:
        return piece
    offset = r.literal("full", (), (lo,), shape, dtype)
    return r.lin([(piece, Fraction(1)), (offset, Fraction(-1))])


@dataclass(frozen=True)
class Part:
    """One rank's top candidates: torch.topk `call`'s output over the indices [lo, hi) of its axis."""

    call: Call
    term: int  # the part itself
    lo: int
    hi: int
    size: int


def candidates(r: Rules, t: int, dim: int) -> list[Part] | None:
    """The parts of `t` joined along `dim` (one part: `t` itself), each the output of a top k over
    the indices [lo, hi) of one axis (a `top_piece`, or a topk over all of it), or None."""
    exposed = r.exposed_cat(t)  # a cat seen through the views that stay outside it (a flat buffer's)
    joined = r.u[exposed].args if exposed is not None and r.u[exposed].attrs[0] == dim else (t,)
    parts = []
    for p in joined:
        piece = r.u[p]
        whole = piece.args[0] if piece.op == "top_piece" else p
        call = call_of(r, whole)
        if call is None or call.dim != dim:
            return None
        size = r.shape(call.x)[dim]
        lo, hi = piece.attrs[1:3] if piece.op == "top_piece" else (0, size)
        parts.append(Part(call, p, lo, hi, size))
    return parts


def short_parts(parts: list[Part], k: int) -> list[Part]:
    """The parts holding fewer than k candidates of a range with more: the top k over the union
    may take more from that range than the part kept."""
    return [p for p in parts if p.call.k < min(k, p.hi - p.lo)]


def call_of(r: Rules, t: int) -> Call | None:
    term = r.u[t]
    if term.op != TOPK:
        return None
    (_, k, dim, largest, sort), _, path = term.attrs
    return Call(term.args[0], k, dim, largest, sort, path)


def _top_of(r: Rules, parts: list[Part], call: Call, shape, dtype, path: tuple[int, ...]) -> int | None:
    """Output `path` of the top `call.k` over the union of the parts' ranges, when they follow each
    other over one operand's axis and each part holds at least k candidates (or all of its range)."""
    first = parts[0]
    if any(p.call.x != first.call.x or not p.call.largest or p.size != first.size for p in parts):
        return None
    if any(a.hi != b.lo for a, b in zip(parts, parts[1:])):
        return None
    if short_parts(parts, call.k):
        return None
    whole = r.build(TOPK, (first.call.x,), Call(first.call.x, call.k, call.dim, True, True, path).attrs(), shape, dtype)
    return r.top_piece(whole, ("topk", call.dim, first.call.x), first.lo, parts[-1].hi, first.size)


def pick_of_top(r: Rules, x: int, index: int, dim: int, shape: tuple[int, ...]) -> int | None:
    """gather(P, dim, topk(V, k, dim).indices), where V joins the ranks' top values over their
    shards of an axis and P their positions (shifted to the whole axis) from the same topk calls:
    the positions of the top k over the union of the shards, where the top k values are distinct."""
    chosen = call_of(r, index)
    if chosen is None or chosen.path != POSITIONS or chosen.dim != dim or not (chosen.largest and chosen.sorted):
        return None
    values, positions = candidates(r, chosen.x, dim), candidates(r, x, dim)
    if values is None or positions is None or len(values) != len(positions):
        return None
    if any(v.call.path != VALUES or replace(v.call, path=POSITIONS) != p.call or (v.lo, v.hi) != (p.lo, p.hi)
           for v, p in zip(values, positions)):
        return None
    found = _top_of(r, positions, chosen, shape, r.u[x].dtype, POSITIONS)
    if found is not None:
        r.assumptions.add(DISTINCT)
    return found
