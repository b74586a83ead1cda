"""Numeric tests of the laws open ops get from torch's tags (`ir/aten_ops.py`, rules by kind in
`rules/core.py`), driven by torch's own operator table rather than a list written by hand: every
pointwise aten overload that takes one or two float tensors commutes with slices and
concatenations of its operands, every reduction over a `dim` with layouts of the dims it keeps,
and any other op is equal on equal operands only. The harness, `Build`, is in test_rules.py."""

from __future__ import annotations

import functools

import pytest
import torch

from shardproof.ir import aten_ops
from shardproof.ir.aten_ops import Operand
from test_rules import Build, V


DOMAINS = ((0.1, 0.9), (1.1, 1.9))  # inputs drawn from the first where the op is finite (acos, acosh, ...)


def _sample(shape: tuple[int, ...], domain: tuple[float, float], gen: torch.Generator | None = None) -> torch.Tensor:
    lo, hi = domain
    return lo + (hi - lo) * torch.rand(shape, dtype=torch.float64, generator=gen)


def _domain(target, arity: int) -> tuple[float, float] | None:
    """Where `target` maps float tensors to finite floats (or bools) of their shape; None if nowhere."""
    for domain in DOMAINS:
        try:
            out = target(*(_sample((3, 4), domain) for _ in range(arity)))
        except Exception:  # noqa: BLE001 - not an op of float tensors with these arguments
            return None
        if isinstance(out, torch.Tensor) and out.shape == (3, 4) and (out.dtype == torch.bool or (out.dtype == torch.float64 and out.isfinite().all())):
            return domain
    return None


@functools.lru_cache(maxsize=None)
def _overloads() -> list:
    found = []
    for name in dir(torch.ops.aten):
        packet = getattr(torch.ops.aten, name)
        if not isinstance(packet, torch._ops.OpOverloadPacket):
            continue
        found.extend(getattr(packet, overload) for overload in packet.overloads())
    return found


def _tensor_arity(target) -> int | None:
    """How many leading Tensor arguments the schema takes when the others all have defaults."""
    arguments = target._schema.arguments
    tensors = 0
    while tensors < len(arguments) and str(arguments[tensors].type) == "Tensor":
        tensors += 1
    rest = arguments[tensors:]
    if not 1 <= tensors <= 2 or any(a.default_value is None and not a.kwarg_only and str(a.type) != "Tensor?" for a in rest):
        return None
    if any(a.alias_info is not None for a in arguments) or "out" in target._overloadname:
        return None
    return tensors


@functools.lru_cache(maxsize=None)
def _pointwise() -> list[tuple[str, int, tuple[float, float]]]:
    ops = []
    for target in _overloads():
        arity = _tensor_arity(target)
        if arity and torch.Tag.pointwise in target.tags and torch.Tag.nondeterministic_seeded not in target.tags:
            domain = _domain(target, arity)
            if domain is not None:
                ops.append((aten_ops.name_of(target), arity, domain))
    return ops


REDUCTIONS = [("aten.amin.default", (1,)), ("aten.all.dim", (1,)), ("aten.logsumexp.default", ((1,),)),
              ("aten.std.correction", ((1,),)), ("aten.argmax.default", (1, True)), ("aten.prod.dim_int", (1,))]


def _open(b: Build, op: str, *args: V, extra: tuple = ()) -> V:
    attrs = (tuple(Operand(i) for i in range(len(args))) + extra, (), ())
    return b.op(op, *args, attrs=attrs)


def test_the_table_finds_the_pointwise_ops_a_model_uses() -> None:
    names = {name for name, _, _ in _pointwise()}
    assert {"aten.softplus.default", "aten.hardtanh.default", "aten.pow.Tensor_Tensor", "aten.atan2.default",
            "aten.logical_xor.default"} <= names
    assert len(names) > 80


@pytest.mark.parametrize("op, arity, domain", _pointwise(), ids=lambda v: v if isinstance(v, str) else "")
def test_pointwise_ops_commute_with_slices_and_cats(op: str, arity: int, domain: tuple[float, float]) -> None:
    b = Build()
    xs = [b.leaf(f"x{i}", (4, 6), _sample((4, 6), domain, b.gen)) for i in range(arity)]
    sliced = _open(b, op, *(b.sl(b.sl(x, 1, 2, 5), 0, 1, 3) for x in xs))
    b.check(sliced)
    assert b.is_slice_of(sliced, _open(b, op, *xs))
    parts = [[b.leaf(f"{side}{i}", (4, width), _sample((4, width), domain, b.gen))
              for side, width in (("l", 2), ("r", 4))] for i in range(arity)]
    joined = _open(b, op, *(b.cat(p, 1) for p in parts))
    b.check(joined)
    assert b.u[joined.term].op == "cat"


@pytest.mark.parametrize("op, extra", REDUCTIONS, ids=[r[0] for r in REDUCTIONS])
def test_reductions_commute_with_layouts_of_the_dims_they_keep(op: str, extra: tuple) -> None:
    b = Build()
    x = b.leaf("x", (4, 6, 5), torch.rand(4, 6, 5, dtype=torch.float64) + 0.5)
    if op == "aten.all.dim":
        x = b.op("gt", x, b.scalar(1.0, (4, 6, 5)))
    rows = _open(b, op, b.sl(x, 0, 1, 3), extra=extra)
    b.check(rows)
    assert b.is_slice_of(rows, _open(b, op, x, extra=extra))
    left, right = (b.leaf(name, (4, 6, width), torch.rand(4, 6, width, dtype=torch.float64) + 0.5) for name, width in (("l", 2), ("r", 3)))
    if op == "aten.all.dim":
        left, right = (b.op("gt", t, b.scalar(1.0, t.shape)) for t in (left, right))
    joined = _open(b, op, b.cat([left, right], 2), extra=extra)
    b.check(joined)
    assert b.u[joined.term].op == "cat"


