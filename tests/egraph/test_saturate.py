"""Equality saturation must prove the ring identities the normal form misses, and nothing false.

Every claim is also checked numerically with `evaluate` on random float64 leaves: a proven pair
must agree, and each false pair really differs, so a False here is not just a budget running out.
"""

from __future__ import annotations

from fractions import Fraction

import egglog.bindings
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardproof.egraph.saturate import prove_equal
from shardproof.relations.evaluate import evaluate
from shardproof.relations.rules import Rules

SHAPE = (3, 3)  # square, so matmul and transposes compose with everything
F64 = "float64"


class Algebra:
    """Terms over leaves x, y, z, w built through the normalizing rules."""

    def __init__(self, dtype: str = F64) -> None:
        self.r = Rules()
        self.dtype = dtype
        self.x, self.y, self.z, self.w = (self.r.leaf(n, SHAPE, dtype) for n in "xyzw")

    def mul(self, a: int, b: int) -> int:
        return self.r.build("mul", (a, b), (), SHAPE, self.dtype)

    def matmul(self, a: int, b: int) -> int:
        return self.r.build("matmul", (a, b), (), SHAPE, self.dtype)

    def exp(self, a: int) -> int:
        return self.r.build("exp", (a,), (), SHAPE, self.dtype)

    def sum(self, a: int) -> int:
        return self.r.build("sum", (a,), ((1,), False), SHAPE[:1], self.dtype)

    def lin(self, *pairs: tuple[int, Fraction | int]) -> int:
        return self.r.lin([(t, Fraction(c)) for t, c in pairs])

    def add(self, a: int, b: int) -> int:
        return self.lin((a, 1), (b, 1))

    def value(self, t: int) -> torch.Tensor:
        torch.manual_seed(0)
        leaves = {n: self._random_leaf() for n in "xyzw"}
        return evaluate(self.r.u, t, leaves)

    def _random_leaf(self) -> torch.Tensor:
        if self.dtype == F64:
            return torch.randn(SHAPE, dtype=torch.float64)
        return torch.randint(-9, 10, SHAPE, dtype=torch.int64)

    def same_value(self, a: int, b: int) -> bool:
        va, vb = self.value(a), self.value(b)
        return va.shape == vb.shape and torch.allclose(va.double(), vb.double())


def _true(alg: Algebra, a: int, b: int) -> None:
    assert a != b, "the normal form already shows this one"
    assert alg.same_value(a, b)
    assert prove_equal(alg.r.u, a, b)


def _false(alg: Algebra, a: int, b: int) -> None:
    assert not alg.same_value(a, b)
    assert not prove_equal(alg.r.u, a, b)


def test_mul_associativity() -> None:
    g = Algebra()
    _true(g, g.mul(g.mul(g.x, g.y), g.z), g.mul(g.x, g.mul(g.y, g.z)))


def test_mul_commutativity_across_nested_products() -> None:
    g = Algebra()
    assert g.mul(g.x, g.y) == g.mul(g.y, g.x)  # one product: the normal form orders the operands
    _true(g, g.mul(g.mul(g.x, g.y), g.z), g.mul(g.mul(g.z, g.x), g.y))


def test_mul_distributes_over_a_sum() -> None:
    g = Algebra()
    _true(g, g.mul(g.add(g.x, g.y), g.z), g.add(g.mul(g.x, g.z), g.mul(g.z, g.y)))


def test_matmul_distributes_over_a_scaled_sum_on_either_side() -> None:
    g = Algebra()
    _true(g, g.matmul(g.lin((g.x, 1), (g.y, 2)), g.w), g.lin((g.matmul(g.x, g.w), 1), (g.matmul(g.y, g.w), 2)))
    _true(g, g.matmul(g.w, g.lin((g.x, 1), (g.y, -1))), g.lin((g.matmul(g.w, g.x), 1), (g.matmul(g.w, g.y), -1)))


def test_linear_ops_distribute_over_a_sum() -> None:
    g = Algebra()
    _true(g, g.sum(g.mul(g.add(g.x, g.y), g.z)), g.add(g.sum(g.mul(g.x, g.z)), g.sum(g.mul(g.y, g.z))))


def test_a_scaled_product_of_a_sum_expands() -> None:
    g = Algebra()
    scaled = g.lin((g.x, 1), (g.mul(g.add(g.y, g.z), g.w), 2))
    _true(g, scaled, g.lin((g.x, 1), (g.mul(g.y, g.w), 2), (g.mul(g.z, g.w), 2)))
    _false(g, scaled, g.lin((g.x, 1), (g.mul(g.y, g.w), 2), (g.mul(g.z, g.w), 1)))


def test_scales_compose_and_collect() -> None:
    g = Algebra()
    half, third = g.lin((g.x, Fraction(1, 2))), g.lin((g.y, Fraction(1, 3)))
    assert g.mul(half, third) == g.lin((g.mul(g.x, g.y), Fraction(1, 6)))  # the normal form pulls scales out
    _true(g, g.mul(half, g.mul(third, g.z)), g.lin((g.mul(g.mul(g.x, g.y), g.z), Fraction(1, 6))))
    difference_of_squares = g.mul(g.add(g.x, g.y), g.lin((g.x, 1), (g.y, -1)))
    _true(g, difference_of_squares, g.lin((g.mul(g.x, g.x), 1), (g.mul(g.y, g.y), -1)))


