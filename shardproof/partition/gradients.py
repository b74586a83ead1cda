"""A rank's gradients out of a backward call, written over the reference call's gradients.

A proof call by call carries a rank's outputs back over the reference call's outputs, which stand
opaque outside the call: an output not built from them structurally cannot be compared with
anything after the call. Parameter gradients often are not, by normal form alone: the rank's
gradient of its fused qkv shard is a cat of slices of three matmuls, the reference's one matmul
over the fused gradient. Equal by saturation, though, to the candidate the layout suggests: a rank
argument built from the reference's arguments by slices and cats has as gradient the same slices
and cats of the reference's gradients. Each candidate is kept only where `prove_equal` proves it,
so nothing is assumed.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from shardproof.egraph.saturate import prove_equal
from shardproof.partition.boundary import Boundary
from shardproof.partition.templates import Template
from shardproof.relations.rules import Rules
from shardproof.relations.rules.linear import attr_terms, with_attr_terms


def over_reference_gradients(
    rules: Rules,
    boundary: Boundary,
    reference: tuple[Template, list[int]],
    rank: tuple[Template, int, list[int]],
    frees: frozenset[int],
) -> list[int]:
    """The rank's outputs (`rank`: its VJP template, its index in the boundary, its output terms),
    each replaced by its candidate where the two are proven equal. `reference`: the reference's VJP
    template and output terms. `frees`: the terms of the boundary's free leaves."""
    template, index, outputs = rank
    ref_template, ref_outputs = reference
    if template.gradient_of is None or ref_template.gradient_of is None:
        return outputs
    uses = Counter(boundary.reference_args)  # an argument passed twice has the sum of two gradients
    gradient = {
        boundary.reference_args[arg]: out
        for arg, out in zip(ref_template.gradient_of, ref_outputs)
        if uses[boundary.reference_args[arg]] == 1
    }
    args = boundary.rank_args[index]
    return [
        out if _reads(rules, out, frees) else _proven(rules, boundary, gradient, args[arg], out)
        for arg, out in zip(template.gradient_of, outputs)
    ]


def _reads(rules: Rules, out: int, frees: frozenset[int]) -> bool:
    """Whether `out` is built over a free leaf: a value the boundary did not write over the
    reference's arguments (the rank's own gradient coming in, say). A candidate is built over the
    reference's gradients, which read cut leaves only, so saturation cannot prove the two equal
    (it fails after a run of up to a second): the attempt is not made."""
    return bool(frees) and not frees.isdisjoint(rules.u.reachable(out))


def _proven(rules: Rules, boundary: Boundary, gradient: dict[int, int], entry: int, out: int) -> int:
    """`out`, or the candidate for the gradient of the argument at boundary `entry` if proven equal:
    built as it is (slices of the reference's gradients: grounded), compared in normal form."""
    built: dict[int, tuple[int, int] | None] = {}  # entry -> (candidate as built, in normal form)

    def candidate(e: int) -> tuple[int, int] | None:
        if e not in built:
            found = boundary.entries[e]
            if found[0] in ("cut", "free"):
                term = gradient.get(e)
                built[e] = None if term is None else (term, term)
            else:
                op, attrs, shape, dtype, children = found
                parts = [candidate(c) for c in children]
                named = {c: candidate(c) for c in attr_terms(op, attrs)}
                built[e] = None if None in parts or None in named.values() else (
                    rules.literal(op, tuple(p[0] for p in parts), with_attr_terms(op, attrs, lambda c: named[c][0]), shape, dtype),
                    _normal(rules, found, [p[1] for p in parts], lambda c: named[c][1]),
                )
        return built[e]

    wanted = candidate(entry)
    if wanted is None or not (wanted[1] == out or prove_equal(rules.u, out, wanted[1])):
        return out
    return wanted[0]


def _normal(rules: Rules, entry: tuple, parts: list[int], named: Callable[[int], int]) -> int:
    """The entry's op over `parts` in normal form where it is a layout op, as the rank's terms are
    (a slice pushed into what it slices); `named`: the term of an entry its attrs name."""
    op, shape, dtype = entry[0], entry[2], entry[3]
    attrs = with_attr_terms(op, entry[1], named)
    if op == "slice":
        return rules.slice(parts[0], attrs[0])
    if op == "cat":
        return rules.cat(parts, attrs[0])
    return rules.literal(op, tuple(parts), attrs, shape, dtype)
