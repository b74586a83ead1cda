"""Numeric oracle: run the reference and every rank on small random float64 weights and compare.

It checks the verifier, not the user: a case whose numbers differ must never be proven equivalent.

All ranks run in this process, one thread each, on torch's threaded process group
(`torch.testing._internal.distributed.multi_threaded_pg`). Unlike `LocalTensorMode`, which runs one
SPMD program over per-rank values, threads let each rank build its own model with
`case.distributed(rank, world_size)` (rank-dependent shapes and Python control flow included), and
c10d collectives, functional collectives and DTensor all get real collective semantics (and
point-to-point messages, `threaded_p2p.py`). Spawning
gloo processes would do the same at roughly 100x the start-up cost.
"""

from __future__ import annotations

import math
import sysconfig
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions, AllreduceOptions, ReduceScatterOptions
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss as loss_module
from torch.testing._internal.distributed import multi_threaded_pg
from torch.testing._internal.distributed.multi_threaded_pg import (
    ProcessLocalGroup,
    _install_threaded_pg,
    _uninstall_threaded_pg,
)
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from shardproof.capture.hops import is_higher_order, through_dense
from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.programs import LOSS, Check, NumericResult, Output
from shardproof.state import module_state
from shardproof.steps import Program, Trained, program_for
from shardproof.threaded_p2p import point_to_point

# The threaded process group swaps torch's global c10d world: one oracle run at a time.
_LOCK = threading.Lock()
# A rank still running this long after the first rank finished waits for a collective its peers never issue.
_HANG_GRACE_S = 1.0


@dataclass
class _Check:
    """One rank's output against its part of one reference output."""

    error: float
    relative: float
    ok: bool
    detail: str


class _Mismatch(Exception):
    """Outputs that cannot even be compared (shapes, structure): a disagreement, not a crash."""


def run_numeric(
    case: Case, world_size: int, seed: int = 0, atol: float = 1e-6, rtol: float = 1e-6, mode: str | None = None
) -> NumericResult:
    """Agree when every check of the case's program (steps.py) holds on every rank to within
    `atol + rtol * max|expected|`."""
    with _LOCK, numeric_setting(seed), case.importable():
        reference = _run_ranks(lambda _: run_reference(case, mode or case.mode), 1)[0][0]
        runs, hung = _run_ranks(lambda rank: run_rank(case, reference, rank, world_size), world_size)
        if hung:
            return NumericResult(False, math.inf, math.inf, f"ranks {hung} never finished: they wait in a "
                                 "collective that the other ranks do not issue")
    return judge(reference, runs, atol, rtol)


@dataclass
class ReferenceRun:
    """The reference's random state and inputs, its program and what it computed from them."""

    state: dict
    inputs: tuple
    program: Program
    outputs: list[torch.Tensor]

    @property
    def bound(self) -> list[torch.Tensor]:
        """The reference outputs every rank program receives (steps.Program.bound)."""
        return [self.outputs[i] for i in self.program.bound]


@contextmanager
def numeric_setting(seed: int) -> Iterator[None]:
    """Where both sides run: float64, compiled code as the eager code it compiles, a seeded RNG."""
    with torch.compiler.set_stance("force_eager"), _default_dtype(torch.float64), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def run_reference(case: Case, mode: str) -> ReferenceRun:
    """The reference on random weights and inputs, run as rank 0 of a world of one (code asking for
    its process group gets one, as under capture); call inside `numeric_setting`."""
    with _RealFloats():  # dispatch modes are per thread
        ref = case.reference()
        _randomise_parameters(ref)
        inputs = pytree.tree_map_only(torch.Tensor, _random_like, tuple(case.inputs()))
        program = program_for(case, ref, mode)
        state = module_state(ref)
        outputs = [t.detach() for t in program.reference(ref, _private(state), _private(inputs))]
        return ReferenceRun(state, inputs, program, outputs)


