"""`shardproof.verify`: capture, prove, report."""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path
from typing import Callable

import torch

from shardproof.capture.torch_capture import Captured, capture
from shardproof.case import Case, load_case, normalize_output
from shardproof.errors import UnsupportedOp
from shardproof.findings import combined, confirmed, failing_claims
from shardproof.gc_tuning import fewer_collections
from shardproof.ir.graph import Graph, Node
from shardproof.oracle import run_numeric
from shardproof.partition.backends import placement
from shardproof.partition.structure import structural
from shardproof.prove import Proof, prove
from shardproof.report.model import Report, Site


def verify(
    case: Case | str | Path | None = None,
    *,
    reference: Callable[[], torch.nn.Module] | None = None,
    distributed: Callable[[int, int], torch.nn.Module] | None = None,
    inputs: Callable[[], tuple] | None = None,
    world_size: int | None = None,
    shard_state: Callable | None = None,
    shard_input: Callable | None = None,
    output: str | tuple = "replicate",
    loss: Callable[..., torch.Tensor] | None = None,
    distributed_step: Callable[..., torch.Tensor] | None = None,
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    preset: str | None = None,
    train: bool = False,
    step: bool = False,
    progress: Callable[[str], None] = lambda _: None,
    backend: str = "local",
    ray_address: str | None = None,
    memo: bool = True,
) -> Report:
    """Prove the distributed model equals the reference, or say where it does not.

    Pass a case (a Case or the path of a case file) or its parts as keywords. `train` proves one
    training step's loss and gradients instead of the forward outputs; `step` also the parameters
    after the optimizer step (it implies `train`); without either, the case's MODE decides.
    `backend` says where ranks are traced: "local" (a process pool when that pays off), "ray" (a
    Ray cluster at `ray_address` or RAY_ADDRESS), "none" (this process). `memo`: trace and prove
    repeated modules once (off only to measure what that saves). Raises ShardproofError subclasses for unusable
    input (missing file, untraceable model, ...).
    """
    if case is None:
        if reference is None or distributed is None or inputs is None:
            raise TypeError("verify() needs a case file, or reference=, distributed= and inputs=")
        case = Case(reference, distributed, inputs, world_size or 2, shard_state, shard_input, normalize_output(output),
                    loss, distributed_step, optimizer)
    elif not isinstance(case, Case):
        case = load_case(case)
    if preset is not None:
        case.use_preset(preset)
    n = world_size or case.world_size
    mode = case.resolve_mode(train, step)
    with fewer_collections():
        return _verify(case, n, mode, progress, backend, ray_address, memo)


def _verify(
    case: Case, n: int, mode: str, progress: Callable[[str], None], backend: str, ray_address: str | None, memo: bool
) -> Report:
    start = time.perf_counter()
    try:
        captured = capture(case, n, progress, mode, memo, placement(backend, case, n, memo, ray_address))
    except UnsupportedOp as err:
        return Report("unknown", n, time.perf_counter() - start, 0, 0, str(err), unknown={"op": err.op, "reason": str(err)})
    progress("proving")
    proof = prove(captured, progress)
    if proof.verdict == "discrepancy":
        progress("confirming the discrepancy on random weights")
        numbers = functools.partial(run_numeric, case, n, mode=mode)
        proof.findings = confirmed(numbers, proof.findings, _state_elements(captured.reference))
    return proof_report(proof, captured, n, time.perf_counter() - start)


def proof_report(proof: Proof, captured: Captured, world_size: int, seconds: float) -> Report:
    """The report of a finished proof: verdict, figures, and the sites a finding names."""
    report = Report(
        proof.verdict,
        world_size,
        seconds,
        captured.reference.op_count(),
        sum(structural(g, "op count", Graph.op_count) for g in captured.ranks),
        capture_seconds=captured.seconds,
        terms=proof.terms,
        notes=proof.notes,
        calls_proven=proof.calls.proven if proof.calls else 0,
        calls_reused=proof.calls.reused if proof.calls else 0,
    )
    if proof.findings:
        finding = combined(proof.findings, proof.unchecked)
        report.claims = failing_claims(proof.findings)
        report.diagnosis = finding.message
        report.distributed = _unique([_site(node, rank) for rank, node in finding.distributed])
        report.reference = _unique([_site(node, None) for node in finding.reference])
        if finding.verdict == "unknown":
            report.unknown = {"op": finding.op or "", "reason": finding.message}
    return report


def _state_elements(reference: Graph) -> int:
    return sum(math.prod(n.shape) for n in reference.nodes if n.op == "leaf")


def _site(node: Node, rank: int | None) -> Site:
    loc = node.loc
    op = f"{node.op} in the backward" if loc and loc.backward else node.op
    return Site(loc.file if loc else "?", loc.line if loc else 0, loc.code if loc else node.name, op, rank, node.name)


def _unique(sites: list[Site]) -> list[Site]:
    seen, out = set(), []
    for site in sites:
        key = (site.file, site.line, site.rank)
        if key not in seen:
            seen.add(key)
            out.append(site)
    return out
