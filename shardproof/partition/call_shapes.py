"""A call's shape: what its proof depends on, read off the programs rather than off the terms.

A call's canonical boundary (boundary.py) is read from the terms of its arguments, so every rank's
arguments must be built first: at 64 ranks, every layer's slices of a 126-layer checkpoint. The
shape is the same information one step earlier: for the reference and each rank, the ops that
compute the call's arguments from *atoms* (leaves, outputs of earlier calls and collectives, whose
terms exist anyway), and which atoms are the same term. All atoms must be reference terms, which a
boundary keeps opaque. Two calls of one shape compute their arguments by the same ops from
corresponding atoms; the rules are identities that hold whatever the atoms are, so the boundary of
one, with the other's atoms put in, is the other's, and its proof answers both
(`CallProofs.outputs`). The ranks of one rank class share their ops, symbolic offsets included, so
a shape is read once per class, and the arguments of a call answered this way are never built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import waits_for_peers
from shardproof.ir.rank_expr import frozen
from shardproof.partition.rank_classes import RankClass
from shardproof.partition.structure import structural
from shardproof.relations.rules import Rules

MAX_SHAPE_NODES = 200  # arguments computed by more ops than this are read from their terms


@dataclass(frozen=True)
class Ops:
    """The ops computing some nodes from atoms: entries children first, an atom as ("atom", i,
    shape, dtype)."""

    entries: tuple[Hashable, ...]
    roots: tuple[int, ...]  # entry of each node asked for
    atoms: tuple[int, ...]  # node id of atom i


@dataclass(frozen=True)
class CallShape:
    key: Hashable
    atoms: list[int]  # the atoms' terms: the reference's, then each rank's


def argument_ops(graph: Graph, inputs: tuple[int, ...]) -> Ops | None:
    """The ops computing `inputs` in `graph` (once per rank class: from its own nodes, offsets
    symbolic), None if there are too many."""
    structure = graph.structure
    if isinstance(structure, RankClass):
        return structural(graph, ("argument ops", inputs), lambda _: _ops(structure.graph.nodes, inputs))
    return _ops(graph.nodes, inputs)


def call_shape(rules: Rules, sides: Sequence[tuple[Ops | None, Sequence[int]]], extra: Hashable) -> CallShape | None:
    """The shape of one call from each side's argument ops and terms (the reference first), or
    None where an atom is not a reference term (a boundary would read into it)."""
    parts: list[tuple] = []
    atoms: list[int] = []
    for ops, terms in sides:
        if ops is None:
            return None
        parts.append((ops.entries, ops.roots))
        atoms.extend(terms[a] for a in ops.atoms)
    if not all(rules.in_reference(t) for t in atoms):
        return None
    first: dict[int, int] = {}
    same = tuple(first.setdefault(t, len(first)) for t in atoms)
    return CallShape((extra, tuple(parts), same), atoms)


def _ops(nodes: Sequence[Node], inputs: tuple[int, ...]) -> Ops | None:
    index: dict[int, int] = {}
    entries: list[Hashable] = []
    atoms: list[int] = []
    for root in inputs:
        stack = [(root, False)]
        while stack:
            i, children_done = stack.pop()
            if i in index:
                continue
            node = nodes[i]
            if node.op in ("leaf", "call") or waits_for_peers(node.op):
                index[i] = len(entries)
                entries.append(("atom", len(atoms), node.shape, node.dtype))
                atoms.append(i)
            elif children_done:
                index[i] = len(entries)
                entries.append((node.op, frozen(node.attrs), node.shape, node.dtype, tuple(index[j] for j in node.inputs)))
                if len(entries) > MAX_SHAPE_NODES:
                    return None
            else:
                stack.append((i, True))
                stack.extend((j, False) for j in reversed(node.inputs) if j not in index)
    return Ops(tuple(entries), tuple(index[i] for i in inputs), tuple(atoms))
