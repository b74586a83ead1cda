"""The result of a diagnosis: a kind of fault, its message and the ops to blame. Apart from the
diagnoser because the report and the prover read it without running one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from shardproof.ir.graph import Node


@dataclass
class Finding:
    verdict: str  # "discrepancy" or "unknown"
    kind: str  # missing reduction, overlapping shards, double counting, wrong scale, wrong layout, wrong axis, unknown
    message: str
    distributed: list[tuple[int, Node]] = field(default_factory=list)  # (rank, node), culprit first
    reference: list[Node] = field(default_factory=list)
    op: str | None = None
    scale: Fraction | None = None  # wrong scale, double counting: the factor on the reference value
    claim: str | None = None  # the claim (steps.Check label) found failing; None: the programs as a whole

    @property
    def brief(self) -> str:
        """The kind of fault with its factor, to name a claim that fails alongside the one diagnosed."""
        return self.kind if self.scale is None else f"{self.kind}: x{self.scale}"
