"""Trace the reference and every rank with make_fx on fake tensors under a fake process group.

Both sides are traced as functions of the SAME leaves: the reference state dict and the reference
inputs. A rank's function builds its own state with the case's `shard_state` (or the default
loader) inside the trace, so the checkpoint slicing is part of the rank's graph and the prover
relates every rank tensor to reference tensors without being told how they are laid out.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._decomp import get_decompositions
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardproof.capture.locations import anchor_user_code, autograd_origins, locator
from shardproof.capture.meshes import RealDeviceMeshes, distinct_meshes
from shardproof.case import Case
from shardproof.errors import CaptureError, CaseError, ShardproofError
from shardproof.ir.from_fx import Lowerer
from shardproof.ir.graph import BOUND_LEAF_PREFIX, Graph
from shardproof.state import module_state
from shardproof.steps import Check, program_for, trainable_names

aten = torch.ops.aten


@dataclass
class Captured:
    reference: Graph
    ranks: list[Graph]
    checks: list[Check]
    seconds: float


def capture(
    case: Case, world_size: int, progress: Callable[[str], None] = lambda _: None, mode: str = "forward"
) -> Captured:
    """Trace the reference once and each rank once; every failure becomes a CaptureError.

    A rank's trace also takes the reference outputs its program is bound to (training mode: the
    reference gradients) as leaves named `reference-output:<index>`."""
    start = time.perf_counter()
    if case.source is not None:
        anchor_user_code(case.source_functions, case.source.parent)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with _process_group(0, world_size):
            ref_model = _build("reference()", case.reference)
            ref_state = module_state(ref_model)
            ref_inputs = tuple(_build("inputs()", case.inputs))
        program = program_for(case, ref_model, mode)
        names = list(ref_state)
        leaf_names = [f"state:{n}" for n in names] + [f"input:{i}" for i in range(len(ref_inputs))]
        leaves = [*ref_state.values(), *ref_inputs]

        def unpack(args: tuple) -> tuple[dict[str, torch.Tensor], tuple]:
            return dict(zip(names, args[: len(names)])), tuple(args[len(names) : len(leaves)])

        def run_reference(*args: torch.Tensor) -> list[torch.Tensor]:
            return program.reference(ref_model, *unpack(args))

        progress("tracing reference")
        reference_gm = _trace_fx("the reference model", run_reference, leaves, [])
        bound = [_placeholder(reference_gm, i) for i in program.bound]
        reference = _lower(reference_gm, leaf_names, [], None)
        bound_names = [f"{BOUND_LEAF_PREFIX}{i}" for i in program.bound]
        ranks, checks = [], None
        for rank in range(world_size):
            progress(f"tracing rank {rank}/{world_size}")
            with _process_group(rank, world_size):
                model = _build(f"distributed({rank}, {world_size})", lambda: case.distributed(rank, world_size))

                def run_rank(*args: torch.Tensor, model=model, rank=rank) -> list[torch.Tensor]:
                    return program.rank(model, *unpack(args), rank, world_size, list(args[len(leaves) :]))

                with _recorded_reduce_ops() as reduce_ops:
                    gm = _trace_fx(f"rank {rank}", run_rank, leaves + bound, reduce_ops)
                ranks.append(_lower(gm, leaf_names + bound_names, reduce_ops, rank))
                rank_checks = program.checks(len(reference.outputs), len(ranks[-1].outputs), trainable_names(model), rank)
                if checks is not None and [c.label for c in checks] != [c.label for c in rank_checks]:
                    raise CaseError(f"rank {rank} has other parameters than rank 0; every rank must hold the same names")
                checks = rank_checks
    return Captured(reference, ranks, checks or [], time.perf_counter() - start)


# Composite backward and optimizer ops, broken into the primitive ops the rules know.
_DECOMPOSED = get_decompositions([
    aten.silu_backward, aten.gelu_backward, aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward,
    aten.native_layer_norm_backward, aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.native_dropout_backward, aten.embedding_dense_backward, aten.lerp, aten.lerp_, aten.addcmul,
    aten.addcmul_, aten.addcdiv, aten.addcdiv_, aten.mse_loss, aten.mse_loss_backward, aten.nll_loss_forward,
    aten.nll_loss_backward,
])


def _trace_fx(what: str, fn: Callable, leaves: list, reduce_ops: list[str]) -> fx.GraphModule:
    try:
        with autograd_origins():
            return make_fx(fn, decomposition_table=_DECOMPOSED, tracing_mode="real", record_stack_traces=True)(*leaves)
    except ShardproofError:
        raise
    except Exception as err:  # noqa: BLE001 - any tracing failure is reported with the user's frame
        raise CaptureError(f"tracing {what} failed: {type(err).__name__}: {_first_line(err)}{_user_frame(err)}") from err


def _lower(gm: fx.GraphModule, leaf_names: list[str], reduce_ops: list[str], rank: int | None) -> Graph:
    return Lowerer(gm, leaf_names, locator(gm), reduce_ops, _group_ranks, rank).run()


def _placeholder(gm: fx.GraphModule, output_index: int) -> torch.Tensor:
    """A fake tensor shaped like one of a traced graph's outputs."""
    value = gm.graph.output_node().args[0][output_index].meta["val"]
    return torch.empty(value.shape, dtype=value.dtype)


def _build(what: str, fn: Callable[[], Any]) -> Any:
    try:
        with RealDeviceMeshes():
            return fn()
    except ShardproofError:
        raise
    except Exception as err:  # noqa: BLE001
        raise CaptureError(f"{what} failed: {type(err).__name__}: {_first_line(err)}{_user_frame(err)}") from err


@contextlib.contextmanager
def _process_group(rank: int, world_size: int) -> Iterator[None]:
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with distinct_meshes():
            yield
    finally:
        dist.destroy_process_group()


# c10d functions taking a ReduceOp (torch 2.13 spells reduce_scatter_tensor reduce_scatter_single).
_REDUCING_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter")


@contextlib.contextmanager
def _recorded_reduce_ops() -> Iterator[list[str]]:
    """In-place c10d collectives hide their ReduceOp in an opaque object: note it at call time."""
    recorded: list[str] = []
    originals = {name: getattr(dist, name) for name in _REDUCING_COLLECTIVES}

    def wrap(name: str) -> Callable:
        original = originals[name]
        signature = inspect.signature(original)

        def call(*args: Any, **kwargs: Any) -> Any:
            op = signature.bind(*args, **kwargs).arguments.get("op", dist.ReduceOp.SUM)
            recorded.append(_reduce_name(op))
            return original(*args, **kwargs)

        return call

    for name in originals:
        setattr(dist, name, wrap(name))
    try:
        yield recorded
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _reduce_name(op: Any) -> str:
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min"}
    for key, name in names.items():
        if op == key:
            return name
    return "unsupported"


def _group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of a process group given as a torchbind object or a group name."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    if isinstance(group, str):
        pg = _resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):
        pg = dist.ProcessGroup.unbox(group)
    else:
        pg = group
    return tuple(dist.get_process_group_ranks(pg))


def _first_line(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""


def _user_frame(err: Exception) -> str:
    """The last frame of the traceback outside torch: where the user's code was when it failed."""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(err.__traceback__) if not f.filename.startswith(torch_dir)]
    frames = [f for f in frames if "/shardproof/" not in f.filename]
    if not frames:
        return ""
    last = frames[-1]
    return f"\n  at {last.filename}:{last.lineno}  {(last.line or '').strip()}"
