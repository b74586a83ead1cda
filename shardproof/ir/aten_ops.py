"""Open ops: any torch operator overload enters the IR under its own name.

The IR's own ops (`ir/ops.py`) are the few whose distribution laws are written by hand. Every other
op a program reaches keeps its torch identity: the node's op is the overload's name
(`aten.cumsum.default`), its attrs are its non-tensor arguments with each tensor replaced by an
`Operand` marker, and torch itself is its numeric implementation. What the relations may assume
about it comes from torch's own tags, never from a list of names:
- `pointwise`: elementwise laws (it commutes with slices, concatenations, broadcasts, reshapes);
- `reduction` with a `dim` argument: it commutes with the layouts of the dims it keeps;
- (by a table, no tag says it) views reading each leading index on its own (`view_as_complex`,
  `view_as_real`): they commute with the layouts of those leading dims;
- `nondeterministic_seeded` (a random draw): equal to nothing, not even another draw of itself;
- anything else: congruence only (the same op on equal arguments gives equal results).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch

# The kinds an open op can have (see the module docstring); `shardproof.relations` has a rule per kind.
POINTWISE, REDUCTION, LEADING, RANDOM, OPAQUE = "pointwise", "reduction", "leading", "random", "opaque"

# Views that fold trailing dims of their input into each element or unfold elements into trailing
# dims, reading every leading index on its own (no tag says so): the number of trailing input dims
# each consumes. A complex tensor viewed as real pairs is the one case torch has.
_TRAILING_CONSUMED = {"aten.view_as_complex.default": 1, "aten.view_as_real.default": 0}


@dataclass(frozen=True)
class Operand:
    """Stands for the op's `index`-th tensor input inside its argument template."""

    index: int


Attrs = tuple[Any, Any, tuple[int, ...]]  # (args template, kwargs template as sorted pairs, output path)


def is_open(op: str) -> bool:
    """IR ops of our own have plain names; open ops are `namespace.name.overload`."""
    return "." in op


def name_of(target: Any) -> str:
    """The IR name of a torch operator overload: `aten.cumsum.default`."""
    namespace, rest = target._schema.name.split("::")
    return f"{namespace}.{rest}.{target._overloadname}"


@functools.lru_cache(maxsize=None)
def overload(op: str) -> Any:
    """The torch operator overload an open op names."""
    namespace, name, overload_name = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload_name)


@functools.lru_cache(maxsize=None)
def kind(op: str) -> str:
    target = overload(op)
    tags = set(target.tags)
    if op in _TRAILING_CONSUMED:
        return LEADING
    if torch.Tag.nondeterministic_seeded in tags:
        return RANDOM
    if torch.Tag.pointwise in tags:
        return POINTWISE
    if torch.Tag.reduction in tags and _argument_index(target, "dim") is not None:
        return REDUCTION
    return OPAQUE


def template(value: Any, operand: Callable[[Any], int | None]) -> Any:
    """`value` (an argument, possibly nested) as a hashable template: tensors (those `operand`
    numbers) become `Operand`s, lists become tuples."""
    index = operand(value)
    if index is not None:
        return Operand(index)
    if isinstance(value, (list, tuple)):
        return tuple(template(v, operand) for v in value)
    return value


def fill(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A template with its operands replaced by the tensors (tuples back to lists, as schemas take)."""
    if isinstance(value, Operand):
        return tensors[value.index]
    if isinstance(value, tuple):
        return [fill(v, tensors) for v in value]
    return value


def run(op: str, tensors: list[torch.Tensor], attrs: Attrs) -> torch.Tensor:
    """Execute an open op on real tensors, returning the output at its path."""
    args, kwargs, path = attrs
    out = overload(op)(*fill(args, tensors), **{k: fill(v, tensors) for k, v in kwargs})
    for index in path:
        out = out[index]
    return out


def leading_dims(op: str, rank: int) -> int:
    """How many leading dims of its input a `LEADING` op keeps, each read index by index."""
    return rank - _TRAILING_CONSUMED[op]


def output_shape(op: str, attrs: Attrs, inputs: tuple[tuple[tuple[int, ...], str], ...]) -> tuple[int, ...]:
    """The shape an open op gives inputs of these (shape, dtype): torch's meta kernel says."""
    return _output_shape(op, attrs, inputs)


@functools.lru_cache(maxsize=4096)
def _output_shape(op: str, attrs: Attrs, inputs: tuple[tuple[tuple[int, ...], str], ...]) -> tuple[int, ...]:
    tensors = [torch.empty(shape, dtype=getattr(torch, dtype), device="meta") for shape, dtype in inputs]
    return tuple(run(op, tensors, attrs).shape)


def reduced_dims(op: str, attrs: Attrs, rank: int) -> tuple[tuple[int, ...], bool]:
    """A reduction's reduced dims (sorted, non-negative) and its keepdim flag."""
    target = overload(op)
    dims = argument(target, attrs, "dim")
    keepdim = bool(argument(target, attrs, "keepdim") or False)
    if dims is None or dims == ():
        return tuple(range(rank)), keepdim
    dims = (dims,) if isinstance(dims, int) else dims
    return tuple(sorted(d % rank for d in dims)) if rank else (), keepdim


def _argument_index(target: Any, name: str) -> int | None:
    return next((i for i, a in enumerate(target._schema.arguments) if a.name == name), None)


def argument(target: Any, attrs: Attrs, name: str) -> Any:
    """The value of argument `name` in a template: positional, keyword, or the schema's default."""
    args, kwargs, _ = attrs
    index = _argument_index(target, name)
    if index is None:
        return None
    if index < len(args):
        return args[index]
    given = dict(kwargs)
    if name in given:
        return given[name]
    default = target._schema.arguments[index].default_value
    return tuple(default) if isinstance(default, list) else default
