"""A symbolic rank computes what the int would at every rank, and every decision taken on it is a
guard: where the guards hold, the decisions come out the same."""

from __future__ import annotations

from typing import Any, Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shardproof.ir.rank_expr import RankExpr, at_rank, mentions_rank, recording

WORLD = 16
EXPRESSIONS: list[Callable[[Any], Any]] = [
    lambda r: r * 3 + 1,
    lambda r: (r + 1) * 5 - r * 5,  # the length of a shard: a plain int
    lambda r: r // 4,
    lambda r: (r * 4) // 2,
    lambda r: r % 4,
    lambda r: (r * 4) % 2,
    lambda r: 7 - r,
    lambda r: -(r // 3) * 2 + r % 5,
    lambda r: 100 // (r // 100 + 1),  # a RankExpr divisor: taken as a plain int
    lambda r: r + 1 if isinstance(r, int) else 0,  # a type check takes the path an int takes
]


def traced(expression: Callable[[Any], Any], at: int) -> tuple[Any, frozenset]:
    with recording() as guards:
        value = expression(RankExpr.symbol(at))
    return value, frozenset(guards)


@given(st.integers(0, WORLD - 1), st.sampled_from(range(len(EXPRESSIONS))))
def test_arithmetic_evaluates_to_the_int_result_at_every_rank_its_guards_admit(at: int, which: int) -> None:
    expression = EXPRESSIONS[which]
    value, guards = traced(expression, at)
    for rank in range(WORLD):
        if all(g.holds(rank) for g in guards):
            assert at_rank(value, rank) == expression(rank)
    assert all(g.holds(at) for g in guards)


def test_linear_arithmetic_records_no_guard_and_constant_differences_are_ints() -> None:
    value, guards = traced(lambda r: ((r + 1) * 5 - r * 5, r * 5 + 2), at=3)
    assert value[0] == 5 and type(value[0]) is int
    assert mentions_rank(value) and not guards


COMPARISONS: list[Callable[[Any], bool]] = [
    lambda r: r < 3,
    lambda r: r * 2 >= 6,
    lambda r: r == 5,
    lambda r: r != 0,
    lambda r: 4 <= r // 2,
    lambda r: bool(r % 3),
    lambda r: r in (1, 6, 9),
    lambda r: r in {0, 3},  # a hashed lookup that misses compares nothing: pinned by the hash
    lambda r: {1: 0}.get(r, 7),
]


@given(st.integers(0, WORLD - 1), st.sampled_from(range(len(COMPARISONS))))
def test_a_decision_comes_out_the_same_wherever_its_guards_hold(at: int, which: int) -> None:
    decision = COMPARISONS[which]
    outcome, guards = traced(decision, at)
    assert outcome == decision(at) and guards and all(g.holds(at) for g in guards)
    for rank in range(WORLD):
        if all(g.holds(rank) for g in guards):
            assert decision(rank) == outcome


USES_AS_INT: list[Callable[[Any], Any]] = [
    lambda r: ["a", "b", "c", "d"][r // 4],
    lambda r: len(range(r)),
    lambda r: f"layer{r}",
    lambda r: int(r * 2),
    lambda r: r * (r + 1),  # not linear
]


@pytest.mark.parametrize("use", USES_AS_INT)
def test_a_use_as_a_plain_int_pins_the_value(use: Callable[[Any], Any]) -> None:
    for at in (0, 5):
        result, guards = traced(use, at)
        assert at_rank(result, at) == use(at)
        admitted = [rank for rank in range(WORLD) if all(g.holds(rank) for g in guards)]
        assert at in admitted and all(use(rank) == use(at) for rank in admitted)


def test_a_symbolic_rank_used_outside_its_trace_is_an_error() -> None:
    with recording():
        rank = RankExpr.symbol(2)
    with pytest.raises(RuntimeError, match="outside the trace"):
        bool(rank == 2)


def test_attrs_are_evaluated_through_nested_tuples() -> None:
    with recording():
        rank = RankExpr.symbol(0)
        attrs = (1, (rank * 4, rank * 4 + 4), ("full", rank // 2))
    assert at_rank(attrs, 5) == (1, (20, 24), ("full", 2))
    assert not mentions_rank(at_rank(attrs, 5))


def test_the_line_that_regroups_the_rank_is_kept_through_affine_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """A remainder or quotient of the rank (a neighbour's rank, a group's index) remembers the line
    running when it was taken; an affine expression of the rank remembers none."""
    lines = iter(["first", "second"])
    monkeypatch.setattr("shardproof.ir.rank_expr.current_location", lambda: next(lines))
    with recording():
        rank = RankExpr.symbol(1)
        offset = rank * 4 + 2
        neighbour = (rank + 1) % 4
        regrouped = [neighbour * 8 + offset, 3 - neighbour, neighbour // 2]
    assert offset.origin is None
    assert [r.origin for r in regrouped] == ["first"] * 3