def test_a_reduction_over_a_sliced_dim_stays_whole() -> None:
    """Over part of the reduced dim it is no region of the whole's reduction: no law applies."""
    b = Build()
    x = b.leaf("x", (4, 6))
    y = _open(b, "aten.amin.default", b.sl(x, 1, 0, 3), extra=(1,))
    b.check(y)
    assert b.u[y.term].op == "aten.amin.default" and b.u[b.u[y.term].args[0]].op == "slice"


def test_opaque_ops_are_equal_on_equal_operands_only() -> None:
    b = Build()
    x = b.leaf("x", (4, 6))
    first, again = (_open(b, "aten.cumsum.default", x, extra=(1,)) for _ in range(2))
    b.check(first)
    assert first.term == again.term
    other_dim = _open(b, "aten.cumsum.default", x, extra=(0,))
    sliced = _open(b, "aten.cumsum.default", b.sl(x, 0, 2, 4), extra=(0,))  # rows summed from row 2, not row 0
    b.check(sliced)
    assert other_dim.term != first.term and not b.is_slice_of(sliced, other_dim)


def test_complex_views_commute_with_layouts_of_their_leading_dims() -> None:
    """A complex tensor viewed from real pairs and back (a complex rotary embedding): a rank's heads
    of the pairs are those heads of the complex view, and the two views undo each other."""
    b = Build()
    x = b.leaf("x", (2, 4, 3, 2))
    whole = _open(b, "aten.view_as_complex.default", x)
    heads = _open(b, "aten.view_as_complex.default", b.sl(x, 1, 0, 2))
    b.check(heads)
    assert b.is_slice_of(heads, whole)
    rotated = b.op("mul", heads, b.sl(whole, 1, 2, 4))
    pairs = _open(b, "aten.view_as_real.default", rotated)
    b.check(pairs)
    joined = _open(b, "aten.view_as_complex.default", b.cat([b.sl(x, 1, 0, 2), b.leaf("y", (2, 2, 3, 2))], 1))
    b.check(joined)
    assert b.u[joined.term].op == "cat"
    assert _open(b, "aten.view_as_real.default", whole).term == x.term


GATHER_ROWS = ((Operand(0), (Operand(1),)), (), ())  # x[idx]: aten.index.Tensor's template


def test_an_opaque_op_linear_by_dtensors_strategies_maps_through_partial_sums() -> None:
    """A rank's row gather of its partial product (a routed expert's output) is its share of the
    gather of the whole product: the shares sum to it."""
    b = Build()
    x, w = b.leaf("x", (5, 6)), b.leaf("w", (6, 3))
    idx = b.leaf("idx", (7,), torch.randint(0, 5, (7,), generator=b.gen))
    shares = [b.op("aten.index.Tensor", b.op("matmul", b.sl(x, 1, lo, hi), b.sl(w, 0, lo, hi)), idx, attrs=GATHER_ROWS)
              for lo, hi in ((0, 2), (2, 6))]
    assert all(b.op_of(s) == "piece" for s in shares)
    total = b.add(*shares)
    whole = b.op("aten.index.Tensor", b.op("matmul", x, w), idx, attrs=GATHER_ROWS)
    assert total.term == whole.term
    b.check(total)
    torch.testing.assert_close(b.value_of(total), whole.value)


def test_an_opaque_op_not_linear_keeps_its_partial_operand() -> None:
    b = Build()
    x, w = b.leaf("x", (5, 6)), b.leaf("w", (6, 3))
    share = _open(b, "aten.cumsum.default", b.op("matmul", b.sl(x, 1, 0, 2), b.sl(w, 0, 0, 2)), extra=(0,))
    assert b.op_of(share) == "aten.cumsum.default"


def _empty(b: Build, rank: int, n: int) -> V:
    """An uninitialised buffer as relations/execute.py makes it: a term of its own per rank and line."""
    return V(b.r.literal("empty", (), (rank, 0), (n,), "int64"), torch.zeros(n, dtype=torch.int64))


def test_an_empty_buffer_written_at_every_sorted_position_is_no_argument() -> None:
    """`inv = empty(n); inv[perm] = arange(n)` with `perm` a sort's order: the inverse permutation,
    the same on every rank whatever its buffer held."""
    b = Build()
    keys = b.leaf("keys", (6,), torch.randint(0, 3, (6,), generator=b.gen))
    perm = b.op("aten.sort.default", keys, attrs=((Operand(0),), (), (1,)))
    steps = V(b.r.const(("arange", 0, 6, 1), (6,), "int64"), torch.arange(6))
    put = ((Operand(0), (Operand(1),), Operand(2)), (), ())
    inverses = [b.op("aten.index_put.default", _empty(b, rank, 6), perm, steps, attrs=put) for rank in (0, 1)]
    assert inverses[0].term == inverses[1].term
    b.check(inverses[0])
    torch.testing.assert_close(inverses[0].value[perm.value], torch.arange(6))
    partial = b.op("aten.index_put.default", _empty(b, 0, 6), b.sl(perm, 0, 0, 3), b.sl(steps, 0, 0, 3), attrs=put)
    assert "empty" in b.ops_in(partial)  # some entries keep the buffer's contents: it stays
