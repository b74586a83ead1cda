"""Which ranks run a line: the comparison that gave a rank its role (`self.is_last = rank == world_size - 1`).

A pipeline's sends and recvs go to a neighbour (`rank + 1`) under a test of the stage's role
(`if not self.is_first:`). When they do not pair up, the neighbour's arithmetic is seldom the fault:
the role is, decided on the line that compared the rank (every rank thinking itself the first, say),
and a module built for a role (`Stack(head=rank == world_size - 1)`) sends a value of another shape.
This reads the source (`ast`, as rank_flow does): from the tests enclosing a line (an `if` around
it, a conditional expression on it) back through the names they read (assignments, `self.x`, the
calls passing parameters: rank_flow's walk) to the nearest binding of a comparison.
"""

from __future__ import annotations

import ast

from shardproof.ir.graph import Graph, Node
from shardproof.report.model import Site
from shardproof.report.rank_flow import RankChoice, _Source, is_rank_name, source_of

ROLE = "a comparison deciding which ranks run it"
_LIMIT = 200  # names followed at most


def role_choice(file: str, line: int, entries: frozenset[tuple[str, int]] = frozenset(),
                values: bool = False) -> RankChoice | None:
    """The line deciding whether `line` runs on a rank (with `values`, also which value it computes:
    the conditional expressions on it): a test it runs under comparing the rank itself, else the
    nearest binding of a comparison the tests' names come from; None when there is none or the
    file cannot be read. `entries` as for rank_flow.rank_choice."""
    source = source_of(file)
    if source is None:
        return None
    scopes = {source: source.reached(frozenset(first for where, first in entries if where == file))}
    conditionals = [n.test for n in ast.walk(source.tree) if isinstance(n, ast.IfExp) and n.lineno == line] if values else []
    for test in [*conditionals, *source._guards(line)]:
        if _compares_rank(test):
            return source._choice_at(test.lineno, "", test, ROLE)
        found = _compared_binding(source, test, scopes)
        if found is not None:
            return found
    return None


def neighbour_peer(file: str, line: int) -> bool:
    """Whether a call on `line` is passed a rank's neighbour: a rank's name plus or minus one."""
    source = source_of(file)
    if source is None:
        return False
    calls = [n for n in ast.walk(source.tree) if isinstance(n, ast.Call) and n.lineno <= line <= (n.end_lineno or n.lineno)]
    return any(_adjacent(a) for call in calls for a in [*call.args, *(k.value for k in call.keywords)])


def _adjacent(value: ast.expr) -> bool:
    if not isinstance(value, ast.BinOp) or not isinstance(value.op, (ast.Add, ast.Sub)):
        return False
    named = [s for s in (value.left, value.right) if is_rank_name(s)]
    number = [s for s in (value.left, value.right) if isinstance(s, ast.Constant) and s.value == 1 and type(s.value) is int]
    return len(named) == 1 and len(number) == 1


def _compares_rank(test: ast.expr) -> bool:
    """A test comparing a rank's name (`rank == 0`), or numbers only (the rank replaced by one)."""
    compares = [n for n in ast.walk(test) if isinstance(n, ast.Compare)]
    names = [n for c in compares for n in ast.walk(c) if isinstance(n, (ast.Name, ast.Attribute))]
    return bool(compares) and (not names or any(is_rank_name(n) for n in names))


def _comparison(value: ast.expr) -> bool:
    """A value that is a comparison (negated, or combined with `and`/`or`): a flag of the rank's role."""
    if isinstance(value, ast.UnaryOp) and isinstance(value.op, ast.Not):
        return _comparison(value.operand)
    if isinstance(value, ast.BoolOp):
        return any(_comparison(v) for v in value.values)
    return isinstance(value, ast.Compare)


def _compared_binding(source: _Source, test: ast.expr, scopes: dict) -> RankChoice | None:
    """The nearest binding of a comparison among those the names `test` reads come from."""
    todo = list(dict.fromkeys(source._slots_read(test, source._scope(test))))
    seen = set(todo)
    while todo and len(seen) < _LIMIT:
        slot = todo.pop(0)
        for where, at, value, scope in slot[0]._bindings(slot, scopes):
            if _comparison(value):
                return where._choice_at(at, slot[3], value, ROLE)
            for used in where._slots_read(value, scope):
                if used not in seen:
                    seen.add(used)
                    todo.append(used)
    return None


def role_first(sites: list[Site], messages: list[tuple[int, Node]], graphs: list[Graph],
               entries: frozenset[tuple[str, int]] = frozenset()) -> list[Site]:
    """An unmatched message's sites, after the line that decided the role of a rank sending to or
    receiving from its neighbour: what made it run the send or recv (`messages`: the finding's, the
    op to change first), or, for a recv whose sender sends another shape, the value sent."""
    rank, node = next(((r, n) for r, n in messages if n.loc is not None), (None, None))
    if node is None or not neighbour_peer(node.loc.file, node.loc.line):
        return sites
    loc, values = node.loc, False
    sent = [(r, n) for r, n in messages if n.op == "send" and n.shape != node.shape]
    if sent:
        rank, node = sent[0]
        loc, values = next(g for g in graphs if g.rank == rank)[node.inputs[0]].loc, True
    choice = None if loc is None else role_choice(loc.file, loc.line, entries, values)
    if choice is None:
        return sites
    named = Site(choice.file, choice.line, choice.code, f"`{choice.name or choice.value}`, {choice.what}: {node.op}",
                 rank, node.name)
    return [named, *(s for s in sites if s != named)]
