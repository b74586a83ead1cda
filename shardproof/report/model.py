"""The verification report: verdict, figures, and where the programs part ways."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

EXIT_CODES = {"equivalent": 0, "discrepancy": 1, "unknown": 2}


@dataclass
class Site:
    file: str
    line: int
    code: str
    op: str
    rank: int | None = None
    # the graph node's name: in an imported dump, its variable (to find an op whose line is a
    # library's); not part of the site's identity (a traced name depends on how the graph was split)
    node: str = field(default="", compare=False)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.rank is None:
            del data["rank"]
        return data


@dataclass
class Report:
    verdict: str
    world_size: int
    seconds: float
    reference_ops: int
    distributed_ops: int
    diagnosis: str | None = None
    reference: list[Site] = field(default_factory=list)
    distributed: list[Site] = field(default_factory=list)
    unknown: dict[str, str] | None = None
    capture_seconds: float = 0.0
    terms: int = 0
    notes: list[str] = field(default_factory=list)  # what exactly was proven (e.g. a loss as a mean over ranks)
    inputs: list[str] = field(default_factory=list)  # imported graphs: the input relations assumed
    outputs_compared: str | None = None  # imported graphs: how many outputs were compared
    calls_proven: int = 0  # distinct repeated-module calls proven (layer memoization)
    calls_reused: int = 0  # calls answered from one of those proofs
    claims: list[str] = field(default_factory=list)  # discrepancy: the claims found failing, the diagnosed one first

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict[str, Any]:
        discrepancy = None
        if self.verdict == "discrepancy":
            discrepancy = {
                "diagnosis": self.diagnosis,
                "claims": self.claims,
                "reference": [s.to_json() for s in self.reference],
                "distributed": [s.to_json() for s in self.distributed],
            }
        data = {
            "verdict": self.verdict,
            "world_size": self.world_size,
            "seconds": round(self.seconds, 3),
            "reference_ops": self.reference_ops,
            "distributed_ops": self.distributed_ops,
            "discrepancy": discrepancy,
            "unknown": self.unknown,
            "notes": self.notes,
        }
        if self.inputs:
            data["inputs"] = self.inputs
            data["outputs_compared"] = self.outputs_compared
        return data
