"""Trace a rank's program once for many ranks: the rank reaches it as a RankExpr (see ir/rank_expr).

The rank enters a program as the `rank` argument of the case's functions and as a process group's
`.rank()` (`dist.get_rank()` asks the default group); inside the trace both give the symbol. Where
it reaches torch, a few calls keep it symbolic in the recorded op: slicing (and `narrow`) at a
symbolic offset (the loader's `w[rank * n : (rank + 1) * n]`), and elementwise ops against it as a
scalar (a vocab-parallel embedding's `ids < vocab_start`). Their guards keep the result's shape the
same at every rank the trace is valid for (offsets in range, a constant length). Any other use
takes the value at the rank traced and guards it, so the trace holds only where it is the same.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _get_current_dispatch_mode

from shardproof.capture.dispatch_trace import Recorder
from shardproof.ir import rank_expr
from shardproof.ir.rank_expr import Guard, RankExpr, recording

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

    narrow, tensor_narrow = torch.narrow, torch.Tensor.narrow
    with recording() as guards, _RankArguments():
        _PROCESS_GROUP.rank = rank_in
        rank_expr.tensor_operation = _tensor_operation
        torch.narrow = torch.Tensor.narrow = _narrowing(narrow)
        try:
            yield symbol, guards
        finally:
            _PROCESS_GROUP.rank = original
            rank_expr.tensor_operation = None
            torch.narrow, torch.Tensor.narrow = narrow, tensor_narrow


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
            return func(*args, **kwargs)
        return _call(func, args, kwargs)


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
    return out


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


def _pinned(value: Any) -> Any:
    """`value` with each RankExpr replaced by its value, guarded (the trace holds only there)."""
    return _mapped(value, int)


def _plain(value: Any) -> Any:
    return _mapped(value, _value)
