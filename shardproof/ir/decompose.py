"""Torch's own decompositions of the ops the lowering has no hand rule for.

`torch._decomp` breaks composite ops into smaller ones (SDPA into its math path, `_safe_softmax`
into softmax and a mask, norms into their arithmetic, `masked_fill` into `where`). The lowering
asks here before keeping an op as an open op: the decomposition is traced once per op and
argument signature on meta tensors, and its pieces are lowered like any other op (so a piece may
be decomposed again, or be open). Pointwise ops are not decomposed: their tag already gives them
the elementwise laws, and torch's references for them reach down to `prims`.

`OWN` holds decompositions torch lacks, for ops whose meaning is plain torch code: capture traces
them in their place too (`aten._grouped_mm`'s meta kernel refuses float32 on the CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._decomp import core_aten_decompositions, decomposition_table
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.proxy_tensor import make_fx

Decomposition = Callable[..., Any]


aten = torch.ops.aten


def _grouped_mm(
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Any:
    """`_grouped_mm` as one dense product per group, each masked to its group's range: `offs` are
    the cumulative ends of the groups along the dim the 2-D operand is grouped by (its rows against
    stacked matrices `mat_b`, the columns of `mat_b` against stacked `mat_a`, the contracted dim of
    two 2-D operands, one output matrix per group). Rows past the last end come out zero. So an
    expert's product is a plain matmul, and a rank's slice of an expert's weight a slice of it."""
    if bias is not None:
        return NotImplemented
    if offs is None:  # stacked against stacked: a batched product
        out = torch.bmm(mat_a, mat_b)
    elif mat_a.dim() == 2 and mat_b.dim() == 3:  # rows of a grouped, group e against mat_b[e]
        member = _in_group(offs, mat_a.shape[0]).unsqueeze(-1)  # [E, M, 1]
        out = torch.where(member, torch.bmm(_stacked(mat_a, len(offs)), mat_b), 0).sum(0)
    elif mat_a.dim() == 3 and mat_b.dim() == 2:  # columns of b grouped, group e against mat_a[e]
        member = _in_group(offs, mat_b.shape[1]).unsqueeze(1)  # [E, 1, N]
        out = torch.where(member, torch.bmm(mat_a, _stacked(mat_b, len(offs))), 0).sum(0)
    else:  # both 2-D, the contracted dim grouped: group e's product of its columns of a, rows of b
        member = _in_group(offs, mat_a.shape[1]).unsqueeze(1)  # [E, 1, K]
        out = torch.bmm(torch.where(member, mat_a, 0), _stacked(mat_b, len(offs)))
    return out.to(out_dtype or mat_a.dtype)


def _stacked(matrix: torch.Tensor, groups: int) -> torch.Tensor:
    """The matrix once per group, as an explicit broadcast (a bmm operand, traced alike by every
    tracer; `matmul` folds or expands its broadcast by tracer)."""
    return matrix.expand(groups, *matrix.shape)


def _in_group(offs: torch.Tensor, size: int) -> torch.Tensor:
    """[E, size] bool: index i lies in group e, offs[e-1] <= i < offs[e] (group 0 starts at 0)."""
    index = torch.arange(size, device=offs.device)
    ends = offs.unsqueeze(-1)
    starts = torch.cat([torch.zeros_like(offs[:1]), offs[:-1]]).unsqueeze(-1)
    return (index >= starts) & (index < ends)


OWN: dict[Any, Decomposition] = {aten._grouped_mm.default: _grouped_mm}


@functools.lru_cache(maxsize=1)
def _tables() -> tuple[dict[Any, Decomposition], dict[Any, Decomposition]]:
    return core_aten_decompositions(), decomposition_table


def decomposition_of(target: Any) -> Decomposition | None:
    """Our own decomposition of `target`, else torch's: the core ATen set's first (made to reach
    core ops), then any registered one; none for pointwise ops (see the module docstring)."""
    if target in OWN:
        return OWN[target]
    core, every = _tables()
    if target in core:
        return core[target]
    if torch.Tag.pointwise in getattr(target, "tags", ()):
        return None
    return every.get(target)


def decomposed_graph(
    target: Any, decomposition: Decomposition, node: fx.Node, kwargs: dict[str, Any]
) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    """The traced decomposition of `node`'s call and the graph nodes its placeholders stand for,
    in order; None where it cannot be traced on meta tensors (it needs data, say)."""
    operands: list[fx.Node] = []

    def placeholder(value: Any) -> Any:
        if isinstance(value, fx.Node) and isinstance(value.meta.get("val"), torch.Tensor):
            if value not in operands:
                operands.append(value)
            return _Slot(operands.index(value))
        if isinstance(value, fx.Node):
            raise _Untraceable  # a non-tensor value (a symbolic size, a process group) of the graph
        if isinstance(value, (list, tuple)):
            return type(value)(placeholder(v) for v in value)
        return value

    try:
        args = placeholder(node.args)
        named = {k: placeholder(v) for k, v in kwargs.items()}
    except _Untraceable:
        return None
    signature = (target, _frozen(args), _frozen(named), tuple(_metadata(o.meta["val"]) for o in operands))
    traced = _traced(signature, decomposition, args, named)
    return None if traced is None else (traced, operands)


class _Untraceable(Exception):
    pass


@dataclass(frozen=True)
class _Slot:
    """The position of a tensor operand in the traced decomposition's inputs."""

    index: int


_TRACED: dict[tuple, fx.GraphModule | None] = {}  # signature -> traced decomposition (None: keep the op whole)


def _traced(signature: tuple, decomposition: Decomposition, args: Any, named: dict[str, Any]) -> fx.GraphModule | None:
    if signature in _TRACED:
        return _TRACED[signature]
    metadata = signature[-1]

    def call(*tensors: torch.Tensor) -> Any:
        return decomposition(*_filled(args, tensors), **{k: _filled(v, tensors) for k, v in named.items()})

    with unset_fake_temporarily():
        inputs = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in metadata]
        traced = _trace(call, inputs)
    _TRACED[signature] = traced
    return traced


def _trace(call: Callable[..., Any], inputs: list[torch.Tensor]) -> fx.GraphModule | None:
    """The decomposition's graph, functionalized where it writes in place; None if it cannot run
    on meta tensors."""
    try:
        graph = make_fx(call, tracing_mode="real")(*inputs)
        if any(_writes(n) for n in graph.graph.nodes):
            graph = make_fx(torch.func.functionalize(call, remove="mutations"), tracing_mode="real")(*inputs)
    except Exception:  # noqa: BLE001 - a decomposition that needs data (or fails on meta): keep the op whole
        return None
    return graph


def _writes(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


def _filled(value: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        return type(value)(_filled(v, tensors) for v in value)
    return value


def _frozen(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def _metadata(tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.dtype]:
    return tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype
