"""Hash-consed terms over the reference's leaves.

Every tensor of the reference and of every rank is described by a term over the same leaves (the
reference state and inputs). Terms are built only through the normalizing constructors in
`rules/`, so two programs that compute the same value the same way up to the rewrite rules
get the very same term id: equality of values is checked by comparing integers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Term:
    op: str
    args: tuple[int, ...]
    attrs: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: str


class Universe:
    """The store: term id -> Term, and Term -> id for sharing."""

    def __init__(self) -> None:
        self.terms: list[Term] = []
        self._ids: dict[Term, int] = {}

    def intern(self, op: str, args: tuple[int, ...], attrs: tuple[Any, ...], shape: tuple[int, ...], dtype: str) -> int:
        term = Term(op, tuple(args), tuple(attrs), tuple(shape), dtype)
        found = self._ids.get(term)
        if found is None:
            found = len(self.terms)
            self.terms.append(term)
            self._ids[term] = found
        return found

    def __getitem__(self, term_id: int) -> Term:
        return self.terms[term_id]

    def __len__(self) -> int:
        return len(self.terms)

    def reachable(self, root: int) -> set[int]:
        """`root` and every term it is built of."""
        seen, stack = set(), [root]
        while stack:
            t = stack.pop()
            if t not in seen:
                seen.add(t)
                stack.extend(self.terms[t].args)
        return seen
