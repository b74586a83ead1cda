"""shardproof/findings.py: a finding stands only on its own claim's numbers; the report leads with
one finding and names the other failing claims by kind."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.case import Case
from shardproof.findings import NUMERIC_CHECK_LIMIT, combined, confirmed, failing_claims
from shardproof.oracle import run_numeric
from shardproof.ir.graph import Location, Node
from shardproof.programs import NumericResult
from shardproof.relations.diagnose import Finding

GRADIENT, LOSS = "gradient of `weight`", "loss"


def _finding(claim: str | None, kind: str = "wrong scale", scale: Fraction | None = Fraction(3)) -> Finding:
    return Finding("discrepancy", kind, f"{claim}: {kind}", claim=claim, scale=scale)


def _differing(*claims: str) -> NumericResult:
    return NumericResult(not claims, 1.0, 1.0, "worst", {claim: f"{claim} differs" for claim in claims})


def _mislogged_loss(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """Right data-parallel gradients (averaged), but the loss it returns is doubled."""
    loss = F.mse_loss(model(*inputs), *inputs)
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    return 2 * loss


def _mislogged_case() -> Case:
    return Case(
        reference=lambda: nn.Linear(4, 4),
        distributed=lambda rank, n: nn.Linear(4, 4),
        inputs=lambda: (torch.randn(4, 4),),
        shard_input=lambda index, full, rank, n: full.chunk(n, 0)[rank],
        loss=F.mse_loss,
        distributed_step=_mislogged_loss,
        mode="train",
    )


def test_a_finding_about_a_claim_that_agrees_numerically_is_not_confirmed_by_another_claim() -> None:
    """The oracle really runs: the gradient agrees, the loss differs; a finding about the gradient
    must not be confirmed by the loss's numbers."""
    numbers = run_numeric(_mislogged_case(), 2)
    assert set(numbers.differing) == {LOSS}
    [finding] = confirmed(lambda: numbers, [_finding(GRADIENT)], 1)
    assert finding.verdict == "unknown"
    assert f"{GRADIENT} agrees numerically" in finding.message and LOSS in finding.message
    assert failing_claims([finding]) == []


def test_the_finding_is_re_aimed_at_a_failing_claim_that_differs() -> None:
    lead, other = confirmed(lambda: _differing(LOSS), [_finding(GRADIENT), _finding(LOSS)], 1)
    assert (lead.claim, lead.verdict) == (LOSS, "discrepancy")
    assert lead.message.endswith(f"[confirmed numerically: {LOSS} differs]")
    assert (other.claim, other.verdict) == (GRADIENT, "unknown")
    assert combined([lead, other], []).message.endswith(f"; also unproven: {GRADIENT}")


def test_every_claim_that_differs_stands_and_is_named_with_its_kind() -> None:
    findings = confirmed(lambda: _differing(GRADIENT, LOSS), [_finding(GRADIENT), _finding(LOSS)], 1)
    assert failing_claims(findings) == [GRADIENT, LOSS]
    message = combined(findings, ["`bias` after the optimizer step"]).message
    assert message.startswith(f"{GRADIENT}: wrong scale [confirmed numerically: {GRADIENT} differs]")
    assert message.endswith(f"; also failing: {LOSS} (wrong scale: x3); 1 further claim not checked")


def test_numbers_that_agree_leave_the_lead_unknown() -> None:
    [finding] = confirmed(lambda: _differing(), [_finding(GRADIENT)], 1)
    assert finding.verdict == "unknown" and "agree numerically" in finding.message


def test_a_finding_about_the_whole_program_stands_on_any_difference() -> None:
    [finding] = confirmed(lambda: _differing(LOSS), [_finding(None, "missing reduction", None)], 1)
    assert finding.verdict == "discrepancy"


def test_a_run_that_cannot_compare_claims_refutes_every_claim() -> None:
    hang = NumericResult(False, math.inf, math.inf, "ranks [1] never finished")
    [finding] = confirmed(lambda: hang, [_finding(GRADIENT)], 1)
    assert finding.verdict == "discrepancy" and "never finished" in finding.message


