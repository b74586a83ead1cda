"""`shardproof.verify`: the PyTorch front end. A case is traced into programs the driver proves."""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Callable, Iterator

import torch

from shardproof.capture.torch_capture import capture
from shardproof.case import Case, load_case, normalize_output
from shardproof.driver import Candidate, verify_candidates
from shardproof.errors import CaseError
from shardproof.ir.graph import Graph
from shardproof.oracle import run_numeric
from shardproof.partition.backends import placement
from shardproof.programs import Captured
from shardproof.report.model import Report


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
        case = Case(reference, distributed, inputs, 2 if world_size is None else world_size, shard_state, shard_input, normalize_output(output),
                    loss, distributed_step, optimizer)
    elif not isinstance(case, Case):
        case = load_case(case)
    if preset is not None:
        case.use_preset(preset)
    n = case.world_size if world_size is None else world_size
    if not isinstance(n, int) or n < 1:
        raise CaseError(f"the world size must be a whole number of ranks, at least 1; got {n!r}")
    mode = case.resolve_mode(train, step)

    def front_end() -> Iterator[Candidate]:
        captured = capture(case, n, progress, mode, memo, placement(backend, case, n, memo, ray_address))
        numbers = functools.partial(run_numeric, case, n, mode=mode)
        yield Candidate(captured, n, numbers, _state_elements(captured.reference), caveat=_indivisible(captured, n),
                        entries=_entries(case), builds=_start(case.distributed))

    with case.importable():
        return verify_candidates(front_end, n, progress)


def _entries(case: Case) -> frozenset[tuple[str, int]]:
    """Where the distributed side's own functions start (file, first line; a class's `__init__`):
    the report follows a rank back only through the calls they make."""
    starts = (_start(f) for f in (case.distributed, case.shard_state, case.shard_input, case.distributed_step))
    return frozenset(start for start in starts if start is not None)


def _start(function: Callable | None) -> tuple[str, int] | None:
    code = getattr(function.__init__ if isinstance(function, type) else function, "__code__", None)
    return None if code is None else (code.co_filename, code.co_firstlineno)


def _state_elements(reference: Graph) -> int:
    return sum(math.prod(n.shape) for n in reference.nodes if n.op == "leaf")


def _indivisible(captured: Captured, world_size: int) -> str:
    """The reference state sizes a rank's loader cuts into `world_size` shares although the world
    size does not divide them (16 rows, 3 ranks: 5 each, one row lost), with the loader's line: when
    the proof fails, the likelier fix is another world size than the code the diagnosis points at."""
    graph = captured.ranks[0]
    found: dict[str, None] = {}
    for node in graph.nodes:
        source = graph[node.inputs[0]] if node.op == "slice" else None
        if source is None or source.op != "leaf" or not str(source.attrs[0]).startswith("state:"):
            continue
        dim, lo, hi = node.attrs[:3]
        full = source.shape[dim]
        if isinstance(lo, int) and isinstance(hi, int) and full % world_size and hi - lo in (full // world_size, -(-full // world_size)):
            where = f" at {node.loc.short()}" if node.loc else ""
            found[f"size {full} of `{source.attrs[0].split(':', 1)[1]}` (dim {dim}) is not divisible by world size "
                  f"{world_size}: each rank takes {hi - lo}{where}"] = None
    return "; ".join(found)
