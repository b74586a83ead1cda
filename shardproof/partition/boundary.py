"""The canonical boundary of a call: what its proof depends on, with names taken out.

A call's proof depends on the templates that run and on the terms they receive. The reference's
arguments become fresh leaves `cut:j` (the proof then holds for any value of them); every rank
argument is written over those cut leaves and over `free:i` leaves (numbered by first appearance)
for any other leaf or reference value it reads (not constants), as a list of entries in
depth-first order. Turning a value into a leaf only forgets what it is, so a proof over the leaves
still holds for the value. Two calls whose
boundaries are equal (layer 7 and layer 8 of a model: other weights, same structure) have the
same proof. `transplant` carries terms from one universe into another under a substitution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable

from shardproof.relations.rules import Rules
from shardproof.relations.rules.linear import attr_terms, with_attr_terms
from shardproof.relations.universe import Universe

MAX_BOUNDARY_TERMS = 5_000  # a rank argument larger than this is not worth canonicalizing
CONSTANTS = {"full", "const"}  # kept as they are: a proof may need their value


class NotPartitioned(Exception):
    """The program cannot be proven call by call here; prove the expanded program instead."""


Entry = tuple  # ("cut", j, shape, dtype) | ("free", i, shape, dtype) | (op, attrs, shape, dtype, child entries)
# (the terms an entry's attrs name, a piece's axis, are entries too: its attrs name their indices)


@dataclass
class Boundary:
    entries: list[Entry]
    reference_args: tuple[int, ...]  # entry of each reference argument (all "cut" entries)
    rank_args: tuple[tuple[int, ...], ...]  # entries of each rank's arguments
    cuts: list[int]  # term of cut leaf j in the universe the boundary was read from
    frees: list[int]  # term of free leaf i there

    def key(self, templates: tuple) -> Hashable:
        return (templates, tuple(self.entries), self.reference_args, self.rank_args)


def read_boundary(
    u: Universe, reference_args: list[int], rank_args: list[list[int]], in_reference: Callable[[int], bool]
) -> Boundary:
    """The boundary of one call; NotPartitioned if a rank argument is too large to canonicalize."""
    index: dict[int, int] = {}
    entries: list[Entry] = []
    cuts: list[int] = []
    frees: list[int] = []
    for t in reference_args:
        if t not in index:
            index[t] = len(entries)
            entries.append(("cut", len(cuts), u[t].shape, u[t].dtype))
            cuts.append(t)
    for args in rank_args:
        for root in args:
            _visit(u, root, index, entries, frees, in_reference)
    ranks = tuple(tuple(index[t] for t in args) for args in rank_args)
    return Boundary(entries, tuple(index[t] for t in reference_args), ranks, cuts, frees)


def _visit(
    u: Universe, root: int, index: dict[int, int], entries: list[Entry], frees: list[int], in_reference: Callable[[int], bool]
) -> None:
    """Append the entries of `root` and of everything below it, depth first, children first."""
    stack = [(root, False)]
    while stack:
        t, children_done = stack.pop()
        if t in index:
            continue
        term = u[t]
        if term.op == "leaf" or (in_reference(t) and term.op not in CONSTANTS):
            index[t] = len(entries)
            entries.append(("free", len(frees), term.shape, term.dtype))
            frees.append(t)
        elif children_done:
            index[t] = len(entries)
            attrs = with_attr_terms(term.op, term.attrs, index.__getitem__)
            entries.append((term.op, attrs, term.shape, term.dtype, tuple(index[a] for a in term.args)))
            if len(entries) > MAX_BOUNDARY_TERMS:
                raise NotPartitioned(f"a call boundary has more than {MAX_BOUNDARY_TERMS} terms")
        else:
            stack.append((t, True))
            below = (*term.args, *attr_terms(term.op, term.attrs))
            stack.extend((a, False) for a in reversed(below) if a not in index)


def build_entries(rules: Rules, entries: list[Entry], terms: list[int], stop: int | None = None) -> None:
    """Intern entries (from len(terms) up to `stop`) into `rules`, appending their terms."""
    for entry in entries[len(terms) : stop]:
        kind = entry[0]
        if kind in ("cut", "free"):
            terms.append(rules.leaf(f"{kind}:{entry[1]}", entry[2], entry[3]))
        else:
            op, attrs, shape, dtype, children = entry
            attrs = with_attr_terms(op, attrs, terms.__getitem__)
            terms.append(rules.literal(op, tuple(terms[c] for c in children), attrs, shape, dtype))


def transplant(source: Universe, target: Rules, roots: list[int], substitution: dict[int, int]) -> list[int]:
    """`roots` rebuilt in `target`: substituted terms replaced, everything else copied as is.

    Copies keep their meaning (a term means its op applied to its arguments), so a proof about the
    source terms holds for the copies under the substitution."""
    copied = dict(substitution)
    needed: set[int] = set()
    stack = [r for r in roots if r not in copied]
    while stack:
        t = stack.pop()
        if t not in needed:
            needed.add(t)
            below = (*source[t].args, *attr_terms(source[t].op, source[t].attrs))
            stack.extend(a for a in below if a not in copied)
    for t in sorted(needed):  # arguments (and terms attrs name) always have smaller ids than the terms built on them
        term = source[t]
        attrs = with_attr_terms(term.op, term.attrs, copied.__getitem__)
        copied[t] = target.literal(term.op, tuple(copied[a] for a in term.args), attrs, term.shape, term.dtype)
    return [copied[r] for r in roots]
