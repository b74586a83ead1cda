"""Numeric oracle: run the reference and every rank on small random float64 weights and compare.

It checks the verifier, not the user: a case whose numbers differ must never be proven equivalent.

All ranks run in this process, one thread each, on torch's threaded process group
(`torch.testing._internal.distributed.multi_threaded_pg`). Unlike `LocalTensorMode`, which runs one
SPMD program over per-rank values, threads let each rank build its own model with
`case.distributed(rank, world_size)` (rank-dependent shapes and Python control flow included), and
c10d collectives, functional collectives and DTensor all get real collective semantics. Spawning
gloo processes would do the same at roughly 100x the start-up cost.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)
from torch.utils import _pytree as pytree

from shardproof.case import Case, Output
from shardproof.state import module_state, rank_inputs, rank_state

# The threaded process group swaps torch's global c10d world: one oracle run at a time.
_LOCK = threading.Lock()
# A rank still running this long after the first rank finished waits for a collective its peers never issue.
_HANG_GRACE_S = 1.0


@dataclass
class NumericResult:
    """The verdict of one numeric run; `detail` names the worst rank so a failure can be found."""

    agree: bool
    max_abs_error: float
    max_rel_error: float  # relative to max |reference|
    detail: str  # human-readable, e.g. "rank 1 differs by 3.2e-1"


@dataclass
class _Check:
    """One rank's output against its part of one reference output."""

    error: float
    relative: float
    ok: bool
    detail: str


class _Mismatch(Exception):
    """Outputs that cannot even be compared (shapes, structure): a disagreement, not a crash."""


def run_numeric(case: Case, world_size: int, seed: int = 0, atol: float = 1e-6, rtol: float = 1e-6) -> NumericResult:
    """Agree when every rank output is within `atol + rtol * max|reference|` of its part of the reference."""
    with _LOCK, _default_dtype(torch.float64), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref = case.reference()
        _randomise_parameters(ref)
        inputs = pytree.tree_map_only(torch.Tensor, _random_like, tuple(case.inputs()))
        ref_state = module_state(ref)
        outputs, hung = _run_ranks(lambda rank: _rank_output(case, ref_state, inputs, rank, world_size), world_size)
        if hung:
            return NumericResult(False, math.inf, math.inf, f"ranks {hung} never finished: they wait in a "
                                 "collective that the other ranks do not issue")
        ref_out = _plain(ref(*inputs))
    try:
        return _compare(ref_out, outputs, case.output_layout(), atol, rtol)
    except _Mismatch as mismatch:
        return NumericResult(False, math.inf, math.inf, str(mismatch))


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _randomise_parameters(model: torch.nn.Module) -> None:
    """Non-zero random weights, so zero-initialised biases and unit norms cannot hide a bug.

    Buffers keep their values: they are mostly computed constants (rotary tables, masks, running
    variances) that a distributed model may rebuild itself rather than load.
    """
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.copy_(torch.randn_like(param) * 0.5)


def _random_like(x: torch.Tensor) -> torch.Tensor:
    """Floats become random; integer inputs (token ids, positions) stay as the case made them valid."""
    return torch.randn_like(x) if x.is_floating_point() else x


def _rank_output(case: Case, ref_state: dict, inputs: tuple, rank: int, world_size: int) -> Any:
    """One rank's output, as plain tensors. Threads share memory, real ranks do not: copy what a rank may mutate."""
    model = case.distributed(rank, world_size)
    state = rank_state(case, _private(ref_state), model, rank, world_size)
    local_inputs = rank_inputs(case, _private(inputs), rank, world_size)
    return _plain(functional_call(model, state, local_inputs))


