"""The one driver: prove a front end's programs, diagnose what fails, confirm it numerically, report.

Every front end (a case file traced through PyTorch, HLO or FX graph dumps) turns its input into
`Candidate`s and nothing more; what a verdict means, when a discrepancy stands and what the report
says are decided here, once. A front end may offer several readings of its input (imported graphs:
other input layouts), the most plausible first: they are proven in turn until one is proven
equivalent, else the first one's result is reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

from shardproof.errors import CaseError, UnsupportedOp
from shardproof.findings import combined, confirmed, failing_claims
from shardproof.gc_tuning import fewer_collections
from shardproof.ir.graph import Graph, Node
from shardproof.partition.structure import structural
from shardproof.programs import LOSS, Captured, NumericResult
from shardproof.prove import Proof, prove
from shardproof.report.model import Report, Site
from shardproof.report.rank_flow import NUMBER, chosen_on, cut_lines, rank_choice, returned_at
from shardproof.report.role_flow import role_first
from shardproof.report.saved_flow import saved_origin


@dataclass
class Candidate:
    """One reading of the input, ready to prove."""

    captured: Captured
    world_size: int
    numbers: Callable[[], NumericResult]  # both sides run on random values, claim by claim
    elements: int  # how large the numeric run is (past findings.NUMERIC_CHECK_LIMIT it is not run)
    unconfirmable: str = ""  # why no discrepancy of this reading can be confirmed: it then stays unknown
    inputs: list[str] = field(default_factory=list)  # the input relations this reading assumes
    outputs_compared: str | None = None  # "3 of 5" when only some outputs are claims
    caveat: str = ""  # what the proof could not see, added to a diagnosis
    entries: frozenset[tuple[str, int]] = frozenset()  # where the distributed side's functions start (rank_flow)
    builds: tuple[str, int] | None = None  # where the function building a rank's model starts (file, first line)


def verify_candidates(
    front_end: Callable[[], Iterable[Candidate]], world_size: int = 0, progress: Callable[[str], None] = lambda _: None
) -> Report:
    """Prove the front end's candidates in turn; confirm a discrepancy; report. `world_size`
    is reported when the front end stops at an op without rules before offering a candidate."""
    start = time.perf_counter()
    with fewer_collections():
        try:
            proof, chosen = _first_proven(front_end(), progress)
        except UnsupportedOp as err:
            return _no_rule(err, world_size, time.perf_counter() - start)
        if proof.verdict == "discrepancy":
            proof.findings = _confirmed(proof, chosen, progress)
        if chosen.captured.refused and proof.verdict != "discrepancy":
            raise CaseError(chosen.captured.refused)
        return _report(proof, chosen, time.perf_counter() - start)


def _first_proven(candidates: Iterable[Candidate], progress: Callable[[str], None]) -> tuple[Proof, Candidate]:
    first: tuple[Proof, Candidate] | None = None
    for attempt, candidate in enumerate(candidates):
        progress("proving" if attempt == 0 else f"proving with other input relations (attempt {attempt + 1})")
        proof = prove(candidate.captured, progress)
        if first is None or proof.verdict == "equivalent":
            first = (proof, candidate)
        if proof.verdict == "equivalent":
            break
    if first is None:
        raise ValueError("the front end offered no program to prove")
    return first


def _confirmed(proof: Proof, candidate: Candidate, progress: Callable[[str], None]) -> list:
    if candidate.unconfirmable:
        unsure = f"(not confirmed: {candidate.unconfirmable})"
        return [replace(f, verdict="unknown", message=f"{f.message} {unsure}") for f in proof.findings]
    progress("confirming the discrepancy on random values")
    return confirmed(candidate.numbers, proof.findings, candidate.elements)


def _no_rule(err: UnsupportedOp, world_size: int, seconds: float) -> Report:
    """The front end stopped at an op it cannot lower."""
    return Report("unknown", world_size, seconds, 0, 0, str(err), kind="unknown", unknown={"op": err.op, "reason": str(err)})


def _report(proof: Proof, candidate: Candidate, seconds: float) -> Report:
    """Verdict, figures, the sites a finding names, and what the proof assumed."""
    captured = candidate.captured
    report = Report(
        proof.verdict,
        candidate.world_size,
        seconds,
        captured.reference.op_count(),
        sum(structural(g, "op count", Graph.op_count) for g in captured.ranks),
        capture_seconds=captured.seconds,
        terms=proof.terms,
        notes=proof.notes,
        calls_proven=proof.calls.proven if proof.calls else 0,
        calls_reused=proof.calls.reused if proof.calls else 0,
        inputs=candidate.inputs,
        outputs_compared=candidate.outputs_compared,
    )
    if not proof.findings:
        report.proven = [check.label for check in captured.checks]
    else:
        finding = combined(proof.findings, proof.unchecked)
        report.claims = failing_claims(proof.findings)
        report.kind, report.claim, report.fix, report.regions = finding.kind, finding.claim, finding.fix, finding.regions
        report.diagnosis = finding.message + (f"; note: {candidate.caveat}" if candidate.caveat else "")
        located = _located_first(_unique([s for rank, node in finding.distributed for s in _sites(node, rank)]))
        graphs = {graph.rank: graph for graph in proof.ranks}
        cuts = list(dict.fromkeys(line for rank, node in finding.distributed if rank in graphs
                                  for line in cut_lines(graphs[rank], [node])))
        report.distributed = _rank_choice_first(located, candidate.entries, cuts)
        if finding.kind == "unmatched message" and report.distributed[:1] == located[:1]:  # no rank lost to the peer's
            report.distributed = role_first(report.distributed, finding.distributed, captured.ranks, candidate.entries)
        if finding.claim != LOSS and LOSS in report.claims:
            report.distributed = _saved_value_first(report.distributed)
        if captured.unheld and candidate.builds is not None:
            _unheld_first(report, captured.unheld, candidate.builds)
        report.reference = _located_first(_unique([_site(node, None) for node in finding.reference]))
        if finding.verdict == "unknown":
            report.unknown = {"op": finding.op or "", "reason": report.diagnosis}
    return report


def _unheld_first(report: Report, name: str, builds: tuple[str, int]) -> None:
    """A parameter the reference trains that no rank's model holds is a fault whatever the proof
    finds, and the faults found follow from it (a stage without its layers computes other values):
    the line returning a rank's model leads, with what to do there."""
    found = returned_at(*builds)
    if found is None:
        return
    line, code = found
    rank = report.distributed[0].rank if report.distributed else 0
    built = Site(builds[0], line, code, f"no rank's model holds `{name}`", rank)
    report.distributed = _unique([built, *report.distributed])
    report.diagnosis += f"; note: no rank's model holds `{name}`, which the reference trains"
    report.fix = f"build the ranks' models at line {line} of {builds[0].rsplit('/', 1)[-1]} so that one of them holds `{name}`"


