"""Prove every check of the captured program on every rank, or diagnose the first failure."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fractions import Fraction

from shardproof.capture.torch_capture import Captured
from shardproof.egraph.saturate import prove_equal
from shardproof.ir.graph import Graph
from shardproof.relations.diagnose import Diagnoser, Finding
from shardproof.relations.execute import CollectiveMismatch, Execution, execute
from shardproof.steps import Check


@dataclass
class Proof:
    finding: Finding | None  # None: every check proven
    terms: int  # size of the term universe: the proof's working memory
    notes: list[str] = field(default_factory=list)  # what exactly was proven, where it is not obvious

    @property
    def verdict(self) -> str:
        return "equivalent" if self.finding is None else self.finding.verdict


def prove(captured: Captured) -> Proof:
    reference, ranks = captured.reference, captured.ranks
    try:
        run = execute(reference, ranks)
    except CollectiveMismatch as mismatch:
        finding = Finding("discrepancy", "mismatched collectives", f"mismatched collectives: {mismatch}", mismatch.nodes)
        return Proof(finding, 0)
    notes: list[str] = []
    for check in captured.checks:
        unproven = _unproven(run, reference, ranks, check, notes)
        if unproven:
            finding = Diagnoser(run, reference, ranks).diagnose(unproven)
            if check.relation in ("loss", "rank"):  # training checks: say which loss or gradient
                finding = replace(finding, message=f"{check.label}: {finding.message}")
            return Proof(finding, len(run.rules.u), notes)
    return Proof(None, len(run.rules.u), notes)


def _unproven(run: Execution, reference: Graph, ranks: list[Graph], check: Check, notes: list[str]) -> list[tuple[int, int]]:
    """The (rank, output index) pairs where `check` is not proven."""
    rules = run.rules
    actual = [run.ranks[g.rank][g.outputs[check.actual]] for g in ranks]
    if check.relation == "rank":
        expected = [run.ranks[g.rank][g.outputs[check.expected]] for g in ranks]
        return [(g.rank, check.actual) for g, a, e in zip(ranks, actual, expected) if not _equal(run, a, e)]
    wanted = run.reference[reference.outputs[check.expected]]
    if check.relation == "loss":
        if all(_equal(run, a, wanted) for a in actual):
            return []
        mean = rules.lin([(a, Fraction(1, len(actual))) for a in actual])
        if _equal(run, mean, wanted):
            notes.append(f"{check.label}: the mean of the {len(actual)} ranks' values equals the reference value")
            return []
        return [(g.rank, check.actual) for g in ranks]
    if check.relation[0] == "shard":
        whole = rules.cat(actual, check.relation[1] % len(rules.shape(wanted)))
        return [] if _equal(run, whole, wanted) else [(g.rank, check.actual) for g in ranks]
    return [(g.rank, check.actual) for g, a in zip(ranks, actual) if not _equal(run, a, wanted)]


def _equal(run: Execution, term: int, expected: int) -> bool:
    """Same normal form, or equal by equality saturation over the algebra the rules leave out
    (associativity/commutativity of products, distributivity; see egraph/saturate.py)."""
    return term == expected or prove_equal(run.rules.u, term, expected)