def run_rank(case: Case, reference: ReferenceRun, rank: int, world_size: int) -> tuple[list[torch.Tensor], Trained]:
    """One rank's program on its part of the reference's state and inputs, inside its process group."""
    with _RealFloats():
        model = case.distributed(rank, world_size)
        outputs, trained = reference.program.rank(model, _private(reference.state), _private(reference.inputs), rank,
                                                  world_size, _private(reference.bound))
        return _plain(outputs), trained


def judge(reference: ReferenceRun, runs: list[tuple[list[torch.Tensor], Trained]], atol: float = 1e-6,
          rtol: float = 1e-6) -> NumericResult:
    """Every rank's run (`run_rank`) against the reference, claim by claim."""
    outputs = [outs for outs, _ in runs]
    try:
        checks = reference.program.claims(len(reference.outputs), [(len(outs), trained) for outs, trained in runs])
    except CaseError as mismatch:
        return NumericResult(False, math.inf, math.inf, str(mismatch))
    return compare(reference.outputs, outputs, checks, atol, rtol)


class _RealFloats(TorchDispatchMode):
    """Every float dtype a program asks for is float64: the prover reads casts between float types
    as the identity (equivalence over the reals), so a bf16 model with fp32 master weights is
    judged by its arithmetic, not by its rounding. Float memory allocated without values
    (`torch.empty`) holds NaN, as torch's deterministic mode fills it: a read of what nothing wrote
    shows, instead of whatever the allocator left there (often the very values the reference
    just freed)."""

    supports_higher_order_operators = True  # computed through their dense implementation (capture/hops)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if is_higher_order(func):
            return through_dense(self, func, args, kwargs or {})
        args = tuple(_real(a) for a in args)
        kwargs = {k: _real(v) for k, v in (kwargs or {}).items()}
        out = _IN_FLOAT64.get(func, func)(*args, **kwargs)
        if func.overloadpacket in _UNINITIALISED and out.is_floating_point():
            out.fill_(math.nan)
        return out


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """`aten._grouped_mm` (CPU kernels: float32 and below) as matmuls: group i of a 2-D operand is
    the slice between offsets i-1 and i of the dim the other operand does not batch."""
    if offs is None:
        out = torch.matmul(a, b)
    else:
        ends = offs.tolist()
        groups = [slice(start, end) for start, end in zip([0, *ends[:-1]], ends)]
        if a.dim() == 2 and b.dim() == 3:  # row groups of a, each times its matrix
            out = torch.cat([a[g] @ b[i] for i, g in enumerate(groups)])
        elif a.dim() == 3 and b.dim() == 2:  # column groups of b
            out = torch.cat([a[i] @ b[:, g] for i, g in enumerate(groups)], dim=1)
        else:  # both 2-D: groups of the contracted dim, one product each
            out = torch.stack([a[:, g] @ b[g] for g in groups])
    return out if bias is None else out + bias


_UNINITIALISED = {torch.ops.aten.empty, torch.ops.aten.empty_like, torch.ops.aten.new_empty, torch.ops.aten.empty_strided,
                  torch.ops.aten.new_empty_strided}  # allocations without values

# Ops torch computes only in lower precision, and their float64 implementation.
_IN_FLOAT64 = {torch.ops.aten._grouped_mm.default: _grouped_mm}


def _real(value: Any) -> Any:
    return torch.float64 if isinstance(value, torch.dtype) and value.is_floating_point else value


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
        with _flat_buffer_collectives(), _loss_parallel_shared_by_threads(), point_to_point():
            for thread in threads:
                thread.start()
            hung = _join(threads)
    finally:
        ProcessLocalGroup.reset()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    _raise_first_error(errors, hung)
    return [results.get(r) for r in range(world_size)], hung


