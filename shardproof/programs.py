"""What every front end (PyTorch capture, HLO and FX dumps) hands the driver: the reference's
and each rank's graph over the same leaves, the claims to prove between them, and the shape of the
numbers that confirm a failing claim. Plain data over the IR, so that the prover and the driver
never import a front end.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardproof.ir.graph import Graph

Output = tuple[str, ...] | tuple[str, int]  # ("replicate",), ("shard", dim) or ("zigzag", dim): a rank output against the reference's


def zigzag_chunks(world_size: int) -> list[tuple[int, int]]:
    """Under ("zigzag", dim) the reference's dim is cut into 2 * world_size chunks and rank r holds
    chunks r and 2 * world_size - 1 - r, in that order (load-balanced context parallelism: each
    rank gets as much of a causal mask's work). The (rank, half of its output) of each chunk, in order."""
    return [(r, 0) for r in range(world_size)] + [(r, 1) for r in reversed(range(world_size))]


LOSS = "loss"  # the loss claim: its label and its relation


@dataclass(frozen=True)
class Check:
    """One claim, proven on every rank that makes it: a rank output equals an expected value.

    `relation` is an Output layout (expected = reference output `expected`), "loss" (reference
    output `expected`, replicated or as a mean over ranks) or "rank" (expected = this rank's own
    output `expected`, which the rank computed from bound reference outputs)."""

    label: str
    actual: int
    expected: int
    relation: Output | str
    ranks: tuple[int, ...] | None = None  # the ranks making the claim (None: every rank)

    def holders(self, ranks: list[Graph]) -> list[Graph]:
        """The graphs of the ranks making the claim."""
        return ranks if self.ranks is None else [g for g in ranks if g.rank in self.ranks]


@dataclass
class Captured:
    """The programs to prove: the reference graph, one graph per rank, the claims between them,
    and the seconds the front end took to produce them."""

    reference: Graph
    ranks: list[Graph]
    checks: list[Check]
    seconds: float
    refused: str = ""  # the case's breach of contract (steps.Program.refused): unusable unless a claim fails
    unheld: str = ""  # a parameter the reference trains that no rank's model holds (steps.Program.unheld)


@dataclass
class NumericResult:
    """The verdict of one numeric run; `detail` names the worst rank so a failure can be found.

    `differing` says, claim by claim (Check labels), which claims the numbers refute: a finding
    about one claim is confirmed by that claim's numbers, not by another's. A run that could not be
    compared claim by claim (a hang, ranks claiming different parameters) leaves it empty while
    disagreeing: it refutes the programs as a whole."""

    agree: bool
    max_abs_error: float
    max_rel_error: float  # relative to max |reference|
    detail: str  # human-readable, e.g. "rank 1 differs by 3.2e-1"
    differing: dict[str, str] = field(default_factory=dict)  # claim label -> where it differs most

    def differs(self, claim: str | None) -> str | None:
        """Where the numbers refute `claim` (None: the programs as a whole), or None if they do not."""
        if self.agree:
            return None
        if claim is None or not self.differing:
            return self.detail
        return self.differing.get(claim)
