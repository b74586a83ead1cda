"""Normalizing term constructors: the rewrite rules, applied bottom-up as terms are built.

Normal form, outermost first: `lin` (linear combinations: sums, scaling, subtraction), `piece`
(one part of a sum that was split over ranks: a contraction or reduction over a sharded axis,
or a masked vocab-parallel lookup) or `max_piece` (one part of a max split over ranks), `slice`
(a box of a larger tensor), `cat`, `bcast` (broadcasting), then compute ops. Rules pull slices,
concatenations and broadcasts out of ops (elementwise ops commute with them, matmul maps them
onto its free dims, a contraction over a sliced axis becomes a piece), so a rank's value is
expressed as a region of the very term the reference computes. Rule templates are per op kind
(see `shardproof.ir.ops.OPS`), not per op. Every rule is an equality over the reals; each has a
numeric test in tests/relations.
"""

from __future__ import annotations

from shardproof.relations.rules.core import Rules
from shardproof.relations.rules.values import FLOAT_DTYPES, intended

__all__ = ["FLOAT_DTYPES", "Rules", "intended"]
