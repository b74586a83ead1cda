"""Prove every check of the captured program on every rank, or diagnose the checks that fail.

Checks come in the order their failures are most useful to read (steps.py: gradients before the
loss); the first that fails leads the report, and a few more failing ones are diagnosed so that
the report can name them with their kinds of fault. Graphs with calls of repeated modules are
proven call by call, each distinct call once (see shardproof.partition.execute); where that does
not settle it, the expanded programs are proven.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Callable

from shardproof.egraph.saturate import prove_equal
from shardproof.ir.graph import Graph
from shardproof.partition.boundary import NotPartitioned
from shardproof.partition.execute import CallProofs, Unmatched, aligned, execute_with_calls, instances, through_call
from shardproof.partition.templates import expand, has_calls
from shardproof.programs import LOSS, Captured, Check, Output, zigzag_chunks
from shardproof.relations.diagnose import Diagnoser, Finding
from shardproof.relations.diagnose.agreement import unreduced
from shardproof.relations.diagnose.input_cuts import Claimed, claimed_share
from shardproof.relations.diagnose.other_share import Shared
from shardproof.relations.execute import CollectiveMismatch, Execution, execute
from shardproof.relations.layout import box_along
from shardproof.relations.rules import Rules
from shardproof.report.progress import count


DIAGNOSED_CLAIMS = 5  # failing checks diagnosed; the checks after the last of them are not proven


@dataclass
class Proof:
    findings: list[Finding]  # one per failing check, the one to lead with first; empty: every check proven
    terms: int  # size of the term universe: the proof's working memory
    notes: list[str] = field(default_factory=list)  # what exactly was proven, where it is not obvious
    calls: CallProofs | None = None  # repeated calls: distinct boundaries proven, calls reused
    unchecked: list[str] = field(default_factory=list)  # checks left unproven once enough had failed
    ranks: list[Graph] = field(default_factory=list)  # the programs proven, whose nodes the findings name

    @property
    def verdict(self) -> str:
        return self.findings[0].verdict if self.findings else "equivalent"


def prove(captured: Captured, progress: Callable[[str], None] = lambda _: None) -> Proof:
    reference, ranks, checks = captured.reference, captured.ranks, captured.checks
    layout = _claimed(reference, checks)
    calls = CallProofs() if has_calls(reference) else None
    if calls is not None:
        try:
            proof = _by_calls(reference, ranks, checks, calls, progress, layout)
            if proof is not None:
                return proof  # proven, or diverging outside every call (and diagnosed there)
        except Unmatched as unmatched:
            proof = _diagnosed_call(reference, ranks, calls, unmatched.index, progress, layout)
            if proof is not None:
                return proof
        progress("proving the expanded programs")
    reference, ranks = expand(reference), [expand(g) for g in ranks]
    return _judged(lambda: execute(reference, ranks), reference, ranks, checks, calls, layout=layout)


def _by_calls(
    reference: Graph, ranks: list[Graph], checks: list[Check], calls: CallProofs, progress: Callable[[str], None],
    layout: Claimed | None = None,
) -> Proof | None:
    """Call by call, each distinct call proven once: the proof, or None where calls do not line up."""
    reference, ranks = aligned(reference, ranks)
    if not has_calls(reference):
        return None

    def on_call(done: int, total: int) -> None:
        count(progress, "calls proven", done, total, calls.reused)

    try:  # calls line up, so collectives between them must too: a mismatch there is a finding
        return _judged(lambda: execute_with_calls(reference, ranks, calls, on_call), reference, ranks, checks, calls,
                       layout=layout)
    except NotPartitioned:
        return None


def _diagnosed_call(
    reference: Graph, ranks: list[Graph], calls: CallProofs, index: int, progress: Callable[[str], None],
    layout: Claimed | None = None,
) -> Proof | None:
    """The programs up to the `index`-th call, that call expanded, diagnosed at its outputs: a bug
    in one layer is found at the cost of one layer. A discrepancy, or None (prove it all then)."""
    progress(f"diagnosing call {index}, the first whose outputs differ")
    reference, ranks = aligned(reference, ranks)
    call = instances(reference)[index]
    reference, ranks = aligned(through_call(reference, index), [through_call(g, index) for g in ranks], index)
    checks = [Check(f"output {i} of call {index} (`{call.module}`)", i, i, ("replicate",)) for i in range(len(call.outputs))]
    try:
        proof = _judged(lambda: execute_with_calls(reference, ranks, calls), reference, ranks, checks, calls, claims=False,
                        layout=layout)
    except (NotPartitioned, Unmatched):
        return None
    if proof.verdict != "discrepancy":
        return None
    proof.findings = [replace(proof.findings[0], claim=None)]  # inside the programs, before any claim
    proof.unchecked = []
    return proof


def _judged(
    run_graphs: Callable[[], Execution], reference: Graph, ranks: list[Graph], checks: list[Check], calls: CallProofs | None,
    claims: bool = True, layout: Claimed | None = None,
) -> Proof:
    """Execute, then prove the checks in order and diagnose those that fail, up to DIAGNOSED_CLAIMS
    of them; a discrepancy leads over a claim left unknown (ranks issuing different collectives
    are a discrepancy of their own). `claims`: the checks are the case's claims, not a call's
    outputs compared as if replicated (which may be shards on the ranks)."""
    try:
        run = run_graphs()
    except CollectiveMismatch as mismatch:
        finding = Finding("discrepancy", mismatch.kind, f"{mismatch.kind}: {mismatch}", mismatch.nodes, fix=mismatch.fix)
        return Proof([finding], 0, calls=calls, ranks=ranks)
    notes: list[str] = []
    findings: list[Finding] = []
    diagnoser: Diagnoser | None = None
    by_rank = {g.rank: g for g in ranks}
    checked = 0
    while checked < len(checks) and len(findings) < DIAGNOSED_CLAIMS:
        check = checks[checked]
        checked += 1
        unproven = unproven_outputs(run, reference, ranks, check, notes)
        if not claims:  # a call's output each rank holds as its share of a sum (a weight gradient over its
            # tokens) is reduced, if at all, by the program after the call: no fault at the call's boundary
            unproven = [(r, i) for r, i in unproven if not unreduced(run.rules, run.ranks[r][by_rank[r].outputs[i]])]
        if unproven:
            diagnoser = diagnoser or Diagnoser(run, reference, ranks, claims, _seed_holds(run, reference, ranks, checks))
            finding = diagnoser.diagnose(unproven, _expected_terms(run, ranks, check, unproven),
                                         _replicated_term(run, reference, check) if claims else None, layout,
                                         _shared(run, reference, check) if claims else None)
            if finding.verdict == "unknown" and claims:
                finding = _misshapen(diagnoser, reference, ranks, check, unproven) or finding
            findings.append(_about(check, finding, named=len(checks) > 1))
    findings.sort(key=lambda f: f.verdict != "discrepancy")
    notes.extend(sorted(run.rules.assumptions))
    return Proof(findings, len(run.rules.u), notes, calls, [c.label for c in checks[checked:]], ranks)


def _seed_holds(run: Execution, reference: Graph, ranks: list[Graph], checks: list[Check]) -> Callable[[], bool]:
    """Whether the loss claim and a claim of a rank's own value (a gradient) are proven: the
    backward starts from a seed scaled right, so a gradient off by a factor went wrong on its own
    way back. Asked only where that decides a finding: it proves further claims."""
    def proven(check: Check) -> bool:
        return not unproven_outputs(run, reference, ranks, check, [])

    def holds() -> bool:
        losses = [check for check in checks if check.relation == LOSS]
        return bool(losses) and all(map(proven, losses)) and any(proven(c) for c in checks if c.relation == "rank")

    return functools.cache(holds)


def _expected_terms(run: Execution, ranks: list[Graph], check: Check, unproven: list[tuple[int, int]]) -> dict[tuple[int, int], int]:
    """The term each unproven rank output must equal, where the claim names one per rank."""
    if check.relation != "rank":
        return {}
    by_rank = {g.rank: g for g in ranks}
    return {(r, i): run.ranks[r][by_rank[r].outputs[check.expected]] for r, i in unproven}


def _claimed(reference: Graph, checks: list[Check]) -> Claimed | None:
    """The layout the first shard claim cuts its reference output in, with that output's shape:
    the share of a dim each rank's inputs are cut in, where they are cut like the output."""
    for check in checks:
        if _sharded(check):
            return check.relation, reference[reference.outputs[check.expected]].shape
    return None


