"""Check an IR node against its operands: the shape its op computes from theirs, by the op's own
implementation run on meta tensors (torch's meta kernels; no second shape table).

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
    computed = _collective_shape(node, operands[0].shape) if kind == "collective" else _meta_shape(node, operands)
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


def _collective_shape(node: Node, shape: tuple[int, ...]) -> tuple[int, ...]:
    """all_reduce keeps the shape; all_gather multiplies its dim by the group size, reduce_scatter divides it."""
    if node.op == "all_reduce":
        return shape
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