def _sites(node: Node, rank: int) -> list[Site]:
    """A distributed op's site, after the line that chose the rank its offsets stand for when that
    is another: a rank's neighbour or group picked wrongly is fixed there. Not when the op's line
    picks a neighbour of that rank itself (`chunk(tp)[(tp_rank + 1) % world_size]` after
    `tp_rank = rank % tp`): the symbolic rank remembers only the first regrouping."""
    chosen = node.loc.rank_chosen if node.loc else None
    own = _site(node, rank)
    if chosen is None:
        return [own]
    earlier = Site(chosen.file, chosen.line, chosen.code, f"rank for {own.op}", rank, node.name)
    return [own, earlier] if chosen_on(own.file, own.line) is not None else [earlier, own]


def _rank_choice_first(sites: list[Site], entries: frozenset[tuple[str, int]],
                       cuts: Iterable[tuple[str, int]] = ()) -> list[Site]:
    """The sites, after the line that gave a name holding a rank a number or a regrouped rank,
    found from the first of them that leads to one (a constant, or a rank pinned to an int, leaves
    no trace in the symbolic rank: rank_flow reads the source); unless the first site already
    names the line that chose a rank, or picks one itself (see `chosen_on`; a neighbour picked
    there gives way only to a number further back, as in rank_flow). A number found from the lines
    that cut the values the sites read from the rank's state and inputs (`cuts`, see
    rank_flow.cut_lines) comes before a regrouped rank, and before the line that chose the rank a
    site's offsets stand for: those offsets are right when the state was cut for another rank."""
    here = chosen_on(sites[0].file, sites[0].line) if sites else None
    if not sites or here is not None and here.what == NUMBER:
        return sites
    chosen = sites[0].op.startswith("rank for ")
    found = None if chosen else next(((choice, site) for site in sites
                                      if (choice := rank_choice(site.file, site.line, entries)) is not None
                                      and (here is None or choice.what == NUMBER)), None)
    if found is None or found[0].what != NUMBER:
        cut = next((choice for file, line in cuts if (choice := rank_choice(file, line, entries)) is not None
                    and choice.what == NUMBER), None)
        found = found if cut is None else (cut, sites[0])
    if found is None or (found[0].file, found[0].line) == (sites[0].file, sites[0].line):
        return sites
    choice, site = found
    used = site.op.removeprefix("rank for ")
    named = Site(choice.file, choice.line, choice.code,
                 f"{f'`{choice.name}` = ' if choice.name else ''}`{choice.value}`, {choice.what}, for {used}",
                 site.rank, site.node)
    return _unique([named, *sites])


def _saved_value_first(sites: list[Site]) -> list[Site]:
    """The sites, after the forward's line that computed the number the first one (a line of an
    autograd Function's backward weighing a term by it) reads from `ctx`: the loss fails too, so
    the number was already wrong in the forward (see saved_flow)."""
    origin = saved_origin(sites[0].file, sites[0].line) if sites else None
    if origin is None:
        return sites
    saved = Site(origin.file, origin.line, origin.code, f"`{origin.name}`, saved for the backward's line {origin.used}",
                 sites[0].rank, sites[0].node)
    return _unique([saved, *sites])


def _site(node: Node, rank: int | None) -> Site:
    loc = node.loc
    op = f"{node.op} in the backward" if loc and loc.backward else node.op
    return Site(loc.file if loc else "?", loc.line if loc else 0, loc.code if loc else node.name, op, rank, node.name)


def _located_first(sites: list[Site]) -> list[Site]:
    """The sites in the finding's order, those with no line of the user's (a slice of a layout the
    tool inferred, not one a loader wrote) after the rest: the first site is a line to open."""
    return sorted(sites, key=lambda site: site.line == 0)


def _unique(sites: list[Site]) -> list[Site]:
    seen, out = set(), []
    for site in sites:
        key = (site.file, site.line, site.rank)
        if key not in seen:
            seen.add(key)
            out.append(site)
    return out