def test_false_equalities_are_not_proven() -> None:
    g = Algebra()
    _false(g, g.mul(g.x, g.y), g.mul(g.x, g.z))
    _false(g, g.matmul(g.x, g.y), g.matmul(g.y, g.x))
    _false(g, g.lin((g.x, 1), (g.y, 2)), g.add(g.x, g.y))
    _false(g, g.exp(g.add(g.x, g.y)), g.add(g.exp(g.x), g.exp(g.y)))  # only linear ops distribute
    _false(g, g.mul(g.lin((g.x, Fraction(1, 2))), g.y), g.mul(g.x, g.y))  # a scale applied twice or not at all
    square = g.mul(g.add(g.x, g.y), g.add(g.x, g.y))
    _false(g, square, g.add(g.mul(g.x, g.x), g.mul(g.y, g.y)))  # the cross term is missing
    _true(g, square, g.lin((g.mul(g.x, g.x), 1), (g.mul(g.x, g.y), 2), (g.mul(g.y, g.y), 1)))


def test_opaque_ops_keep_their_shape() -> None:
    """A view's attrs are empty: only its shape says which view it is."""
    g = Algebra()
    flat = g.r.build("view", (g.x,), ((9,),), (9,), F64)
    wide = g.r.build("view", (flat,), ((1, 9),), (1, 9), F64)
    tall = g.r.build("view", (flat,), ((9, 1),), (9, 1), F64)
    assert not prove_equal(g.r.u, wide, tall)


def test_integer_lin_is_opaque() -> None:
    """Integer lin truncates, so halving before or after a product differs on odd values."""
    g = Algebra("int64")
    _false(g, g.mul(g.lin((g.x, Fraction(1, 2))), g.y), g.lin((g.mul(g.x, g.y), Fraction(1, 2))))


def test_the_node_budget_returns_false_without_running(monkeypatch: pytest.MonkeyPatch) -> None:
    g = Algebra()
    a, b = g.mul(g.mul(g.x, g.y), g.z), g.mul(g.x, g.mul(g.y, g.z))

    def no_egraph(*args, **kwargs) -> None:
        raise AssertionError("over budget: no e-graph may be built")

    monkeypatch.setattr(egglog.bindings, "EGraph", no_egraph)
    assert not prove_equal(g.r.u, a, b, max_nodes=4)


# --- random terms: whatever is proven must hold numerically ---------------------------------------
def _term(g: Algebra, tree: str | tuple) -> int:
    if isinstance(tree, str):
        return getattr(g, tree)
    op, *kids = tree
    if op == "lin":
        return g.lin((_term(g, kids[0]), 1), (_term(g, kids[1]), Fraction(kids[2])))
    args = [_term(g, k) for k in kids]
    if op == "t":
        return g.r.build("permute", (args[0],), ((1, 0),), SHAPE, F64)
    return getattr(g, op)(*args)


_TREES = st.recursive(
    st.sampled_from("xyz"),
    lambda sub: st.one_of(
        st.tuples(st.sampled_from(["mul", "matmul"]), sub, sub),
        st.tuples(st.just("lin"), sub, sub, st.sampled_from(["1", "-1", "2", "1/2"])),
        st.tuples(st.just("t"), sub),
    ),
    max_leaves=5,
)


def _variant(tree: str | tuple) -> str | tuple:
    """The same value by another route: products expanded over sums, mul operands swapped."""
    if isinstance(tree, str):
        return tree
    op, *kids = tree
    if op == "lin":
        return ("lin", _variant(kids[0]), _variant(kids[1]), kids[2])
    kids = [_variant(k) for k in kids]
    if op in ("mul", "matmul"):
        for i, k in enumerate(kids):
            if not isinstance(k, str) and k[0] == "lin":
                other = kids[1 - i]
                pair = [(p, other) if i == 0 else (other, p) for p in k[1:3]]
                return ("lin", (op, *pair[0]), (op, *pair[1]), k[3])
    return ("mul", kids[1], kids[0]) if op == "mul" else (op, *kids)


def _near_miss(tree: str | tuple) -> str | tuple:
    """Most often a different value close to `tree`: its first lin coefficient raised by one."""
    if isinstance(tree, str):
        return tree
    op, *kids = tree
    if op == "lin":
        return ("lin", kids[0], kids[1], str(Fraction(kids[2]) + 1))
    for i, k in enumerate(kids):
        changed = _near_miss(k)
        if changed != k:
            return (op, *kids[:i], changed, *kids[i + 1 :])
    return tree


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_TREES)
def test_random_terms_proven_only_when_equal(tree: str | tuple) -> None:
    g = Algebra()
    a = _term(g, tree)
    variant = _variant(tree)
    for other in (variant, _near_miss(variant)):
        b = _term(g, other)
        if prove_equal(g.r.u, a, b):
            assert g.same_value(a, b)
