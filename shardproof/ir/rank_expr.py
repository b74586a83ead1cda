"""The rank as a value: one trace of a rank's program stands for every rank whose guards hold.

A rank program is traced once with `rank` a `RankExpr` rather than an int. Arithmetic on it stays
symbolic: a linear form over the rank and floor quotients and remainders of linear forms by
constants (`rank * 4 + 1`, `rank // 2`), which is all a loader's offsets need. Every decision the
program takes on it is recorded as a `Guard` that holds at the rank traced: a comparison (a dict
lookup's too), a use as a plain int (`range(rank)`, a list index, an f-string: the guard then pins
the value).
Where the guards hold, the program does exactly what it did in the trace, with the symbolic
values (a slice's offsets, a mask's bound) evaluated at that rank; elsewhere it is traced again.

Guards are recorded into the log of the trace in progress (`recording`); a RankExpr used outside
one is an error rather than a silent int.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

# A linear form: (constant, ((atom, coefficient), ...)) with atoms sorted by repr; an atom is
# ("rank",), ("floordiv", form, k) or ("mod", form, k), k > 0.
Form = tuple
_RANK = ("rank",)

_COMPARISONS: dict[str, Callable[[int, int], bool]] = {
    "lt": operator.lt, "le": operator.le, "eq": operator.eq, "ne": operator.ne, "gt": operator.gt, "ge": operator.ge,
}  # fmt: skip


@dataclass(frozen=True)
class Guard:
    """`form <op> 0` evaluated to `outcome` at the rank traced."""

    form: Form
    op: str
    outcome: bool

    def holds(self, rank: int) -> bool:
        return _COMPARISONS[self.op](evaluate_form(self.form, rank), 0) == self.outcome

    def describe(self) -> str:
        return f"{'' if self.outcome else 'not '}{describe_form(self.form)} {self.op} 0"


_log: set[Guard] | None = None

# How `RankExpr <op> other` is computed when `other` is not a number (a tensor): set by the capture
# that knows tensors, called as (the method of `other` that computes it, other, the RankExpr).
tensor_operation: Callable[[str, Any, "RankExpr"], Any] | None = None


# The user's line running now (a Location), set by the capture: where a rank is regrouped (`origin`).
current_location: Callable[[], Any] | None = None


def _foreign(method: str, other: Any, expr: RankExpr) -> Any:
    return NotImplemented if tensor_operation is None else tensor_operation(method, other, expr)


@contextlib.contextmanager
def recording() -> Iterator[set[Guard]]:
    """Collect the guards of one trace."""
    global _log
    outer, _log = _log, set()
    try:
        yield _log
    finally:
        _log = outer


def _guard(form: Form, op: str, outcome: bool) -> bool:
    if _log is None:
        raise RuntimeError("a symbolic rank was used outside the trace it belongs to")
    _log.add(Guard(form, op, outcome))
    return outcome


class RankExpr:
    """An int-valued expression of the rank; `value` is its value at the rank traced."""

    __slots__ = ("form", "value", "origin")

    def __init__(self, form: Form, value: int, origin: Any = None):
        self.form = form
        self.value = value
        # Where the rank was first regrouped: the user's line that took a floor quotient or remainder
        # of it (a neighbour's rank, a group's index). A wrong rank is chosen on such a line, not
        # where the offset it makes is used; None for an affine expression of the rank.
        self.origin = origin

    @staticmethod
    def symbol(at: int) -> RankExpr:
        return RankExpr((0, ((_RANK, 1),)), at)

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        """`int` to `isinstance`, so code that checks for an int takes the path an int takes (C code
        checks the real type, and takes the value through `__index__`: guarded)."""
        return int

    # --- symbolic arithmetic --------------------------------------------------------------
    def __add__(self, other: Any) -> Any:
        if not _number(other):
            return self._concrete() + other if isinstance(other, float) else _foreign("__radd__", other, self)
        return _made(_combined(self.form, _form(other), 1), self.value + _value(other), _origin(self, other))

    def __radd__(self, other: Any) -> Any:
        return self + other if _number(other) or isinstance(other, float) else _foreign("__add__", other, self)

    def __sub__(self, other: Any) -> Any:
        if not _number(other):
            return self._concrete() - other if isinstance(other, float) else _foreign("__rsub__", other, self)
        return _made(_combined(self.form, _form(other), -1), self.value - _value(other), _origin(self, other))

    def __rsub__(self, other: Any) -> Any:
        return (-self) + other if _number(other) or isinstance(other, float) else _foreign("__sub__", other, self)

    def __neg__(self) -> Any:
        return self * -1

    def __pos__(self) -> RankExpr:
        return self

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, RankExpr):  # not linear: pinned
            return self._concrete() * other
        if not _number(other):
            return self._concrete() * other if isinstance(other, float) else _foreign("__rmul__", other, self)
        return _made(_scaled(self.form, other), self.value * other, self.origin)

    def __rmul__(self, other: Any) -> Any:
        return self * other if _number(other) or isinstance(other, float) else _foreign("__mul__", other, self)

    def __floordiv__(self, other: Any) -> Any:
        if type(other) is not int or other <= 0:
            return self._concrete() // other
        const, terms = self.form
        if const % other == 0 and all(c % other == 0 for _, c in terms):
            return _made((const // other, tuple((a, c // other) for a, c in terms)), self.value // other, self.origin)
        return _made((0, ((("floordiv", self.form, other), 1),)), self.value // other, self._regrouped())

    def __mod__(self, other: Any) -> Any:
        if type(other) is not int or other <= 0:
            return self._concrete() % other
        const, terms = self.form
        if all(c % other == 0 for _, c in terms):
            return const % other
        return _made((0, ((("mod", self.form, other), 1),)), self.value % other, self._regrouped())

    def _regrouped(self) -> Any:
        """The origin of a quotient or remainder of this expression: its own, else the line running."""
        if self.origin is None and current_location is not None:
            return current_location()
        return self.origin

    def __rfloordiv__(self, other: Any) -> Any:
        return other // self._concrete()

    def __rmod__(self, other: Any) -> Any:
        return other % self._concrete()

    # --- decisions: recorded as guards -----------------------------------------------------
    def _compare(self, other: Any, op: str) -> Any:
        if isinstance(other, float):
            return _COMPARISONS[op](self._concrete(), other)
        if not _number(other):
            return _foreign(f"__{_MIRRORED[op]}__", other, self)
        difference = self - other
        if not isinstance(difference, RankExpr):
            return _COMPARISONS[op](difference, 0)
        return _guard(difference.form, op, _COMPARISONS[op](difference.value, 0))

    def __lt__(self, other: Any) -> Any:
        return self._compare(other, "lt")

    def __le__(self, other: Any) -> Any:
        return self._compare(other, "le")

    def __gt__(self, other: Any) -> Any:
        return self._compare(other, "gt")

    def __ge__(self, other: Any) -> Any:
        return self._compare(other, "ge")

    def __eq__(self, other: Any) -> Any:  # type: ignore[override]
        return self._compare(other, "eq")

    def __ne__(self, other: Any) -> Any:  # type: ignore[override]
        return self._compare(other, "ne")

    def __bool__(self) -> bool:
        return bool(self != 0)

    def __hash__(self) -> int:
        """By value, pinned: a dict or set lookup that misses compares nothing, so no `==` would
        guard it (`{1: 0}.get(rank, default)` traced at rank 0 would give every rank the default).
        Our own tables key by `form`."""
        return hash(self._concrete())

    def _concrete(self) -> int:
        """The value, used as a plain int: the trace holds only where it is the same."""
        const, terms = self.form
        _guard((const - self.value, terms), "eq", True)
        return self.value

    def __index__(self) -> int:
        return self._concrete()

    __int__ = __index__
    __trunc__ = __index__
    __floor__ = __index__
    __ceil__ = __index__

    def __round__(self, ndigits: int | None = None) -> int:
        return self._concrete()

    def __float__(self) -> float:
        return float(self._concrete())

    def __truediv__(self, other: Any) -> Any:
        return self._concrete() / other

    def __rtruediv__(self, other: Any) -> Any:
        return other / self._concrete()

    def __str__(self) -> str:
        return str(self._concrete())

    def __repr__(self) -> str:
        return repr(self._concrete())

    def __format__(self, spec: str) -> str:
        return format(self._concrete(), spec)

    def describe(self) -> str:
        return describe_form(self.form)


_MIRRORED = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}  # a < b is b > a


def _number(value: Any) -> bool:
    """An int (bool included: python adds them as 0 and 1) or a RankExpr (an int to isinstance)."""
    return isinstance(value, int)


def _form(value: int | RankExpr) -> Form:
    return value.form if isinstance(value, RankExpr) else (value, ())


def _value(value: int | RankExpr) -> int:
    return value.value if isinstance(value, RankExpr) else value


def _combined(a: Form, b: Form, sign: int) -> Form:
    coefficients = dict(a[1])
    for atom, c in b[1]:
        coefficients[atom] = coefficients.get(atom, 0) + sign * c
    return (a[0] + sign * b[0], tuple(sorted(((x, c) for x, c in coefficients.items() if c), key=repr)))


def _scaled(form: Form, k: int) -> Form:
    const, terms = form
    return (const * k, tuple((a, c * k) for a, c in terms if c * k))


def _made(form: Form, value: int, origin: Any) -> int | RankExpr:
    return RankExpr(form, value, origin) if form[1] else form[0]


def _origin(a: RankExpr, b: Any) -> Any:
    return a.origin if a.origin is not None or not isinstance(b, RankExpr) else b.origin


def evaluate_form(form: Form, rank: int) -> int:
    const, terms = form
    return const + sum(c * _atom_value(atom, rank) for atom, c in terms)


def _atom_value(atom: tuple, rank: int) -> int:
    if atom[0] == "rank":
        return rank
    inner = evaluate_form(atom[1], rank)
    return inner // atom[2] if atom[0] == "floordiv" else inner % atom[2]


def describe_form(form: Form) -> str:
    const, terms = form
    parts = [f"{c}*{_describe_atom(a)}" if c != 1 else _describe_atom(a) for a, c in terms]
    return " + ".join(parts + ([str(const)] if const or not parts else []))


def _describe_atom(atom: tuple) -> str:
    if atom[0] == "rank":
        return "rank"
    return f"({describe_form(atom[1])} {'//' if atom[0] == 'floordiv' else '%'} {atom[2]})"


def at_rank(value: Any, rank: int) -> Any:
    """`value` (an op's attrs: nested tuples and lists) with every RankExpr evaluated at `rank`."""
    if isinstance(value, RankExpr):
        return evaluate_form(value.form, rank)
    if isinstance(value, (tuple, list)):
        return type(value)(at_rank(v, rank) for v in value)
    return value


def frozen(value: Any) -> Any:
    """`value` (an op's attrs) as a key: each RankExpr as its form (comparing RankExprs guards)."""
    if isinstance(value, RankExpr):
        return ("rank", value.form)
    if isinstance(value, (tuple, list)):
        return tuple(frozen(v) for v in value)
    return value


def mentions_rank(value: Any) -> bool:
    if isinstance(value, RankExpr):
        return True
    return isinstance(value, (tuple, list)) and any(mentions_rank(v) for v in value)


def rank_origins(value: Any) -> Iterator[Any]:
    """The origin of every RankExpr in `value` (an op's attrs: nested tuples and lists)."""
    if isinstance(value, RankExpr):
        yield value.origin
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from rank_origins(v)
