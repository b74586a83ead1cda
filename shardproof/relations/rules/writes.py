"""Writes that cover every entry of an uninitialised buffer: its contents are never read.

A buffer from `torch.empty` is a term unique to its rank and line (relations/execute.py), so
nothing that reads it equals anything. `inv[perm] = arange(n)` into `empty(n)` (transformers' MoE
inverts its sort so) writes every entry exactly once when `perm` is a permutation of 0..n-1: the
indices a sort returns, or an arange. The buffer is then any buffer; zeros stand for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.ir.aten_ops import Operand

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules

_WRITES_AT_INDICES = ("aten.index_put.default",)
_PERMUTATIONS = ("aten.sort.default", "aten.sort.stable")  # output 1: the order, a permutation along dim


def overwritten(r: Rules, op: str, args: tuple[int, ...], attrs) -> tuple[int, ...]:
    """`args` with an uninitialised buffer that `op` overwrites entirely replaced by zeros."""
    if op not in _WRITES_AT_INDICES or r.op(args[0]) != "empty":
        return args
    template, named, _ = attrs
    _, indices, values, *rest = template
    if dict(named).get("accumulate", rest[0] if rest else False) or len(indices) != 1 or not isinstance(indices[0], Operand):
        return args
    buffer = args[0]
    if not is_permutation(r, args[indices[0].index], r.shape(buffer)[0]):
        return args
    return (r.const(("full", 0), r.shape(buffer), r.u[buffer].dtype), *args[1:])


def is_permutation(r: Rules, t: int, n: int) -> bool:
    """`t` is a 1-D ordering of 0..n-1: arange(n), or the order a sort of a 1-D tensor returns."""
    term = r.u[t]
    if term.shape != (n,):
        return False
    if term.op == "const":
        return term.attrs == ("arange", 0, n, 1)
    return term.op in _PERMUTATIONS and term.attrs[2] == (1,) and r.shape(term.args[0]) == (n,)
