"""The verification report: verdict, figures, and where the programs part ways."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
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
        data["file"] = relative(self.file)
        if self.rank is None:
            del data["rank"]
        return data


def relative(path: str) -> str:
    """A path relative to the working directory when it lies under it (the user's project), else
    as it is (an installed library's file)."""
    try:
        return str(Path(path).resolve().relative_to(Path(os.getcwd()).resolve()))
    except ValueError:
        return path


@dataclass(frozen=True)
class Region:
    """The part of a named tensor one side of a finding holds (rank r's operand, the reference's):
    the report draws them side by side."""

    side: str  # "rank 0", "reference"
    tensor: str  # the whole tensor, as the user's code names it
    shape: tuple[int, ...]
    box: tuple[tuple[int, int], ...]  # [start, end) in every dim

    def to_json(self) -> dict[str, Any]:
        return {"side": self.side, "tensor": self.tensor, "shape": list(self.shape), "box": [list(r) for r in self.box]}


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
    kind: str | None = None  # the diagnosed finding's kind of fault (relations/diagnose/finding.KINDS)
    claim: str | None = None  # the claim the diagnosis is about (None: the programs as a whole)
    fix: str = ""  # one sentence of what to do
    proven: list[str] = field(default_factory=list)  # equivalent: the claims proven (outputs, loss, gradients)
    regions: list[Region] = field(default_factory=list)  # discrepancy: the diverging regions, rank's and reference's

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_json(self) -> dict[str, Any]:
        discrepancy = None
        if self.verdict == "discrepancy":
            discrepancy = {
                "kind": self.kind.replace(" ", "_") if self.kind else None,
                "claim": self.claim,
                "diagnosis": self.diagnosis,
                "fix": self.fix,
                "claims": self.claims,
                "regions": [r.to_json() for r in self.regions],
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
            "proven": self.proven,
        }
        if self.inputs:
            data["inputs"] = self.inputs
            data["outputs_compared"] = self.outputs_compared
        return data