@contextmanager
def _flat_buffer_collectives() -> Iterator[None]:
    """`all_gather_into_tensor` and `reduce_scatter_tensor` as NCCL runs them: on the buffers' flat
    memory, whatever their shapes. The threaded group chunks the shaped buffer along dim 0
    instead, which differs (and fails) when the output is not the inputs stacked on dim 0. A
    reduce-scatter reads every input before it writes an output, so one in place (the output a
    chunk of the rank's own input, Megatron's gradient buffers) sums the inputs as they were. A
    reduce-scatter with MAX, MIN or PRODUCT (the threaded group has only SUM and AVG; gloo has them
    all) is an all-reduce of every chunk of which the rank keeps its own."""
    originals = ProcessLocalGroup.all_gather_single, ProcessLocalGroup.reduce_scatter_single, ProcessLocalGroup.reduce_scatter
    summing = (dist.ReduceOp.SUM, dist.ReduceOp.AVG)

    def all_gather_single(self, output, input_, opts=AllgatherOptions()):
        chunks = list(output.view(-1).chunk(self._world_size))
        return self.allgather([chunks], [input_.reshape(-1)], opts)

    def reduce_scatter_single(self, output, input_, opts=ReduceScatterOptions()):
        return self.reduce_scatter([output.view(-1)], [list(input_.reshape(-1).clone().chunk(self._world_size))], opts)

    def reduce_scatter(self, output_tensor, scatter_list, opts=ReduceScatterOptions()):
        if opts.reduceOp in summing or len(output_tensor) != 1:
            return originals[2](self, output_tensor, scatter_list, opts)
        chunks = torch.stack([chunk.detach() for chunk in scatter_list[0]])
        reducing = AllreduceOptions()
        reducing.reduceOp = opts.reduceOp
        work = self.allreduce([chunks], reducing)
        output_tensor[0].detach().copy_(chunks[self._rank])
        return work

    (ProcessLocalGroup.all_gather_single, ProcessLocalGroup.reduce_scatter_single,
     ProcessLocalGroup.reduce_scatter) = all_gather_single, reduce_scatter_single, reduce_scatter
    try:
        yield
    finally:
        ProcessLocalGroup.all_gather_single, ProcessLocalGroup.reduce_scatter_single, ProcessLocalGroup.reduce_scatter = originals


@contextmanager
def _loss_parallel_shared_by_threads() -> Iterator[None]:
    """`loss_parallel()` installs DTensor op handlers process-wide on entry and removes them on
    exit; with every rank a thread, the first rank to leave would pull them from under the others.
    Count the ranks inside: install on the first entry, remove on the last exit."""
    lock, inside = threading.Lock(), [0]
    originals = loss_module._enable_custom_loss_ops, loss_module._disable_custom_loss_ops

    def enable() -> None:
        with lock:
            inside[0] += 1
            if inside[0] == 1:
                originals[0]()

    def disable() -> None:
        with lock:
            inside[0] -= 1
            if inside[0] == 0:
                originals[1]()

    loss_module._enable_custom_loss_ops, loss_module._disable_custom_loss_ops = enable, disable
    try:
        yield
    finally:
        loss_module._enable_custom_loss_ops, loss_module._disable_custom_loss_ops = originals


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
    """A rank's own exception is the user's to see; peers it woke only exit with SystemExit. Raised
    in the user's code, it makes the program unusable input (a real run fails there too)."""
    for rank, err in sorted(errors.items()):
        if not isinstance(err, SystemExit):
            where = _user_frame(err)
            if where is not None:
                first_line = (str(err).strip().splitlines() or [""])[0]
                raise CaseError(f"the program raises on rank {rank} at {Path(where.filename).name}:{where.lineno} "
                                f"(`{where.line}`): {type(err).__name__}: {first_line}") from err
            err.add_note(f"raised on rank {rank} of the numeric oracle")
            raise err
    if not hung and errors:
        raise RuntimeError(f"ranks {sorted(errors)} exited without an error")


