"""Check an IR node against its operands: the shape its op computes from theirs, by the op's own
implementation run on meta tensors (torch's meta kernels; no second shape table), but for
elementwise ops and `cat`, whose shapes are a broadcast and a sum (see _ELEMENTWISE for why).

Importers write nodes with the shapes a dump declares; a node whose op refuses its operands, or
computes another shape than the one declared, means the dump contradicts itself, and it must be
refused before any proof (a proof over a contradiction could prove anything).
"""

from __future__ import annotations

import math

import torch

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS


# operands per op kind (see ir/ops.py); layout ops take one but `cat`, open ops as their template says
_ARITY = {
    "unary": 1, "binary": 2, "compare": 2, "where": 3, "reduce": 1, "softmax": 1, "matmul": 2, "embedding": 2,
    "gather": 2, "scatter": 3, "mask": 1, "collective": 1,
}  # fmt: skip


# elementwise kinds, ours and open aten ops torch tags pointwise: their shape is their operands'
# broadcast; `cat`'s is theirs joined along its dim. Computed so rather than by their meta kernels,
# which are Python references whose first call imports torch._dynamo (seconds of import time for
# programs that need no other meta kernel)
_ELEMENTWISE = ("unary", "binary", "compare", "where", "pointwise")


class Inconsistent(Exception):
    """A node its operands do not fit; the message says what was expected."""


def check_node(graph: Graph, node: Node) -> None:
    kind = OPS[node.op].kind
    if kind in ("leaf", "call"):
        return
    if kind == "const":
        _check_constant(node)
        return
    operands = [graph[i] for i in node.inputs]
    arity = 1 if kind == "layout" and node.op != "cat" else _ARITY.get(kind)
    if arity is not None and len(operands) != arity:
        raise Inconsistent(f"{arity} operand{'s' if arity > 1 else ''} for `{_name(node)}`, not {len(operands)}")
    if kind == "collective":
        computed = _collective_shape(node, operands[0].shape)
    elif kind in _ELEMENTWISE:
        computed = _broadcast_shape(node, operands)
    elif node.op == "cat":
        computed = _cat_shape(node, operands)
    else:
        computed = _meta_shape(node, operands)
    if computed != node.shape:
        raise Inconsistent(f"shape {list(computed)}, as `{_name(node)}` computes from {_shapes(operands)}, not {list(node.shape)}")


def _meta_shape(node: Node, operands: list[Node]) -> tuple[int, ...]:
    tensors = [torch.empty(o.shape, dtype=_dtype(o.dtype), device="meta") for o in operands]
    try:
        out = OPS[node.op].impl(tensors, node.attrs)
    except Exception as err:  # noqa: BLE001 - torch's own check names what does not fit
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise Inconsistent(f"operands that `{_name(node)}` accepts, but {_shapes(operands)} do not fit ({reason})") from None
    return tuple(out.shape)


def _broadcast_shape(node: Node, operands: list[Node]) -> tuple[int, ...]:
    try:
        return tuple(torch.broadcast_shapes(*(o.shape for o in operands)))
    except RuntimeError as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise Inconsistent(f"operands that `{_name(node)}` accepts, but {_shapes(operands)} do not broadcast ({reason})") from None


def _cat_shape(node: Node, operands: list[Node]) -> tuple[int, ...]:
    dim, first = node.attrs[0], operands[0].shape
    if not 0 <= dim < len(first) or any(len(o.shape) != len(first) or _without(o.shape, dim) != _without(first, dim) for o in operands):
        raise Inconsistent(f"operands that `{_name(node)}` accepts, but {_shapes(operands)} differ in other dims than {dim}")
    return (*first[:dim], sum(o.shape[dim] for o in operands), *first[dim + 1 :])


def _without(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    return shape[:dim] + shape[dim + 1 :]


def _collective_shape(node: Node, shape: tuple[int, ...]) -> tuple[int, ...]:
    """all_reduce keeps the shape; all_gather multiplies its dim by the group size, reduce_scatter divides it;
    all_to_all receives its output splits."""
    if node.op == "all_reduce":
        return shape
    if node.op == "all_to_all":
        output_splits, input_splits, group = node.attrs
        if not shape or len(output_splits) != len(group) or len(input_splits) != len(group) or sum(input_splits) != shape[0]:
            raise Inconsistent(f"an operand of {sum(input_splits)} rows, one split per rank of the group, for `{node.op}`, "
                               f"not {list(shape)} split {list(input_splits)}")
        return (sum(output_splits), *shape[1:])
    dim, size = node.attrs[0], len(node.attrs[-1])
    if not -len(shape) <= dim < len(shape):
        raise Inconsistent(f"a dim of the operand {list(shape)} for `{node.op}`, not {dim}")
    dims = list(shape)
    if node.op == "all_gather":
        dims[dim] *= size
    elif dims[dim] % size:
        raise Inconsistent(f"dim {dim} of {list(shape)} divisible by the {size} ranks of the `{node.op}` group")
    else:
        dims[dim] //= size
    return tuple(dims)


def _check_constant(node: Node) -> None:
    form = node.attrs[0]
    count = {"values": lambda: len(_flat(form[1])), "arange": lambda: len(range(*form[1:]))}.get(form[0])
    if count is not None and count() != math.prod(node.shape):
        raise Inconsistent(f"{math.prod(node.shape)} values for a constant of shape {list(node.shape)}, not {count()}")


def _flat(values: object) -> list:
    return [x for v in values for x in _flat(v)] if isinstance(values, (tuple, list)) else [values]


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    return found if isinstance(found, torch.dtype) else torch.float32


def _name(node: Node) -> str:
    return node.op.split(".")[1] if "." in node.op else node.op


def _shapes(nodes: list[Node]) -> str:
    return ", ".join(str(list(n.shape)) for n in nodes) or "no operands"