def _replicated_term(run: Execution, reference: Graph, check: Check) -> int | None:
    """The reference value every rank's output must equal whole, for a replicated output."""
    if check.relation in ("rank", LOSS) or _sharded(check):
        return None
    return run.reference[reference.outputs[check.expected]]


def _shared(run: Execution, reference: Graph, check: Check) -> Shared | None:
    """A claim cutting a reference output over all ranks, with that output's term."""
    if check.ranks is not None or not _sharded(check):
        return None
    return check.relation, run.reference[reference.outputs[check.expected]]


def _sharded(check: Check) -> bool:
    """Whether the claim cuts a reference output over the ranks (Shard or zigzag)."""
    return check.relation not in ("rank", LOSS) and check.relation[0] in ("shard", "zigzag")


def _misshapen(diagnoser: Diagnoser, reference: Graph, ranks: list[Graph], check: Check, unproven: list[tuple[int, int]]) -> Finding | None:
    """A rank output claimed equal to a reference output (not one shard of it) but of another
    shape differs from it, whatever the values (a gather left out): where no other fault explains it."""
    if check.relation == "rank" or check.relation[0] in ("shard", "zigzag"):
        return None
    wanted = reference[reference.outputs[check.expected]]
    for rank, index in unproven:
        node = ranks[rank][ranks[rank].outputs[index]]
        if node.shape != wanted.shape:
            return diagnoser.wrong_shape(rank, node, wanted)
    return None