def test_too_large_to_run_only_structural_faults_stand() -> None:
    def never() -> NumericResult:
        raise AssertionError("a model this large is not run")

    layout, scale = _finding(GRADIENT, "wrong layout", None), _finding(LOSS)
    findings = confirmed(never, [layout, scale], NUMERIC_CHECK_LIMIT + 1)
    assert [(f.claim, f.verdict) for f in findings] == [(LOSS, "discrepancy"), (GRADIENT, "unknown")]
    assert "not confirmed numerically" in findings[0].message  # the user learns the finding is unchecked
    [alone] = confirmed(never, [layout], NUMERIC_CHECK_LIMIT + 1)
    assert alone.verdict == "unknown" and "too large" in alone.message
    [overlap] = confirmed(never, [_finding(GRADIENT, "overlapping shards", None)], NUMERIC_CHECK_LIMIT + 1)
    assert overlap.verdict == "discrepancy", "a sum over ranks that never reads a column is structural"


def test_a_numeric_run_that_fails_confirms_nothing_and_is_no_discrepancy_itself() -> None:
    """An exception in the oracle (a bug there, or a model that fails on real tensors) keeps only
    the faults the proof shows structurally, saying why they are unconfirmed."""

    def fails() -> NumericResult:
        raise RuntimeError("expected scalar type Float but found Double\nmore detail")

    [layout] = confirmed(fails, [_finding(GRADIENT, "wrong layout", None)], 1)
    assert layout.verdict == "unknown" and "the numeric run failed: RuntimeError: expected scalar type" in layout.message
    [partial] = confirmed(fails, [_finding(None, "missing reduction", None)], 1)
    assert partial.verdict == "discrepancy" and "not confirmed numerically: the numeric run failed" in partial.message
    assert "more detail" not in partial.message


class _Squares(nn.Module):
    """Sums of squares of a linear map; `forget` returns the map itself (the head left out)."""

    def __init__(self, forget: bool = False) -> None:
        super().__init__()
        self.linear, self.forget = nn.Linear(4, 4), forget

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)  # the forward's line
        return h if self.forget else h.pow(2).sum(-1)


def _squares_case(forget: bool) -> Case:
    return Case(reference=_Squares, distributed=lambda rank, n: _Squares(forget), inputs=lambda: (torch.randn(6, 4),),
                loss=lambda out, x: out.mean(), mode="train")


def test_a_loss_that_differs_in_the_forward_names_the_first_site_of_a_gradient_found_in_its_backward() -> None:
    """The gradient through the mean of a tensor of another shape first differs at the mean's
    backward (a constant); the loss already differs in the forward, at the value the mean takes.
    The gradient still leads the report."""
    report = verify(_squares_case(forget=True), world_size=2)
    assert report.verdict == "discrepancy" and report.claim != LOSS and report.claims[-1] == LOSS
    assert "in the backward" not in report.distributed[0].op and "the forward's line" in report.distributed[0].code
    assert "already in the forward at line" in report.diagnosis
    assert not run_numeric(_squares_case(forget=True), 2).agree
    assert verify(_squares_case(forget=False), world_size=2).verdict == "equivalent"
    assert run_numeric(_squares_case(forget=False), 2).agree


def _located(claim: str, node_id: int, backward: bool, rank: int = 0) -> Finding:
    node = Node(node_id, "mul", (), (), (), "float32", "x", Location("case.py", node_id, "x", backward))
    return Finding("discrepancy", "wrong scale", f"{claim}: wrong scale", [(rank, node)], claim=claim)


@pytest.mark.parametrize("gradient, loss, first", [
    ((9, True), (3, False, 0), 3),  # the loss's forward op ran before the gradient's backward op
    ((9, False), (3, False, 0), 9),  # the gradient's culprit is a forward op
    ((9, True), (12, False, 0), 9),  # the loss's forward op ran after the gradient's backward op
    ((9, True), (3, False, 1), 9),  # the loss's fault is on another rank
])
def test_the_first_site_is_the_loss_forward_fault_before_a_gradient_found_in_the_backward(gradient, loss, first) -> None:
    findings = [_located(GRADIENT, *gradient), _located(LOSS, *loss)]
    report = combined(findings, [])
    assert report.claim == GRADIENT and failing_claims(findings) == [GRADIENT, LOSS]
    assert report.distributed[0][1].id == first and ("already in the forward" in report.message) == (first == 3)
