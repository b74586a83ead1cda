"""Prove the ranks' outputs equal the reference's under the case's output layout, or diagnose."""

from __future__ import annotations

from dataclasses import dataclass

from shardproof.capture.torch_capture import Captured
from shardproof.case import Output
from shardproof.egraph.saturate import prove_equal
from shardproof.errors import CaseError
from shardproof.relations.diagnose import Diagnoser, Finding
from shardproof.relations.execute import CollectiveMismatch, execute
from shardproof.relations.universe import Universe


@dataclass
class Proof:
    finding: Finding | None  # None: every output proven equal
    terms: int  # size of the term universe: the proof's working memory

    @property
    def verdict(self) -> str:
        return "equivalent" if self.finding is None else self.finding.verdict


def prove(captured: Captured, output: Output) -> Proof:
    reference, ranks = captured.reference, captured.ranks
    for graph in ranks:
        if len(graph.outputs) != len(reference.outputs):
            raise CaseError(
                f"rank {graph.rank} returns {len(graph.outputs)} tensors but the reference returns "
                f"{len(reference.outputs)}"
            )
    try:
        run = execute(reference, ranks)
    except CollectiveMismatch as mismatch:
        finding = Finding("discrepancy", "mismatched collectives", f"mismatched collectives: {mismatch}", mismatch.nodes)
        return Proof(finding, 0)
    rules = run.rules
    unproven = []
    for index, ref_out in enumerate(reference.outputs):
        expected = run.reference[ref_out]
        outs = [run.ranks[g.rank][g.outputs[index]] for g in ranks]
        if output[0] == "shard":
            whole = rules.cat(outs, output[1] % len(rules.shape(expected)))
            if not _equal(rules.u, whole, expected):
                unproven.extend((g.rank, index) for g in ranks)
        else:
            unproven.extend((g.rank, index) for g, t in zip(ranks, outs) if not _equal(rules.u, t, expected))
    if not unproven:
        return Proof(None, len(rules.u))
    return Proof(Diagnoser(run, reference, ranks).diagnose(unproven), len(rules.u))


def _equal(universe: Universe, term: int, expected: int) -> bool:
    """Same normal form, or equal by equality saturation over the algebra the rules leave out
    (associativity/commutativity of products, distributivity; see egraph/saturate.py)."""
    return term == expected or prove_equal(universe, term, expected)
