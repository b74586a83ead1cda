"""Ranks that cannot run together: a real run of the program hangs, fails or mixes tensors. A fault
of the program found by symbolic execution alone (no numbers needed), a discrepancy of its own kind."""

from __future__ import annotations

from shardproof.ir.graph import Node


class CollectiveMismatch(Exception):
    """Ranks issue different collective sequences, or one collective for tensors of different
    shapes: a real program would hang, fail or mix tensors."""

    kind = "mismatched collectives"
    fix = "make every rank issue the same collectives, over the same groups, in the same order"

    def __init__(self, message: str, nodes: list[tuple[int, Node]]):
        super().__init__(message)
        self.nodes = nodes  # (rank, op), the one to change first
