"""Trace a rank's program once for many ranks: the rank reaches it as a RankExpr (see ir/rank_expr).

The rank enters a program as the `rank` argument of the case's functions and as a process group's
`.rank()` (`dist.get_rank()` asks the default group); inside the trace both give the symbol. Where
it reaches torch, a few calls keep it symbolic in the recorded op: slicing (and `narrow`) at a
symbolic offset (the loader's `w[rank * n : (rank + 1) * n]`), picking one of a tensor's equal
pieces (`grad.chunk(world_size)[rank]`, a slice too), and elementwise ops against it as a scalar
(a vocab-parallel embedding's `ids < vocab_start`). Their guards keep the result's shape the
same at every rank the trace is valid for (offsets in range, a constant length). A Python custom op
given the rank (spmd_types' `replicate_to_varying` cutting a sequence-parallel shard) runs its
Python kernel on it, the ops the tracer records for it anyway. Any other use takes the value at the
rank traced and guards it, so the trace holds only where it is the same.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.distributed.tensor._utils as dtensor_utils
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.autograd.function import BackwardCFunction
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten

from shardproof.capture import custom_ops
from shardproof.capture.dispatch_trace import Recorder
from shardproof.capture.locations import current_location
from shardproof.ir import rank_expr
from shardproof.ir.rank_expr import Guard, RankExpr, evaluate_form, recording

aten = torch.ops.aten
_PROCESS_GROUP = torch._C._distributed_c10d.ProcessGroup

_SCALAR_OPS = frozenset(
    getattr(owner, name)
    for owner in (torch.Tensor, torch)
    for name in ("add", "sub", "mul", "lt", "le", "gt", "ge", "eq", "ne", "rsub")
    if hasattr(owner, name)
) | frozenset(
    getattr(torch.Tensor, f"__{name}__")
    for name in ("add", "radd", "sub", "rsub", "mul", "rmul", "lt", "le", "gt", "ge", "eq", "ne")
)


@contextlib.contextmanager
def symbolic_rank(at: int, world_size: int) -> Iterator[tuple[RankExpr, set[Guard]]]:
    """The symbol for the rank (valued `at`, the rank the fake process group was made for) and
    the guards the code run inside records."""
    symbol = RankExpr.symbol(at)
    original = _PROCESS_GROUP.__dict__["rank"]

    def rank_in(group: Any) -> Any:
        ranks = dist.get_process_group_ranks(group)
        if ranks == list(range(world_size)):
            return symbol
        try:
            return ranks.index(symbol)  # compares with every member: guards pin the position
        except ValueError:
            return -1

    def at_rank_traced(make: Any) -> Any:
        """`make` (a mesh's set-up, or its groups') run at the rank traced: torch asks `rank in
        ranks` of every group it makes, and each question would be guarded."""

        def made_at(*args: Any, **kwargs: Any) -> Any:
            outer, _PROCESS_GROUP.rank = _PROCESS_GROUP.__dict__["rank"], original  # nested: a mesh makes its groups
            try:
                return make(*args, **kwargs)
            finally:
                _PROCESS_GROUP.rank = outer

        return made_at

    def init_at(mesh: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        at_rank_traced(mesh_init)(mesh, *args, **kwargs)
        _made_symbolic(mesh, symbol, world_size)

    global _world
    narrow, tensor_narrow = torch.narrow, torch.Tensor.narrow
    mesh_init, split = DeviceMesh.__init__, Shard._select_split_tensor
    mesh_groups = DeviceMesh.__dict__["_init_process_groups"]  # a staticmethod, made by unflattening too
    shard_offsets = dtensor_utils._compute_local_shape_and_global_offset
    backward, custom_op = BackwardCFunction.apply, CustomOpDef.__call__
    with recording() as guards, _RankArguments() as arguments:
        BackwardCFunction.apply = _under(arguments, backward)
        CustomOpDef.__call__ = _kernel_for_rank(arguments, custom_op, symbol, world_size)
        _PROCESS_GROUP.rank = rank_in
        rank_expr.tensor_operation, rank_expr.current_location = _tensor_operation, current_location
        torch.narrow = torch.Tensor.narrow = _narrowing(narrow)
        DeviceMesh.__init__ = init_at
        DeviceMesh._init_process_groups = staticmethod(at_rank_traced(mesh_groups.__func__))
        Shard._select_split_tensor = _placeholder_shard(split)
        dtensor_utils._compute_local_shape_and_global_offset = _affine_in_rank(shard_offsets, symbol, world_size)
        _world = (symbol, world_size)
        try:
            yield symbol, guards
        finally:
            _PROCESS_GROUP.rank = original
            rank_expr.tensor_operation = rank_expr.current_location = None
            torch.narrow, torch.Tensor.narrow = narrow, tensor_narrow
            DeviceMesh.__init__, Shard._select_split_tensor = mesh_init, split
            DeviceMesh._init_process_groups = mesh_groups
            dtensor_utils._compute_local_shape_and_global_offset = shard_offsets
            BackwardCFunction.apply, CustomOpDef.__call__ = backward, custom_op
            _world = None


_world: tuple[RankExpr, int] | None = None  # the symbol and world size of the symbolic trace under way


def group_used(ranks: tuple[int, ...]) -> None:
    """A collective over `ranks` was recorded: in a symbolic trace, a group other than the whole
    world (a mesh dim's group, made at the rank traced) holds at that rank alone (guarded)."""
    if _world is not None and ranks != tuple(range(_world[1])):
        _pin(_world[0])


def _pin(symbol: RankExpr) -> None:
    if symbol != symbol.value:  # records the guard `rank == value`
        raise AssertionError("a rank symbol differs from its value at the rank traced")


def _made_symbolic(mesh: DeviceMesh, symbol: RankExpr, world_size: int) -> None:
    """A mesh built at the rank traced (torch's group code asks `rank in ranks` of every group:
    each would be guarded) given the symbol. A mesh cut from the whole world in rank order (its
    rank map) whose dims of more than one rank are none or one of all of them holds the rank as
    that dim's coordinate, 0 on the others, at every rank alike: the world itself, or a mesh of
    one rank cut from it (torchtitan's data-parallel dims of size 1 under tensor parallelism). Its
    groups are made at the rank traced, a collective over one that is not the whole world is
    guarded where recorded (`group_used`), and its member ranks (`mesh.mesh`, asked of torch's
    `get_rank`) are guarded where read. Any other mesh holds at the rank traced alone."""
    sizes = tuple(mesh.shape)
    wide = [d for d, size in enumerate(sizes) if size > 1]
    coordinate = tuple(symbol.value if d in wide else 0 for d in range(len(sizes)))
    if (
        all(sizes[d] == world_size for d in wide)
        and len(wide) <= 1
        and mesh._rank_map.tolist() == list(range(world_size))
        and mesh._rank == symbol.value
        and tuple(mesh._coordinate_on_dim or ()) == coordinate
    ):
        mesh._rank = symbol
        mesh._coordinate_on_dim = tuple(symbol if d in wide else 0 for d in range(len(sizes)))
    else:
        _pin(symbol)


def _placeholder_shard(split: Any) -> Any:
    """A shard of a meta tensor made while the model is built (a placeholder the checkpoint is
    loaded into) at a symbolic index: shards of one shape are alike (no data) at every index, so no
    guard; else the index's. Not while recording: the light tracer runs the program itself on meta
    tensors (a redistribute's local chunk there is the rank's data)."""

    def select(self: Shard, tensor: torch.Tensor, num_chunks: int, index: Any, **kwargs: Any) -> torch.Tensor:
        if not isinstance(index, RankExpr) or tensor.device.type != "meta" or isinstance(_get_current_dispatch_mode(), Recorder):
            return split(self, tensor, num_chunks, index, **kwargs)
        each = [split(self, tensor, num_chunks, i, **kwargs) for i in range(num_chunks)]
        if len({(t.shape, t.stride(), t.storage_offset() if not kwargs.get("clone", True) else 0) for t in each}) == 1:
            return each[index.value]
        return split(self, tensor, num_chunks, _pinned(index), **kwargs)

    return select


def _affine_in_rank(compute: Any, symbol: RankExpr, world_size: int) -> Any:
    """DTensor's shard shape and offsets on a mesh given the symbol (`_made_symbolic`): worked out
    at every rank, kept symbolic where the shape is the same at all and each offset is affine in
    the rank (even shards), else taken at the rank traced (guarded)."""

    def shape_and_offsets(global_shape: Any, mesh_shape: Any, coordinate: Any, placements: Any, *rest: Any) -> Any:
        at = [coordinate(i) for i in range(len(mesh_shape))] if callable(coordinate) else coordinate
        if at is None or not _mentions(list(at)):
            return compute(global_shape, mesh_shape, coordinate, placements, *rest)
        wide = [d for d, c in enumerate(at) if isinstance(c, RankExpr)]
        if len(wide) != 1 or at[wide[0]] is not symbol:
            return compute(global_shape, mesh_shape, _pinned(list(at)), placements, *rest)
        each = [compute(global_shape, mesh_shape, [r if d in wide else c for d, c in enumerate(at)], placements, *rest)
                for r in range(world_size)]
        shape, offsets = each[0]
        steps = [each[1][1][d] - offsets[d] if world_size > 1 else 0 for d in range(len(offsets))]
        if not all(got == shape and all(o == offsets[d] + steps[d] * r for d, o in enumerate(off))
                   for r, (got, off) in enumerate(each)):
            return compute(global_shape, mesh_shape, _pinned(list(at)), placements, *rest)
        return shape, tuple(offset + symbol * step if step else offset for offset, step in zip(offsets, steps))

    return shape_and_offsets


def _narrowing(narrow: Any) -> Any:
    """`narrow` that slices at a symbolic start: torch would take the start as an int before any
    mode saw it."""

    def narrow_at(tensor: torch.Tensor, dim: int, start: Any, length: int) -> torch.Tensor:
        if not isinstance(start, RankExpr) or type(dim) is not int or isinstance(length, RankExpr):
            return narrow(tensor, dim, start, length)
        dim = dim + tensor.dim() if dim < 0 else dim
        return tensor[(slice(None),) * dim + (slice(start, start + length),)]

    return narrow_at


@dataclass(frozen=True)
class _Bound:
    """One symbolic int the recorded op must carry: argument `position` of an op `target`
    (None: the one op recorded), with `dim` its argument 1 where given (a slice's dim)."""

    value: int | RankExpr
    position: int
    target: Any = None
    dim: int | None = None


class _RankArguments(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _mentions((args, kwargs)):
            out = func(*args, **kwargs)
            return _Pieces.of(args[0], out) if func in _SPLITTING else out
        return _call(func, args, kwargs)


_SPLITTING = frozenset(getattr(owner, name) for owner in (torch.Tensor, torch) for name in ("chunk", "split"))


class _Pieces(tuple):
    """A tensor's pieces of one size along one dim, from `chunk` or `split` (each the next slice
    along it): the piece at a symbolic index is a slice at a symbolic offset, not the piece at the
    rank traced (a tuple's index would be taken as an int: guarded)."""

    whole: torch.Tensor
    dim: int

    @staticmethod
    def of(whole: Any, pieces: Any) -> Any:
        """`pieces` as _Pieces where they are equal consecutive slices of `whole` along one dim."""
        if type(pieces) is not tuple or not pieces or not isinstance(whole, torch.Tensor):
            return pieces
        first = pieces[0]
        dims = [d for d in range(whole.dim()) if first.dim() == whole.dim() and first.shape[d] != whole.shape[d]]
        if len(dims) != 1:
            return pieces
        dim, size = dims[0], first.shape[dims[0]]
        step = size * whole.stride(dim)
        if not all(p.shape == first.shape and p.storage_offset() == whole.storage_offset() + i * step
                   for i, p in enumerate(pieces)):
            return pieces
        found = _Pieces(pieces)
        found.whole, found.dim = whole, dim
        return found

    def __getitem__(self, index: Any) -> Any:
        if not isinstance(index, RankExpr):
            return super().__getitem__(index)
        size = super().__getitem__(0).shape[self.dim]
        start = index * size
        piece = self.whole[(slice(None),) * self.dim + (slice(start, start + size),)]
        _located_as(piece, super().__getitem__(index.value))
        return piece


def _located_as(made: torch.Tensor, piece: torch.Tensor) -> None:
    """The slice standing for a piece recorded at the piece's line (the `chunk`), as the trace of
    the rank itself records the piece it picks."""
    recorder = _get_current_dispatch_mode()
    if not isinstance(recorder, Recorder):
        return
    found, origin = recorder.nodes.get(id(made)), recorder.nodes.get(id(piece))
    if found is None or origin is None or found[0] is not made or origin[0] is not piece:
        return
    source = origin[1].args[0] if origin[1].target is operator.getitem else origin[1]  # a piece of a split's list
    found[1].meta["stack_trace"] = source.meta.get("stack_trace", "")


def _under(mode: TorchFunctionMode, apply: Any) -> Any:
    """`apply` run under `mode` (a custom autograd Function's backward): torch leaves a mode while
    it runs the function it was called for, here `torch.autograd.grad`, whose engine runs the
    backward (Megatron's gather keeps `grad.chunk(world_size)[rank]`)."""

    def apply_under(*args: Any) -> Any:
        if mode in _get_current_function_mode_stack():
            return apply(*args)
        with mode:
            return apply(*args)

    return apply_under


def _kernel_for_rank(mode: TorchFunctionMode, call: Any, symbol: RankExpr, world_size: int) -> Any:
    """A functional Python custom op called with the rank, whose schema would take it as an int.
    While the light tracer records: its Python kernel run on the symbol (under `mode`, which keeps
    its slices symbolic), the ops the tracer records in the op's place in any case
    (capture/custom_ops); a backward registered for the op is kept where it would run. Outside
    (the model being built, its parameters cut as placeholders for the checkpoint): the op at the
    rank traced where it makes alike tensors at every rank (see `_alike`)."""

    def called(opdef: CustomOpDef, *args: Any, **kwargs: Any) -> Any:
        kernel = custom_ops.kernel_of(opdef)
        if kernel is None or not _mentions((args, kwargs)) or opdef._opoverload._schema.is_mutable:
            return call(opdef, *args, **kwargs)
        if not isinstance(_get_current_dispatch_mode(), Recorder):
            each = [call(opdef, *_at(args, r), **_at(kwargs, r)) for r in range(world_size)]
            at = each[symbol.value]
            return at if all(_alike(other, at) for other in each) else call(opdef, *_pinned(args), **_pinned(kwargs))
        if opdef._backward_fn is not None and _differentiated((args, kwargs)):
            return call(opdef, *args, **kwargs)
        return _under(mode, lambda: kernel(*args, **kwargs))()

    return called


def _alike(a: Any, b: Any) -> bool:
    """Two results that no program can tell apart: tensors without data (meta, or fake without a
    value fake mode kept: a graph refuses such a constant) of the same metadata, nothing that
    autograd would differentiate, or values equal."""
    flat_a, spec_a = tree_flatten(a)
    flat_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(flat_a, flat_b):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) or x != y:
                return False
        elif not (_dataless(x) and _dataless(y) and not x.requires_grad and not y.requires_grad
                  and (type(x), x.shape, x.stride(), x.storage_offset(), x.dtype, x.device)
                  == (type(y), y.shape, y.stride(), y.storage_offset(), y.dtype, y.device)):
            return False
    return True


def _dataless(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or isinstance(tensor, FakeTensor) and tensor.constant is None


def _differentiated(value: Any) -> bool:
    """Whether autograd would record an op of these arguments."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(value)[0]
    )


def _tensor_operation(method: str, other: Any, expr: RankExpr) -> Any:
    """`tensor < rank` and the like: torch's binary operators refuse a RankExpr before any mode
    sees it, so python asks the RankExpr, which asks here."""
    if not isinstance(other, torch.Tensor):
        return NotImplemented
    return _call(getattr(torch.Tensor, method), (other, expr), {})


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` on the values at the rank traced; the recorded op keeps the symbolic ones where it can."""
    recorder = _get_current_dispatch_mode()
    bounds = _symbolic_bounds(func, args, kwargs) if isinstance(recorder, Recorder) else None
    if bounds is None:
        return func(*_pinned(args), **_pinned(kwargs))
    before = len(recorder.created)
    out = func(*_plain(args), **_plain(kwargs))
    if not _substituted(recorder.created[before:], bounds):
        _pinned((args, kwargs))
    else:
        _pinned_where_differentiated(out)
    return out


def _pinned_where_differentiated(out: Any) -> None:
    """A symbolic op's backward formula (autograd's, in C++) takes the op's offsets as the ints of
    the rank traced: where it runs, the trace holds at that rank alone (guarded when it runs; a
    loader's slices of parameters it then detaches keep their symbols). A write in place into the
    op's output, which autograd would differentiate by that view's offsets too, is pinned where
    it is lowered (ir/from_fx writes it back)."""
    for tensor in tree_flatten(out)[0]:
        if isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None:
            tensor.grad_fn.register_prehook(_pin_while_traced)


def _pin_while_traced(*_: Any) -> None:
    if _world is not None:
        _pin(_world[0])


def _symbolic_bounds(func: Any, args: tuple, kwargs: dict) -> list[_Bound] | None:
    """The symbolic ints the call's recorded op carries, with their guards; None for calls kept plain."""
    try:
        if func is torch.Tensor.__getitem__ and not kwargs:
            return _sliced(*args)
    except _OutOfRange:
        return None
    if func in _SCALAR_OPS and len(args) == 2 and not kwargs and isinstance(args[1], RankExpr):
        return [_Bound(args[1], 1)]
    return None


def _sliced(tensor: torch.Tensor, index: Any) -> list[_Bound] | None:
    items = index if isinstance(index, tuple) else (index,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in items) or sum(i is Ellipsis for i in items) > 1:
        return None
    if any(_mentions(i.step) or i.step not in (None, 1) for i in items if isinstance(i, slice)):
        return None
    explicit = [i for i in items if i is not Ellipsis]
    if len(explicit) > tensor.dim():
        return None
    dims: list[int] = []
    for i, item in enumerate(items):
        if item is Ellipsis:
            dims.extend(range(len(dims), tensor.dim() - (len(items) - i - 1)))
        else:
            dims.append(len(dims))
    bounds = []
    for dim, item in zip(dims, items):
        if isinstance(item, slice) and _mentions((item.start, item.stop)):
            start = 0 if item.start is None else item.start
            stop = tensor.shape[dim] if item.stop is None else item.stop
            bounds += _in_range(tensor, dim, start, stop)
    return bounds


def _in_range(tensor: torch.Tensor, dim: int, start: Any, stop: Any) -> list[_Bound]:
    """Guards that [start, stop) lies in the dim at every rank, so the slice's shape is the same;
    the bounds the slice op then carries."""
    size = tensor.shape[dim]
    if not (0 <= start and start <= stop and stop <= size) or stop - start != _value(stop) - _value(start):
        raise _OutOfRange
    target = aten.slice.Tensor
    return [_Bound(v, p, target, dim) for v, p in ((start, 2), (stop, 3)) if isinstance(v, RankExpr)]


class _OutOfRange(Exception):
    """A slice python clamps at the rank traced: kept plain, its values guarded."""


def _substituted(nodes: list[fx.Node], bounds: list[_Bound]) -> bool:
    """Write each bound into the one recorded op argument that holds its value; False if that
    op is not found exactly once (the call then stays plain, its values guarded)."""
    ops = [n for n in nodes if isinstance(n.target, torch._ops.OpOverload)]
    plan: list[tuple[fx.Node, int, RankExpr]] = []
    for bound in bounds:
        if bound.target is None:
            places = [(n, p) for n in ops[:1] if len(ops) == 1 for p in range(1, len(n.args)) if _holds(n.args[p], bound)]
        else:
            places = [
                (n, bound.position) for n in ops
                if n.target is bound.target and n.args[1] == bound.dim and _holds(n.args[bound.position], bound)
            ]  # fmt: skip
        if len(places) != 1:
            return False
        plan.append((*places[0], bound.value))
    for node, position, value in plan:
        args = list(node.args)
        args[position] = value
        node.args = tuple(args)
    return True


def _holds(arg: Any, bound: _Bound) -> bool:
    return type(arg) is int and arg == _value(bound.value)


def _value(value: int | RankExpr) -> int:
    return value.value if isinstance(value, RankExpr) else value


def _mentions(value: Any) -> bool:
    if isinstance(value, RankExpr):
        return True
    if isinstance(value, slice):
        return _mentions((value.start, value.stop, value.step))
    if isinstance(value, (tuple, list)):
        return any(_mentions(v) for v in value)
    if isinstance(value, dict):
        return any(_mentions(v) for v in value.values())
    return False


def _mapped(value: Any, leaf: Any) -> Any:
    if isinstance(value, RankExpr):
        return leaf(value)
    if isinstance(value, slice):
        return slice(*(_mapped(v, leaf) for v in (value.start, value.stop, value.step)))
    if isinstance(value, (tuple, list)):
        return type(value)(_mapped(v, leaf) for v in value)
    if isinstance(value, dict):
        return {k: _mapped(v, leaf) for k, v in value.items()}
    return value


def _at(value: Any, rank: int) -> Any:
    """`value` at `rank`, unguarded: for a call the caller makes at every rank."""
    return _mapped(value, lambda expr: evaluate_form(expr.form, rank))


def _pinned(value: Any) -> Any:
    """`value` with each RankExpr replaced by its value, guarded (the trace holds only there)."""
    return _mapped(value, int)


def _plain(value: Any) -> Any:
    return _mapped(value, _value)
