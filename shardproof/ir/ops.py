"""The op set: every IR op's meaning, in one table.

Each entry says what kind of op it is (the rule templates in `shardproof.relations` are written per
kind, not per op) and how to run it on real tensors (used by the numeric tests of every rule).
Adding an op is one entry here plus, if its kind is new, its rule template. Ops without an entry
are not refused: any torch operator overload is an open op (`ir/aten_ops.py`), its kind read off
torch's tags; an entry here is for the ops whose distribution laws are written by hand.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from shardproof.ir import aten_ops

Impl = Callable[[list[torch.Tensor], tuple[Any, ...]], torch.Tensor]


@dataclass(frozen=True)
class OpSpec:
    name: str
    kind: str  # ours: leaf const layout unary binary compare where reduce softmax matmul embedding gather scatter mask
    # collective p2p call; open ops: pointwise reduction random opaque (ir/aten_ops.py)
    impl: Impl | None
    doc: str


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]) -> Impl:
    return lambda xs, attrs: fn(xs[0])


def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Impl:
    return lambda xs, attrs: fn(xs[0], xs[1])


def _slice(xs: list[torch.Tensor], attrs: tuple) -> torch.Tensor:
    dim, start, end = attrs
    return xs[0].narrow(dim, start, end - start)


def _reduce(fn: Callable[..., torch.Tensor]) -> Impl:
    return lambda xs, attrs: fn(xs[0], dim=list(attrs[0]), keepdim=attrs[1])


def _argmax(xs: list[torch.Tensor], attrs: tuple) -> torch.Tensor:
    (dim,), keepdim = attrs
    return torch.argmax(xs[0], dim=dim, keepdim=keepdim)


_SPECS = [
    OpSpec("leaf", "leaf", None, "a graph input: a reference parameter, buffer or model input (attrs: name)"),
    OpSpec("const", "const", None, "a constant tensor (attrs: values as a nested tuple, or ('full', value))"),
    OpSpec("view", "layout", lambda xs, a: xs[0].reshape(a[0]), "reshape to attrs[0] (row-major)"),
    OpSpec("permute", "layout", lambda xs, a: xs[0].permute(a[0]), "permute dims by attrs[0]"),
    OpSpec("slice", "layout", _slice, "contiguous slice: attrs (dim, start, end)"),
    OpSpec("cat", "layout", lambda xs, a: torch.cat(xs, a[0]), "concatenate inputs along attrs[0]"),
    OpSpec("expand", "layout", lambda xs, a: xs[0].expand(a[0]), "broadcast to attrs[0] (same rank)"),
    OpSpec("convert", "layout", lambda xs, a: xs[0].to(getattr(torch, a[0])), "dtype cast (identity over the reals)"),
    OpSpec("neg", "unary", _unary(torch.neg), "-x (linear)"),
    OpSpec("exp", "unary", _unary(torch.exp), "e^x"),
    OpSpec("log", "unary", _unary(torch.log), "natural log"),
    OpSpec("sqrt", "unary", _unary(torch.sqrt), "square root"),
    OpSpec("rsqrt", "unary", _unary(torch.rsqrt), "1/sqrt(x)"),
    OpSpec("reciprocal", "unary", _unary(torch.reciprocal), "1/x"),
    OpSpec("relu", "unary", _unary(torch.relu), "max(x, 0)"),
    OpSpec("silu", "unary", _unary(F.silu), "x*sigmoid(x)"),
    OpSpec("gelu", "unary", lambda xs, a: F.gelu(xs[0], approximate=a[0]), "GELU (attrs: approximation)"),
    OpSpec("sigmoid", "unary", _unary(torch.sigmoid), "logistic"),
    OpSpec("tanh", "unary", _unary(torch.tanh), "tanh"),
    OpSpec("erf", "unary", _unary(torch.erf), "error function (exact GELU and its backward)"),
    OpSpec("sin", "unary", _unary(torch.sin), "sin"),
    OpSpec("cos", "unary", _unary(torch.cos), "cos"),
    OpSpec("abs", "unary", _unary(torch.abs), "|x|"),
    OpSpec("pow", "unary", lambda xs, a: xs[0] ** a[0], "x ** attrs[0]"),
    OpSpec("logical_not", "unary", _unary(torch.logical_not), "boolean not"),
    OpSpec("add", "binary", _binary(torch.add), "x + y (broadcasting)"),
    OpSpec("mul", "binary", _binary(torch.mul), "x * y (broadcasting)"),
    OpSpec("div", "binary", _binary(torch.div), "x / y (broadcasting)"),
    OpSpec("maximum", "binary", _binary(torch.maximum), "elementwise max"),
    OpSpec("minimum", "binary", _binary(torch.minimum), "elementwise min"),
    OpSpec("logical_or", "binary", _binary(torch.logical_or), "boolean or"),
    OpSpec("logical_and", "binary", _binary(torch.logical_and), "boolean and"),
    OpSpec("lt", "compare", _binary(torch.lt), "x < y"),
    OpSpec("le", "compare", _binary(torch.le), "x <= y"),
    OpSpec("gt", "compare", _binary(torch.gt), "x > y"),
    OpSpec("ge", "compare", _binary(torch.ge), "x >= y"),
    OpSpec("eq", "compare", _binary(torch.eq), "x == y"),
    OpSpec("ne", "compare", _binary(torch.ne), "x != y"),
    OpSpec("where", "where", lambda xs, a: torch.where(xs[0], xs[1], xs[2]), "cond ? x : y"),
    OpSpec("sum", "reduce", _reduce(torch.sum), "sum over dims attrs[0], keepdim attrs[1] (linear)"),
    OpSpec("amax", "reduce", _reduce(torch.amax), "max over dims attrs[0], keepdim attrs[1]"),
    OpSpec("argmax", "reduce", _argmax, "index of the max over the one dim attrs[0], keepdim attrs[1]"),
    OpSpec("softmax", "softmax", lambda xs, a: torch.softmax(xs[0], a[0]), "softmax over attrs[0]"),
    OpSpec("logsumexp", "logsumexp", lambda xs, a: torch.logsumexp(xs[0], a[0]),
           "log of the sum of exp over the one dim attrs[0]: a normal form (torch decomposes its logsumexp)"),
    OpSpec("log_softmax", "softmax", lambda xs, a: torch.log_softmax(xs[0], a[0]), "log-softmax over attrs[0]"),
    OpSpec("matmul", "matmul", _binary(torch.matmul), "torch.matmul: batch dims broadcast, contracts last of x with -2 of y"),
    OpSpec("embedding", "embedding", lambda xs, a: F.embedding(xs[1], xs[0]), "rows of weight xs[0] at ids xs[1]"),
    OpSpec("gather", "gather", lambda xs, a: torch.gather(xs[0], a[0], xs[1]), "torch.gather(xs[0], attrs[0], index xs[1])"),
    OpSpec("scatter", "scatter", lambda xs, a: torch.scatter(xs[0], a[0], xs[1], xs[2]),
           "xs[0] with the entries at index xs[1] along attrs[0] replaced by xs[2] (gather's inverse)"),
    OpSpec("scatter_add", "scatter", lambda xs, a: torch.scatter_add(xs[0], a[0], xs[1], xs[2]),
           "xs[0] plus xs[2] added at index xs[1] along attrs[0] (gather's backward)"),
    OpSpec("triu", "mask", lambda xs, a: torch.triu(xs[0], a[0]), "upper triangle from diagonal attrs[0]"),
    OpSpec("tril", "mask", lambda xs, a: torch.tril(xs[0], a[0]), "lower triangle from diagonal attrs[0]"),
    OpSpec("all_reduce", "collective", None, "sum, mean or max (attrs[0]) over the group attrs[1]"),
    OpSpec("all_gather", "collective", None, "concatenate every rank's tensor along attrs[0] over group attrs[1]"),
    OpSpec("reduce_scatter", "collective", None, "sum over ranks, this rank keeps chunk rank of dim attrs[0]"),
    OpSpec("all_to_all", "collective", None, "all_to_all_single: dim 0 cut by input splits attrs[1], piece j to member j of "
           "group attrs[2]; member p receives piece p of every member's input, output splits attrs[0] (ir/all_to_all.py)"),
    OpSpec("send", "p2p", None, "send the input to global rank attrs[0] with tag attrs[1] over the group attrs[2]; "
           "its value is the tensor sent (relations/messages.py); attrs[0] is ('no rank', p) for a rank p the group lacks"),
    OpSpec("recv", "p2p", None, "the tensor global rank attrs[0] sends this rank with tag attrs[1] over the group "
           "attrs[2], the k-th recv of a channel pairing with its k-th send (relations/messages.py)"),
    OpSpec("call", "call", None, "output attrs[1] of a repeated module's graph attrs[0] on the inputs (shardproof.partition)"),
]



class OpTable(Mapping[str, OpSpec]):
    """Our own ops by name, and every torch operator overload as an open op (`ir/aten_ops.py`),
    its spec derived from its tags when first asked for."""

    def __init__(self, specs: list[OpSpec]):
        self._own = {spec.name: spec for spec in specs}

    def __getitem__(self, op: str) -> OpSpec:
        spec = self._own.get(op)
        if spec is None:
            if not aten_ops.is_open(op):
                raise KeyError(op)
            spec = _open_spec(op)
        return spec

    def __contains__(self, op: object) -> bool:
        return isinstance(op, str) and (op in self._own or aten_ops.is_open(op))

    def __iter__(self) -> Iterator[str]:
        return iter(self._own)

    def __len__(self) -> int:
        return len(self._own)


@functools.lru_cache(maxsize=None)
def _open_spec(op: str) -> OpSpec:
    return OpSpec(op, aten_ops.kind(op), lambda xs, attrs: aten_ops.run(op, xs, attrs), f"torch's {op}")


OPS = OpTable(_SPECS)


def waits_for_peers(op: str) -> bool:
    """Whether `op`'s value comes from other ranks (a collective, a message): a rank waits there."""
    return OPS[op].kind in ("collective", "p2p")


def run_op(op: str, inputs: list[torch.Tensor], attrs: tuple[Any, ...]) -> torch.Tensor:
    """Execute one IR op on real tensors (numeric tests of rules)."""
    spec = OPS[op]
    if spec.impl is None:
        raise ValueError(f"op `{op}` has no single-device implementation")
    return spec.impl(inputs, attrs)
