"""Where a rank went missing: the line that gives a name holding a rank a value that is no rank.

A rank's offsets (a slice's bounds, a mask's, a peer's rank) are computed by Python from the rank;
a fault in them shows where the offset is used, but is fixed where the rank was lost: a call
passing `0` for a `rank` parameter, `self.rank = 0`, `tp_rank = 0 % tp`. The symbolic rank
remembers the lines that regroup it (`RankExpr.origin`), but a constant leaves no trace in it, so
this reads the source (`ast`, the op's file): from the names the op's line uses back through their
assignments in the function, `self.x` through its assignments in the class, parameters through
the calls that pass them, and into the calls of this file whose results they are (a helper called
with `0` for its `rank`), to the nearest binding of a rank's name (`rank`, `tp_rank`; not
`per_rank`, a count; not `root_rank`) to a number (`0`, `0 % tp`: see `constant_for_rank`).
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Union

_RANK_NAME = re.compile(r"(^|_)rank$")
# a count of ranks (`per_rank`), or a rank that is a constant by design (a root's, a source's)
_NOT_OWN = re.compile(r"(^|_)(per|num|n|src|dst|root)_rank$")
_LIMIT = 400  # names followed at most: a line's values reach back through a whole model otherwise

Scope = Union[ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda]
Slot = tuple  # ("var", scope, name) or ("attr", class, name)


@dataclass(frozen=True)
class RankLost:
    """The line where `name`, which holds a rank, is given `value`, which is none."""

    line: int
    code: str
    name: str
    value: str


def rank_lost(file: str, line: int) -> RankLost | None:
    """The nearest binding, among those the values of `line` come from, of a rank's name to a value
    that holds no rank; None when there is none or the file cannot be read."""
    try:
        status = os.stat(file)
        stamp = (status.st_mtime_ns, status.st_size)  # a file edited under `shardproof serve` is read again
    except OSError:
        return None
    return _lost(file, stamp, line)


@functools.lru_cache(maxsize=1024)
def _lost(file: str, stamp: tuple[int, int], line: int) -> RankLost | None:
    source = _parsed(file, stamp)
    return None if source is None else source.lost(line)


@functools.lru_cache(maxsize=32)
def _parsed(file: str, stamp: tuple[int, int]) -> _Source | None:
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
        return _Source(text, ast.parse(text))
    except (OSError, SyntaxError, ValueError):
        return None


def holds_rank(name: str) -> bool:
    return bool(_RANK_NAME.search(name)) and not _NOT_OWN.search(name)


def constant_for_rank(value: ast.AST) -> bool:
    """Whether an expression puts a number where the rank goes: an int literal, or arithmetic whose
    first operand is one (`0 % tp`, `(0 + 1) * rows`). A name (`r`, `peer`), a call
    (`get_rank()`), a field or an element (`runs[0].stage`) may be a rank; a tuple a loop runs
    over (`for rank in (0, 1)`) is every rank in turn."""
    if isinstance(value, ast.Constant):
        return type(value.value) is int
    if isinstance(value, ast.UnaryOp):
        return constant_for_rank(value.operand)
    return isinstance(value, ast.BinOp) and constant_for_rank(value.left)


class _Source:
    def __init__(self, text: str, tree: ast.Module):
        self.text, self.tree = text, tree
        self.lines = text.splitlines()
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        self.functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    # --- the search ---------------------------------------------------------------------------
    def lost(self, line: int) -> RankLost | None:
        read = [n for n in ast.walk(self.tree) if isinstance(n, (ast.Name, ast.Attribute)) and n.lineno == line
                and isinstance(n.ctx, ast.Load)]
        slots: deque[Slot] = deque(dict.fromkeys(s for s in map(self._slots_used, read) if s is not None))
        seen: set[Slot] = set(slots)
        while slots and len(seen) < _LIMIT:
            slot = slots.popleft()
            for at, value, scope in self._bindings(slot):
                if holds_rank(slot[2]) and constant_for_rank(value):
                    return self._lost_at(at, slot[2], value)
                lost = self._given_no_rank(value)
                if lost is not None:
                    return lost
                for node in ast.walk(value):
                    used = self._slots_used(node, scope) if isinstance(node, (ast.Name, ast.Attribute)) else None
                    if used is not None and used not in seen:
                        seen.add(used)
                        slots.append(used)
        return None

    def _slots_used(self, node: ast.AST, scope: Scope | None = None) -> Slot | None:
        """The slot a loaded name (`x`) or attribute of the method's instance (`self.x`) reads."""
        scope = scope or self._scope(node)
        if isinstance(node, ast.Name) and node.id != _self_name(scope):
            return ("var", scope, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == _self_name(scope):
            owner = self._class(scope)
            return ("attr", owner, node.attr) if owner is not None else None
        return None

    def _bindings(self, slot: Slot) -> Iterator[tuple[int, ast.expr, Scope]]:
        """(line, value, the scope the value's names are read in) of every binding of `slot`."""
        kind, where, name = slot
        if kind == "attr":
            for method in where.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and _self_name(method):
                    for target, value in _assignments(method):
                        if isinstance(target, ast.Attribute) and target.attr == name and isinstance(target.value, ast.Name) \
                                and target.value.id == _self_name(method):
                            yield target.lineno, value, method
            return
        scope: Scope | None = where
        while scope is not None:
            if name in _parameters(scope):
                yield from self._arguments(scope, name)
                return
            found = [(t.lineno, v, scope) for t, v in _assignments(scope) if isinstance(t, ast.Name) and t.id == name]
            if found:
                yield from found
                return
            scope = None if isinstance(scope, ast.Module) else self._scope(scope)

    def _arguments(self, function: Scope, name: str) -> Iterator[tuple[int, ast.expr, Scope]]:
        """What the calls of `function` pass for its parameter `name`."""
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        for call in self.calls:
            value = self._passed(call, function).get(name) if self._calls(call, function) else None
            if value is not None:
                yield value.lineno, value, self._scope(call)

    def _passed(self, call: ast.Call, function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, ast.expr]:
        """The argument a call of `function` passes for each of its parameters (up to a `*args`)."""
        params = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
        if _self_name(function) and self._class(function) is not None:
            params = params[1:]
        if isinstance(call.func, ast.Attribute) and call.func.attr == "apply":
            params = params[1:]  # an autograd Function's forward: ctx first
        starred = next((i for i, a in enumerate(call.args) if isinstance(a, ast.Starred)), len(call.args))
        passed = dict(zip(params, call.args[:starred]))
        passed.update((k.arg, k.value) for k in call.keywords if k.arg is not None)
        return passed

    def _given_no_rank(self, value: ast.expr) -> RankLost | None:
        """A call in `value`, of a function of this file, passing what holds no rank for a parameter named as a rank."""
        for call in (n for n in ast.walk(value) if isinstance(n, ast.Call)):
            for function in self.functions:
                if self._calls(call, function):
                    for name, argument in self._passed(call, function).items():
                        if holds_rank(name) and constant_for_rank(argument):
                            return self._lost_at(argument.lineno, name, argument)
        return None

    def _lost_at(self, line: int, name: str, value: ast.expr) -> RankLost:
        return RankLost(line, self.lines[line - 1].strip(), name, ast.get_source_segment(self.text, value) or "")

    def _calls(self, call: ast.Call, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether `call` may call `function` (by its name; a class's by the class's, an autograd
        Function's forward by `apply`)."""
        func, owner = call.func, self._class(function)
        if owner is None:
            return isinstance(func, ast.Name) and func.id == function.name
        if function.name == "__init__":
            return isinstance(func, ast.Name) and func.id == owner.name
        if function.name == "forward" and isinstance(func, ast.Attribute) and func.attr == "apply":
            return isinstance(func.value, ast.Name) and func.value.id == owner.name
        return isinstance(func, ast.Attribute) and func.attr == function.name

    # --- scopes -----------------------------------------------------------------------------------
    def _scope(self, node: ast.AST) -> Scope:
        """The innermost function (or lambda, or the module) a node is in."""
        at = self.parent.get(node)
        while at is not None and not isinstance(at, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            at = self.parent.get(at)
        return at if at is not None else self.tree

    def _class(self, function: Scope) -> ast.ClassDef | None:
        owner = self.parent.get(function)
        return owner if isinstance(owner, ast.ClassDef) else None


def _self_name(scope: Scope) -> str:
    """The instance parameter of a method (`self`); '' elsewhere and for static methods."""
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or not scope.args.args:
        return ""
    if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in scope.decorator_list):
        return ""
    return scope.args.args[0].arg


def _parameters(scope: Scope) -> set[str]:
    if isinstance(scope, ast.Module):
        return set()
    args = scope.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {_self_name(scope)}


def _assignments(scope: Scope) -> Iterator[tuple[ast.expr, ast.expr]]:
    """(target, value) of every binding made in `scope` itself (not in functions nested in it; in
    its comprehensions, whose names Python keeps apart, but a name bound there is bound there)."""
    for node in _own_nodes(scope):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                yield from _paired(target, node.value)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
            yield from _paired(node.target, node.value)
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            yield from _paired(node.target, node.iter)
        elif isinstance(node, ast.withitem) and node.optional_vars is not None:
            yield from _paired(node.optional_vars, node.context_expr)
        elif isinstance(node, ast.NamedExpr):
            yield node.target, node.value


def _paired(target: ast.expr, value: ast.expr) -> Iterator[tuple[ast.expr, ast.expr]]:
    """Each name or attribute a target binds, with the part of `value` it gets (element by element
    when both are tuples of one length, else the whole)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        parts = value.elts if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts) \
            and not any(isinstance(e, ast.Starred) for e in (*value.elts, *target.elts)) else None
        for index, element in enumerate(target.elts):
            yield from _paired(element.value if isinstance(element, ast.Starred) else element,
                               parts[index] if parts else value)
    elif isinstance(target, (ast.Name, ast.Attribute)):
        yield target, value


def _own_nodes(scope: Scope) -> Iterator[ast.AST]:
    body = scope.body if isinstance(scope.body, list) else [scope.body]
    todo = list(body)
    while todo:
        node = todo.pop()
        yield node
        todo += [c for c in ast.iter_child_nodes(node)
                 if not isinstance(c, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef))]