def _user_frame(err: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of the user's code in the traceback; None when the error comes from the
    threaded process group's own limits (not the program's) or no user frame shows."""
    frames = traceback.extract_tb(err.__traceback__)
    if any(f.filename.startswith(_THREADED_GROUP) for f in frames):
        return None
    mine = [f for f in frames if not f.filename.startswith(_LIBRARIES)]
    return mine[-1] if mine else None


_THREADED_GROUP = str(Path(multi_threaded_pg.__file__).parent)
_LIBRARIES = tuple({str(Path(torch.__file__).parents[1]), str(Path(__file__).parent), sysconfig.get_paths()["stdlib"],
                    sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})


def compare(ref_out: list[torch.Tensor], rank_outs: list[list[torch.Tensor]], checks: list[Check], atol: float = 1e-6,
            rtol: float = 1e-6) -> NumericResult:
    """Claim by claim; outputs of the wrong shape refute their claim alone."""
    results: list[_Check] = []
    worst: dict[str, _Check] = {}  # per refuted claim, its largest failure
    for check in checks:
        try:
            checked = _check(check, ref_out, rank_outs, atol, rtol)
        except _Mismatch as mismatch:
            checked = [_Check(math.inf, math.inf, False, str(mismatch))]
        results += checked
        failed = [c for c in checked if not c.ok]
        if failed:
            worst[check.label] = max(failed, key=lambda c: c.error)
    max_abs = max((c.error for c in results), default=0.0)
    max_rel = max((c.relative for c in results), default=0.0)
    if worst:
        detail = max(worst.values(), key=lambda c: c.error).detail
        return NumericResult(False, max_abs, max_rel, detail, {label: c.detail for label, c in worst.items()})
    return NumericResult(True, max_abs, max_rel, f"all {len(rank_outs)} ranks agree, max error {max_abs:.1e}")


def _check(check: Check, ref_out: list[torch.Tensor], rank_outs: list[list[torch.Tensor]], atol: float,
           rtol: float) -> list[_Check]:
    where = f" in {check.label}"
    holders = [(rank, outs) for rank, outs in enumerate(rank_outs) if check.ranks is None or rank in check.ranks]
    actual = [outs[check.actual] for _, outs in holders]
    if check.relation == "rank":
        return [_close(rank, got, outs[check.expected], atol, rtol, where) for got, (rank, outs) in zip(actual, holders)]
    ref = ref_out[check.expected]
    if check.relation == LOSS:
        replicated = [_close(rank, got, ref, atol, rtol, where) for got, (rank, _) in zip(actual, holders)]
        if all(c.ok for c in replicated):
            return replicated
        return [_close(holders[0][0], torch.stack(actual).mean(0), ref, atol, rtol, f"{where} (mean over ranks)")]
    return [_close(rank, got, want, atol, rtol, where)
            for got, want, (rank, _) in zip(actual, _expected(ref, actual, check.relation, where), holders)]


def _close(rank: int, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, where: str) -> _Check:
    if got.shape != want.shape:
        raise _Mismatch(f"rank {rank} has shape {tuple(got.shape)}{where}, expected {tuple(want.shape)}")
    scale = _max_abs(want)
    err, index = _max_error(got, want)
    rel = err / scale if scale > 0 else (0.0 if err == 0 else math.inf)
    detail = f"rank {rank} differs by {err:.1e}{where} at index {index} (reference max |x| {scale:.1e})"
    return _Check(err, rel, err <= atol + rtol * scale, detail)


def _expected(ref: torch.Tensor, outs: list[torch.Tensor], layout: Output, where: str) -> list[torch.Tensor]:
    """The part of the reference each rank should hold under `layout`."""
    if layout == ("replicate",):
        return [ref] * len(outs)
    shards = _shards(ref, outs, layout[1], where)
    if layout[0] == "zigzag":
        chunks = ref.chunk(2 * len(outs), layout[1])
        shards = [torch.cat([chunks[r], chunks[2 * len(outs) - 1 - r]], layout[1]) for r in range(len(outs))]
    return shards


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
