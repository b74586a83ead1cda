"""What DTensor's sharding propagation knows about an op, asked of its own tables.

PyTorch keeps, for DTensor, a sharding strategy per op: which placements of the inputs give which
placement of the output without moving data. A strategy that keeps a `Partial(sum)` operand
partial (the others replicated) says the op is linear in that operand: op(a + b, rest) =
op(a, rest) + op(b, rest). Row gathers (`index`, `index_select`), writes of rows into zeros
(`index_put`, `index_add`) and many more are linear so, and no rule of ours names them. A strategy
that maps operands sharded on a dim (the others replicated) to an output sharded on that dim
says each block of the output is the op on the operands' blocks: op(X)[rows] = op(X[rows]) (a
router's `topk` over each token's experts, on a rank's tokens).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, RuntimeSchemaInfo

from shardproof.ir.aten_ops import Attrs, fill, overload

Inputs = tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype) of each tensor operand


@functools.lru_cache(maxsize=4096)
def blockwise_along(op: str, attrs: Attrs, inputs: Inputs, sharded: frozenset[int], dim: int) -> bool:
    """Whether DTensor computes op's output (at the attrs' output path) sharded on `dim`, with no
    redistribution, from the operands `sharded` sharded on `dim` and the rest replicated: then
    each block of the output along `dim` is the op on the operands' blocks."""
    out = _propagated(op, attrs, inputs, lambda i: Shard(dim) if i in sharded else Replicate())
    return out is not None and out.placements == (Shard(dim),)


@functools.lru_cache(maxsize=4096)
def linear_in(op: str, attrs: Attrs, inputs: Inputs, partial: frozenset[int]) -> bool:
    """Whether DTensor computes op's output (at the attrs' output path) as `Partial(sum)`, with no
    redistribution, from the operands `partial` as `Partial(sum)` and the rest replicated: then
    op is linear in those operands jointly."""
    out = _propagated(op, attrs, inputs, lambda i: Partial() if i in partial else Replicate())
    return out is not None and out.placements == (Partial(),)


def _propagated(op: str, attrs: Attrs, inputs: Inputs, placement: Any) -> DTensorSpec | None:
    """The output spec (at the attrs' output path) DTensor propagates from operand i placed as
    `placement(i)`; None where it has no strategy or must move data first."""
    mesh = _mesh()
    specs = [_spec(mesh, shape, dtype, placement(i)) for i, (shape, dtype) in enumerate(inputs)]
    args, kwargs, path = attrs
    target = overload(op)
    try:
        schema = OpSchema(target, tuple(fill(args, specs)), {k: fill(v, specs) for k, v in kwargs}, schema_info=_schema_info(target, args))
        sharding = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding(schema)
    except Exception:  # noqa: BLE001 - no strategy for the op (or these arguments): nothing known
        return None
    out = sharding.output_spec
    for index in path:
        out = out[index] if isinstance(out, (tuple, list)) else None
    return out if not sharding.needs_redistribute and isinstance(out, DTensorSpec) else None


@functools.lru_cache(maxsize=1)
def _mesh() -> DeviceMesh:
    """A one-dimensional mesh of two ranks, seen from rank 0, that needs no process group."""
    return DeviceMesh("cpu", torch.arange(2), _init_backend=False, _rank=0)


def _spec(mesh: DeviceMesh, shape: tuple[int, ...], dtype: str, placement: Any) -> DTensorSpec:
    strides = torch.empty(shape, device="meta").stride()
    return DTensorSpec(mesh, (placement,), TensorMeta(torch.Size(shape), strides, getattr(torch, dtype)))


def _schema_info(target: Any, args: Any) -> RuntimeSchemaInfo | None:
    """The schema info DTensor registered with the op's strategy; lists of tensors are flattened."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    found = propagator.op_to_schema_info.get(target) or propagator.op_to_schema_info_for_single_dim_strategy.get(target)
    if found is None and any(isinstance(a, tuple) for a in args):
        return RuntimeSchemaInfo(needs_pytree=True)
    return found