def _about(check: Check, finding: Finding, named: bool) -> Finding:
    """The finding as one about `check`, saying which claim failed (the output, loss, gradient or
    parameter) when there is more than one, and always in training."""
    message = f"{check.label}: {finding.message}" if named or check.relation in (LOSS, "rank") else finding.message
    return replace(finding, claim=check.label, message=message)


def unproven_outputs(run: Execution, reference: Graph, ranks: list[Graph], check: Check, notes: list[str]) -> list[tuple[int, int]]:
    """The (rank, output index) pairs where `check` is not proven. Ranks often hold the very same
    term (the result of an all-reduce): each distinct pair is compared once."""
    rules = run.rules
    same = functools.cache(lambda term, expected: _equal(run, term, expected))
    ranks = check.holders(ranks)
    actual = [run.ranks[g.rank][g.outputs[check.actual]] for g in ranks]
    if check.relation == "rank":
        expected = [run.ranks[g.rank][g.outputs[check.expected]] for g in ranks]
        return [(g.rank, check.actual) for g, a, e in zip(ranks, actual, expected) if not same(a, e)]
    wanted = run.reference[reference.outputs[check.expected]]
    if check.relation == LOSS:
        if all(same(a, wanted) for a in actual):
            return []
        mean = rules.lin([(a, Fraction(1, len(actual))) for a in actual])
        if same(mean, wanted):
            notes.append(f"{check.label}: the mean of the {len(actual)} ranks' values equals the reference value")
            return []
        return [(g.rank, check.actual) for g in ranks]
    if check.relation[0] in ("shard", "zigzag"):
        whole = _joined(rules, actual, check.relation, len(rules.shape(wanted)))
        if whole is not None and same(whole, wanted):
            return []
        off = [g for i, (g, a) in enumerate(zip(ranks, actual)) if not _holds_share(rules, a, wanted, check.relation, i, len(ranks), same)]
        return [(g.rank, check.actual) for g in off or ranks]
    return [(g.rank, check.actual) for g, a in zip(ranks, actual) if not same(a, wanted)]


def _joined(rules: Rules, actual: list[int], relation: Output, ndim: int) -> int | None:
    """The ranks' outputs put together as `relation` says the reference's is cut (None: they cannot be)."""
    dim = relation[1] % ndim
    if relation[0] == "shard":
        return rules.cat(actual, dim)
    halves = []
    for term in actual:
        size = rules.shape(term)[dim]
        if size % 2:
            return None
        halves.append([rules.slice(term, box_along(rules.shape(term), dim, h * size // 2, (h + 1) * size // 2)) for h in (0, 1)])
    return rules.cat([halves[rank][half] for rank, half in zigzag_chunks(len(actual))], dim)


def _holds_share(rules: Rules, term: int, wanted: int, relation: Output, index: int, holders: int,
                 same: Callable[[int, int], bool]) -> bool:
    """Whether the `index`-th holder's output is proven the share of `wanted` the claim gives it:
    such a rank is no fault of the joined output's, whatever the others hold."""
    share = claimed_share(rules, wanted, relation[0], relation[1] % len(rules.shape(wanted)), index, holders)
    return share is not None and same(term, share)


def _equal(run: Execution, term: int, expected: int) -> bool:
    """Same normal form, or equal by equality saturation over the algebra the rules leave out
    (associativity/commutativity of products, distributivity; see egraph/saturate.py)."""
    return term == expected or prove_equal(run.rules.u, term, expected)
