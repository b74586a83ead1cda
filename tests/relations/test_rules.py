"""The harness of the numeric tests of every rewrite rule in `shardproof.relations.rules` (one
test_rules_*.py file per module of the package), its shared strategies and builders, and the tests
of the core of `Rules`.

Each test writes an expression once over IR ops; `Build` runs every op both ways at the same
time: on real float64 tensors with `run_op` (the ground truth) and through `Rules.build` (which
normalizes as it builds). The normalized term, evaluated on the same leaves, must equal the
torch result. Where a rule promises a shape of normal form (the same term id as the reference,
a slice of the root) that is asserted too, so the rule is known to have fired.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from shardproof.ir.ops import run_op
from shardproof.relations.evaluate import evaluate
from shardproof.relations.rules import Rules

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class V:
    """One value built both ways: its normalized term and its torch value."""

    term: int
    value: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)


class Build:
    def __init__(self, seed: int = 0) -> None:
        self.r = Rules()
        self.leaves: dict[str, torch.Tensor] = {}
        self.gen = torch.Generator().manual_seed(seed)

    @property
    def u(self):
        return self.r.u

    # --- leaves and constants
    def leaf(self, name: str, shape: tuple[int, ...], value: torch.Tensor | None = None) -> V:
        if value is None:
            value = torch.randn(shape, dtype=torch.float64, generator=self.gen)
        self.leaves[name] = value
        return V(self.r.leaf(name, tuple(value.shape), _dtype_name(value.dtype)), value)

    def scalar(self, value, shape: tuple[int, ...], dtype: torch.dtype = torch.float64) -> V:
        """A python number in an aten call, as the lowering spells it: 0-d const, view, expand."""
        s = V(self.r.const(("full", value), (), _dtype_name(dtype)), torch.tensor(value, dtype=dtype))
        if shape:
            s = self.view(s, (1,) * len(shape))
            s = self.expand(s, shape)
        return s

    # --- IR ops
    def op(self, op: str, *args: V, attrs: tuple = ()) -> V:
        value = run_op(op, [a.value for a in args], attrs)
        term = self.r.build(op, tuple(a.term for a in args), attrs, tuple(value.shape), _dtype_name(value.dtype))
        return V(term, value)

    def sl(self, x: V, dim: int, lo: int, hi: int) -> V:
        return self.op("slice", x, attrs=(dim, lo, hi))

    def box(self, x: V, box) -> V:
        for d, (lo, hi) in enumerate(box):
            if (lo, hi) != (0, x.shape[d]):
                x = self.sl(x, d, lo, hi)
        return x

    def view(self, x: V, shape) -> V:
        return self.op("view", x, attrs=(tuple(shape),))

    def expand(self, x: V, shape) -> V:
        return self.op("expand", x, attrs=(tuple(shape),))

    def permute(self, x: V, perm) -> V:
        return self.op("permute", x, attrs=(tuple(perm),))

    def cat(self, xs: list[V], dim: int) -> V:
        return self.op("cat", *xs, attrs=(dim,))

    def add(self, *xs: V) -> V:
        total = xs[0]
        for x in xs[1:]:
            total = self.op("add", total, x)
        return total

    def sub(self, x: V, y: V) -> V:
        return self.op("add", x, self.op("neg", y))

    def max_over(self, *xs: V) -> V:
        """A MAX all-reduce of the ranks' values `xs`."""
        return V(self.r.maximum([x.term for x in xs]), torch.stack([x.value for x in xs]).amax(0))

    def ops_in(self, x: V) -> set[str]:
        seen, stack = set(), [x.term]
        while stack:
            t = stack.pop()
            if t not in seen:
                seen.add(t)
                stack.extend(self.u[t].args)
        return {self.u[t].op for t in seen}

    # --- checks
    def value_of(self, x: V) -> torch.Tensor:
        return evaluate(self.u, x.term, self.leaves)

    def check(self, x: V) -> None:
        got = self.value_of(x)
        assert tuple(got.shape) == x.shape == self.u[x.term].shape
        torch.testing.assert_close(got.to(x.value.dtype), x.value, rtol=1e-9, atol=1e-9)

    def op_of(self, x: V) -> str:
        return self.u[x.term].op

    def is_slice_of(self, x: V, root: V) -> bool:
        term = self.u[x.term]
        return term.op == "slice" and term.args[0] == root.term


# --- strategies --------------------------------------------------------------------------------
def ranges(size: int):
    return st.tuples(st.integers(0, size - 1), st.integers(1, size)).map(lambda p: (min(p), max(p) + (p[0] == p[1])))


@st.composite
def shape_and_box(draw, min_dims: int = 1, max_dims: int = 3, max_size: int = 5):
    shape = tuple(draw(st.lists(st.integers(1, max_size), min_size=min_dims, max_size=max_dims)))
    box = tuple(draw(ranges(s)) for s in shape)
    return shape, box


def relative(draw, box):
    return tuple(draw(ranges(hi - lo)) for lo, hi in box)


@st.composite
def cuts(draw, size: int, max_parts: int = 4):
    """Sorted split points 0 = c0 < c1 < ... < ck = size."""
    inner = draw(st.sets(st.integers(1, size - 1), max_size=max_parts - 1)) if size > 1 else set()
    return [0, *sorted(inner), size]


# --- values several test files build -----------------------------------------------------------
def masked_local_ids(b: Build, ids: V, lo: int, hi: int) -> tuple[V, V]:
    """(ids outside [lo, hi), ids - lo set to 0 there): one vocab-parallel rank's ids, spelled as
    the lowering spells Megatron's masking."""
    mask = b.op(
        "logical_or",
        b.op("lt", ids, b.scalar(lo, ids.shape, torch.int64)),
        b.op("ge", ids, b.scalar(hi, ids.shape, torch.int64)),
    )
    shifted = b.sub(ids, b.scalar(lo, ids.shape, torch.int64))
    return mask, b.op("where", mask, b.scalar(0, ids.shape, torch.int64), shifted)


def labels(b: Build, name: str, shape: tuple[int, ...], vocab: int) -> V:
    return b.leaf(name, shape, value=torch.randint(0, vocab, shape, generator=b.gen))


def column(b: Build, x: V) -> V:
    return b.view(x, x.shape + (1,))


def one_hot(b: Build, ids: V, values: V, width: int, op: str = "scatter_add") -> V:
    """`values` written at `ids` along a new last dim of `width` (gather's backward)."""
    zeros = b.scalar(0.0, ids.shape + (width,))
    return b.op(op, zeros, column(b, ids), column(b, values), attrs=(len(ids.shape),))


# --- the core of Rules ---------------------------------------------------------------------------
def test_float_dtypes_are_one_real_dtype():
    """A bf16 matmul of values cast down is the fp32 matmul: terms are values over the reals."""
    r = Rules()
    x, w = r.leaf("x", (2, 3), "float32"), r.leaf("w", (3, 4), "float32")
    low = [r.build("convert", (t,), ("bfloat16",), r.shape(t), "bfloat16") for t in (x, w)]
    assert low == [x, w]
    assert r.build("matmul", tuple(low), (), (2, 4), "bfloat16") == r.build("matmul", (x, w), (), (2, 4), "float32")
    ids = r.leaf("ids", (2, 3), "int64")
    assert r.build("convert", (ids,), ("float32",), (2, 3), "float32") != ids