def _private(tree: Any) -> Any:
    """Copy every tensor once (tied weights stay tied), keeping `requires_grad`."""
    copies: dict[int, torch.Tensor] = {}

    def copy(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in copies:
            copies[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
        return copies[id(t)]

    return pytree.tree_map_only(torch.Tensor, copy, tree)


def _plain(tree: Any) -> Any:
    """Local, completed, detached tensors: what a rank actually holds."""

    def local(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            t = t.to_local()
        if isinstance(t, AsyncCollectiveTensor):
            t = t.wait()
        return t.detach()

    return pytree.tree_map_only(torch.Tensor, local, tree)


def _run_ranks(fn: Callable[[int], Any], world_size: int) -> tuple[list[Any], list[int]]:
    """Run `fn(rank)` on every rank concurrently; return the results and the ranks that hung."""
    store = dist.HashStore()
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
            try:
                results[rank] = fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = err
            ProcessLocalGroup.exception_handle(err)  # wake peers blocked in a collective

    threads = [threading.Thread(target=body, args=(r,), name=f"shardproof-rank{r}", daemon=True)
               for r in range(world_size)]
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        for thread in threads:
            thread.start()
        hung = _join(threads)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    _raise_first_error(errors, hung)
    return [results.get(r) for r in range(world_size)], hung


def _join(threads: list[threading.Thread]) -> list[int]:
    """Wait for every rank; wake and report the ranks still running well after the first one finished."""
    start = time.monotonic()
    deadline = math.inf
    while alive := [i for i, t in enumerate(threads) if t.is_alive()]:
        now = time.monotonic()
        if len(alive) < len(threads) and deadline == math.inf:
            deadline = now + max(_HANG_GRACE_S, 2 * (now - start))
        if now > deadline:
            ProcessLocalGroup.exception_handle(None)  # blocked ranks exit their collective
            for i in alive:
                threads[i].join(_HANG_GRACE_S)
            return alive
        threads[alive[0]].join(0.005)
    return []


def _raise_first_error(errors: dict[int, BaseException], hung: list[int]) -> None:
    """A rank's own exception is the user's to see; peers it woke only exit with SystemExit."""
    for rank, err in sorted(errors.items()):
        if not isinstance(err, SystemExit):
            err.add_note(f"raised on rank {rank} of the numeric oracle")
            raise err
    if not hung and errors:
        raise RuntimeError(f"ranks {sorted(errors)} exited without an error")


def _compare(ref_out: Any, rank_outs: list[Any], layout: Output, atol: float, rtol: float) -> NumericResult:
    ref_leaves, ref_spec = pytree.tree_flatten(ref_out)
    per_rank = [_leaves_like(out, ref_spec, rank) for rank, out in enumerate(rank_outs)]
    checks = [check for i, ref in enumerate(ref_leaves)
              for check in _check_leaf(ref, [leaves[i] for leaves in per_rank], layout, atol, rtol,
                                       f" in output leaf {i}" if len(ref_leaves) > 1 else "")]
    max_abs = max((c.error for c in checks), default=0.0)
    max_rel = max((c.relative for c in checks), default=0.0)
    failed = [c for c in checks if not c.ok]
    if failed:
        return NumericResult(False, max_abs, max_rel, max(failed, key=lambda c: c.error).detail)
    return NumericResult(True, max_abs, max_rel, f"all {len(rank_outs)} ranks agree, max error {max_abs:.1e}")


def _check_leaf(ref: Any, outs: list[Any], layout: Output, atol: float, rtol: float, where: str) -> list[_Check]:
    if not isinstance(ref, torch.Tensor):
        if any(out != ref for out in outs):
            raise _Mismatch(f"non-tensor output{where} differs: ranks {outs}, reference {ref!r}")
        return []
    scale = _max_abs(ref)
    checks = []
    for rank, (got, want) in enumerate(zip(outs, _expected(ref, outs, layout, where))):
        err, index = _max_error(got, want)
        rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
        detail = f"rank {rank} differs by {err:.1e}{where} at index {index} (reference max |x| {scale:.1e})"
        checks.append(_Check(err, rel, err <= atol + rtol * scale, detail))
    return checks


def _leaves_like(out: Any, ref_spec: pytree.TreeSpec, rank: int) -> list[Any]:
    leaves, spec = pytree.tree_flatten(out)
    if spec != ref_spec:
        raise _Mismatch(f"rank {rank} returns {spec}, the reference returns {ref_spec}")
    return leaves


def _expected(ref: torch.Tensor, outs: list[Any], layout: Output, where: str) -> list[torch.Tensor]:
    """The part of the reference each rank should hold under `layout`; shape errors are mismatches."""
    for rank, out in enumerate(outs):
        if not isinstance(out, torch.Tensor):
            raise _Mismatch(f"rank {rank} returns {type(out).__name__}{where}, the reference a tensor")
    if layout == ("replicate",):
        wants = [ref] * len(outs)
    else:
        wants = _shards(ref, outs, layout[1], where)
    for rank, (out, want) in enumerate(zip(outs, wants)):
        if out.shape != want.shape:
            raise _Mismatch(f"rank {rank} output{where} has shape {tuple(out.shape)}, expected "
                            f"{tuple(want.shape)} ({'/'.join(map(str, layout))} of reference {tuple(ref.shape)})")
    return wants


def _shards(ref: torch.Tensor, outs: list[torch.Tensor], dim: int, where: str) -> list[torch.Tensor]:
    if not -ref.dim() <= dim < ref.dim() or any(out.dim() != ref.dim() for out in outs):
        raise _Mismatch(f"rank outputs{where} {[tuple(o.shape) for o in outs]} cannot be shards along dim "
                        f"{dim} of the reference {tuple(ref.shape)}")
    sizes = [out.shape[dim] for out in outs]
    if sum(sizes) != ref.shape[dim]:
        raise _Mismatch(f"rank shards{where} concatenate to {sum(sizes)} along dim {dim}, the reference "
                        f"has {ref.shape[dim]} (rank sizes {sizes})")
    return list(ref.split(sizes, dim))


def _max_abs(t: torch.Tensor) -> float:
    return t.double().abs().max().item() if t.numel() else 0.0


def _max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, tuple[int, ...]]:
    """Largest absolute difference (NaN counts as infinite) and where it is."""
    if not got.numel():
        return 0.0, ()
    diff = torch.nan_to_num((got.double() - want.double()).abs(), nan=math.inf)
    flat = int(diff.argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return diff.flatten()[flat].item(), index
