"""From the findings of a proof, one per failing claim, to what the report says.

A finding is about one claim (steps.Check). It stands when the numbers refute that very claim:
a mismatch in another claim confirms nothing about it. The report leads with the first finding
that stands, in detail, and names the other failing claims with their kinds of fault, so that a
wrong gradient is named even when the loss fails too; its first site is the loss's when the
gradient's fault shows only in autograd's backward of a forward that already differs (see
`_forward_first`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from shardproof.errors import ShardproofError
from shardproof.ir.graph import Node
from shardproof.programs import NumericResult
from shardproof.relations.diagnose import Finding
from shardproof.relations.messages import UnmatchedMessage
from shardproof.relations.mismatch import CollectiveMismatch
from shardproof.report.terms import line_of

NUMERIC_CHECK_LIMIT = 50_000_000  # reference state elements up to which a discrepancy is run numerically


def confirmed(numeric: Callable[[], NumericResult], findings: list[Finding], elements: int) -> list[Finding]:
    """Certify the findings of a discrepancy by running every rank and the reference on random
    weights, claim by claim; the findings that stand come first, the others become `unknown`.

    Structural faults (a partial sum used unreduced, pieces that overlap, a term counted twice)
    differ for almost all weights; a wrong-layout finding could also be a missing rule, so it
    stands only if the numbers differ. If no finding stands, the lead one turns `unknown` and says
    why. Ranks that issue different collectives, or messages that never pair, need no numbers: a
    real run would hang or mix tensors.
    A model too large to run, or whose numeric run fails, keeps its structural faults only; a
    program that raises in its own code when run is unusable input (CaseError)."""
    lead = findings[0]
    if lead.kind in (CollectiveMismatch.kind, UnmatchedMessage.kind):
        return findings
    if elements > NUMERIC_CHECK_LIMIT:
        return _structural(findings, "model too large to run")
    try:
        numbers = numeric()
    except ShardproofError:  # the program itself fails: unusable input
        raise
    except Exception as err:  # noqa: BLE001 - a run that fails confirms nothing, and is no discrepancy itself
        first_line = (str(err).strip().splitlines() or [""])[0]
        return _structural(findings, f"the numeric run failed: {type(err).__name__}: {first_line}")
    refuted = [numbers.differs(f.claim) for f in findings]
    evidence = [None if where is None else f" [confirmed numerically: {where}]" for where in refuted]
    reason = "the programs agree numerically on random weights" if numbers.agree else \
        f"{lead.claim} agrees numerically on random weights (the numbers differ only in {', '.join(numbers.differing)})"
    return _standing(findings, evidence, f"proof incomplete ({lead.message}); {reason}, so a rewrite rule is probably missing")


def _structural(findings: list[Finding], why: str) -> list[Finding]:
    """Without numbers, only structural faults stand; a wrong layout could be a missing rule."""
    unconfirmed = f"not confirmed numerically: {why}"
    evidence = [f" [{unconfirmed}]" if f.kind != "wrong layout" else None for f in findings]
    return _standing(findings, evidence, f"{findings[0].message} ({unconfirmed})")


def _standing(findings: list[Finding], evidence: list[str | None], otherwise: str) -> list[Finding]:
    """The discrepancies with evidence (appended to their message) first, then the rest as `unknown`;
    with none, the lead finding as `unknown` saying `otherwise`."""
    stands = [f.verdict == "discrepancy" and e is not None for f, e in zip(findings, evidence)]
    standing = [replace(f, message=f.message + e) for f, e, ok in zip(findings, evidence, stands) if ok]
    rest = [replace(f, verdict="unknown") for f, ok in zip(findings, stands) if not ok]
    if standing:
        return standing + rest
    return [replace(rest[0], message=otherwise), *rest[1:]]


def combined(findings: list[Finding], unchecked: list[str]) -> Finding:
    """One finding for the report: the lead in detail, the other failing claims by kind of fault
    (their sites after the lead's), the claims left unproven, and how many were not checked."""
    lead, others = findings[0], findings[1:]
    failing = [f for f in others if f.verdict == "discrepancy"]
    unproven = [f.claim for f in others if f.verdict != "discrepancy"]
    forward = _forward_first(findings)
    parts = [lead.message]
    if failing:
        parts.append("also failing: " + ", ".join(f"{f.claim} ({f.brief}{_earlier(f) if f is forward else ''})"
                                                  for f in failing))
    if unproven:
        parts.append("also unproven: " + ", ".join(str(claim) for claim in unproven))
    if unchecked:
        parts.append(f"{len(unchecked)} further claim{'s' if len(unchecked) > 1 else ''} not checked")
    sites = [*(forward.distributed[:1] if forward else []), *(site for f in (lead, *failing) for site in f.distributed)]
    return replace(lead, message="; ".join(parts), distributed=sites)


def _earlier(finding: Finding) -> str:
    return f", already in the forward at {line_of(finding.distributed[0][1])}"


def _forward_first(findings: list[Finding]) -> Finding | None:
    """Another failing claim whose culprit is a forward op that ran, on the same rank, before the
    lead's culprit, an op of autograd's backward (the loss, whose wrong value the backward only
    differentiates: a mean's gradient over a tensor of another shape). An op of the backward is
    derived from the forward's: where the forward already differs is the first site. The lead
    stays the gradient's (a wrong gradient trains a worse model)."""
    def culprit(finding: Finding) -> tuple[int, Node] | None:
        return finding.distributed[0] if finding.verdict == "discrepancy" and finding.distributed else None

    lead = culprit(findings[0])
    if lead is None or lead[1].loc is None or not lead[1].loc.backward:
        return None
    for finding in findings[1:]:
        other = culprit(finding)
        if other is not None and other[0] == lead[0] and other[1].loc is not None and not other[1].loc.backward \
                and other[1].id < lead[1].id:
            return finding
    return None


def failing_claims(findings: list[Finding]) -> list[str]:
    """The claims the findings show failing, the lead first."""
    return [f.claim for f in findings if f.verdict == "discrepancy" and f.claim is not None]
