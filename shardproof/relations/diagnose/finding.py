"""The result of a diagnosis: a kind of fault, its message and the ops to blame. Apart from the
diagnoser because the report and the prover read it without running one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from shardproof.ir.graph import Node
from shardproof.report.model import Region

# The kinds of fault, as the JSON report names them (with `_` for spaces; shardproof/report/schema.json
# lists the same). A new kind is added here, described in one line.
KINDS = {
    "missing reduction": "a partial sum or max over ranks is used (or returned) without its all-reduce",
    "overlapping shards": "the shards summed over ranks overlap or leave gaps (a rank holds the wrong shard)",
    "double counting": "a term is added on every rank before a sum over ranks, so it is counted once per rank",
    "double reduction": "a value already summed over ranks is summed again",
    "wrong group": "a reduction runs over fewer ranks than hold shares of the sum",
    "wrong scale": "the right terms with the wrong coefficients (a mean over a shard summed, say)",
    "swapped operands": "a division or subtraction the other way round: with its operands swapped it gives the reference's value",
    "wrong layout": "an operand holds the wrong region of the reference's tensor, or reads it with the wrong shape",
    "wrong axis": "shards are concatenated along another dim than they were split on",
    "mismatched collectives": "ranks issue different collectives: a real run would hang or mix tensors",
    "unmatched message": "a send or recv no rank pairs with (a recv nobody sends to, a send nobody receives, another shape, a rank that does not exist): a real run hangs or reads the wrong bytes",
    "wrong reduce dim": "the ranks' partial results, gathered along one dim, are reduced along another: they are never combined",
    "wrong reduce op": "a collective reduces with another op than the values need (MAX of shares of a sum, SUM of partial maxima, SUM where AVG gives the reference's scale)",
    "uninitialised memory read": "an op reads a buffer (torch.empty) that nothing wrote: a collective meant to fill it is missing",
    "missing backward step": "a forward line's backward computes nothing on a rank where the reference's does",
    "too few candidates": "a rank keeps fewer than k of its shard's largest values before the top k over all ranks' candidates is taken",
    "unknown": "the proof did not go through and no fault was found: a rule may be missing",
}


@dataclass
class Finding:
    verdict: str  # "discrepancy" or "unknown"
    kind: str  # one of KINDS
    message: str
    distributed: list[tuple[int, Node]] = field(default_factory=list)  # (rank, node), culprit first
    reference: list[Node] = field(default_factory=list)
    op: str | None = None
    scale: Fraction | None = None  # wrong scale, double counting: the factor on the reference value
    claim: str | None = None  # the claim (steps.Check label) found failing; None: the programs as a whole
    fix: str = ""  # one sentence of what to do, in the user's words
    regions: list[Region] = field(default_factory=list)  # what each side holds where they diverge (report/terms.region)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"finding of unknown kind {self.kind!r}: add it to finding.KINDS")

    @property
    def brief(self) -> str:
        """The kind of fault with its factor, to name a claim that fails alongside the one diagnosed."""
        return self.kind if self.scale is None else f"{self.kind}: x{self.scale}"
