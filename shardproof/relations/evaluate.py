"""The numeric value of a term on given leaf tensors: the meaning the rewrite rules must preserve.

Used by the numeric tests of the rules (tests/relations): a normalized term and the torch
computation it came from must agree on random leaves.
"""

from __future__ import annotations

from fractions import Fraction

import torch

from shardproof.ir.ops import OPS, run_op
from shardproof.relations.universe import Universe


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype `{name}`")
    return dtype


def evaluate(universe: Universe, term_id: int, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
    """The value of term `term_id` with leaf `name` bound to `leaves[name]` (memoized per call)."""
    memo: dict[int, torch.Tensor] = {}

    def value(t: int) -> torch.Tensor:
        found = memo.get(t)
        if found is None:
            found = memo[t] = _one(universe, t, value, leaves)
        return found

    # Iterative warm-up in id order keeps recursion shallow: arguments always have smaller ids.
    for t in sorted(universe.reachable(term_id)):
        value(t)
    return memo[term_id]


def _one(universe: Universe, t: int, value, leaves: dict[str, torch.Tensor]) -> torch.Tensor:
    term = universe[t]
    op, attrs, shape = term.op, term.attrs, term.shape
    if op == "leaf":
        return leaves[attrs[0]]
    if op == "full":
        value = float(attrs[0]) if isinstance(attrs[0], Fraction) else attrs[0]  # scaled constants keep exact values
        return torch.full(shape, value, dtype=_torch_dtype(term.dtype))
    if op == "const":
        if attrs[0] == "values":
            flat = torch.tensor(attrs[1], dtype=_torch_dtype(term.dtype))
        elif attrs[0] == "arange":
            flat = torch.arange(*attrs[1:], dtype=_torch_dtype(term.dtype))
        else:
            raise NotImplementedError(f"const spec `{attrs[0]}`")
        return flat.reshape(shape)
    if op in ("piece", "max_piece", "arg_piece", "top_piece"):
        raise NotImplementedError(
            f"a `{op}` is one part of a sum (or max) split over ranks; it has no value on its own "
            "(only pieces tiling the whole range combined do, and that normalizes to the whole)"
        )
    args = [value(a) for a in term.args]
    if op == "slice":
        return args[0][tuple(slice(lo, hi) for lo, hi in attrs[0])]
    if op == "cat":
        return torch.cat(args, attrs[0])
    if op == "view":
        return args[0].reshape(shape)
    if op == "permute":
        return args[0].permute(attrs[0])
    if op == "bcast":
        dims = attrs[0]
        order = sorted(range(len(dims)), key=lambda i: dims[i])  # base dim i sits at output dim dims[i]
        base = args[0].permute(order) if order != list(range(len(dims))) else args[0]
        placed = [1] * len(shape)
        for d in dims:
            placed[d] = shape[d]
        return base.reshape(placed).expand(shape)
    if op == "repeat":
        dim, times = attrs
        return torch.repeat_interleave(args[0], times, dim)
    if op == "lin":
        total = None
        for x, c in zip(args, attrs[0]):
            scaled = x * (int(c) if c.denominator == 1 else float(c))
            total = scaled if total is None else total + scaled
        if not term.dtype.startswith(("float", "bfloat", "complex")):
            total = total.to(_torch_dtype(term.dtype))
        return total
    if op in OPS and OPS[op].impl is not None:
        return run_op(op, args, attrs)
    raise NotImplementedError(f"term op `{op}` has no numeric meaning")
