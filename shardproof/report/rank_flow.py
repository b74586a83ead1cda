"""Where a rank is chosen: the line that gives a name holding a rank a number, or the rank regrouped.

A rank's offsets (a slice's bounds, a mask's, a peer's rank) are computed by Python from the rank;
a fault in them shows where the offset is used, but is fixed where the rank was chosen: a call
passing `0` for a `rank` parameter, `self.rank = 0`, `tp_rank = 0 % tp`, a neighbour's rank
`(rank + 1) % world_size` passed as the own one. The symbolic rank remembers the lines that regroup
it (`RankExpr.origin`), but a constant leaves no trace in it, nor does a rank pinned to an int
(`range(rank * n, ...)`, a list index), so this reads the source (`ast`): from the names the op's
line uses back through their assignments in the function, `self.x` through its assignments in the
class, parameters through the calls that pass them (in the op's file, and in the files the
distributed side starts in: a library's class constructed by the case), and into the calls of the
file whose results they are (a helper called with `0` for its `rank`; the `return`s of a helper or
method), to the nearest binding of a rank's name (`rank`, `tp_rank`; not `per_rank`, a count; not
`root_rank`) to a number (`0`, `0 % tp`: see `constant_for_rank`) or a remainder or quotient of a
rank; or of any name to an offset computed with a number or a neighbour's rank where the rank goes
(`range(0 * n, (rank + 1) * n)`, `0 % ep * local`, `((rank + 1) % world_size) * rows`: see
`_stand_in`). The op's own line is read first (a number there), then the conditions it runs under;
`chosen_on` tells the driver whether a line picks a rank itself, `cut_lines` which lines cut the
state and inputs the op's values come from (the driver reads them too).
"""

from __future__ import annotations

import ast
import functools
import os
import re
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Iterator, Union

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS

_RANK_NAME = re.compile(r"(^|_)rank$")
# a count of ranks (`per_rank`, Megatron's `num_layers_per_pipeline_rank`), a rank that is a constant
# by design (a root's, a source's), or a matrix's rank (`kv_lora_rank`: a low-rank projection's width)
_NOT_OWN = re.compile(r"(^|_)(per|num|n|src|dst|root|lora|low)_(\w+_)?rank$")
NUMBER, REGROUPED = "a number, not the rank", "a remainder or quotient of the rank"
_LIMIT = 400  # names followed at most: a line's values reach back through a whole model otherwise

Scope = Union[ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda]
Slot = tuple  # (source, "var", scope, name), (source, "attr", class, name) or (source, "return", function, "name()")
Scopes = dict  # _Source -> the scopes whose calls pass parameters (None: all of the file's)


@dataclass(frozen=True)
class RankChoice:
    """The line where `name`, which holds a rank, is given `value`: `what` it is (no rank, the rank regrouped)."""

    file: str
    line: int
    code: str
    name: str
    value: str
    what: str


def rank_choice(file: str, line: int, entries: frozenset[tuple[str, int]] = frozenset()) -> RankChoice | None:
    """The nearest binding, among those the values of `line` come from, of a rank's name to a number
    or a regrouped rank; None when there is none or the file cannot be read. `entries`: where the
    distributed side's own functions start (file, first line): of the calls passing a parameter,
    only those they make count in their file (not the reference's `Model(rank=0, world_size=1)`),
    and those they make in theirs, when it is another (a class of a library module constructed with
    `0` for its rank by the case)."""
    stamps = {where: _stamp(where) for where in {file, *(where for where, _ in entries)}}
    if stamps[file] is None:
        return None
    return _choice(file, line, tuple(sorted(stamps.items())), entries)


def _stamp(file: str) -> tuple[int, int] | None:
    """When a file was last changed: one edited under `shardproof serve` is read again."""
    try:
        status = os.stat(file)
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size


def chosen_on(file: str, line: int) -> RankChoice | None:
    """A rank chosen on `line` itself, in its arithmetic: a number or a neighbour's rank where a rank
    goes (`0 * rows`, `chunk(tp)[(tp_rank + 1) % world_size]`, see `_stand_in`)."""
    source = source_of(file)
    return None if source is None else source.on_line(line)


def returned_at(file: str, first_line: int) -> tuple[int, str] | None:
    """The line (and its code) of the last value the function starting at `first_line` returns (a
    lambda's body); None when the file cannot be read or no such function returns a value."""
    source = source_of(file)
    functions = [] if source is None else [n for n in ast.walk(source.tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and _first_line(n) == first_line]
    if not functions:
        return None
    function = functions[0]
    values = [function.body] if isinstance(function, ast.Lambda) else \
        [n for n in _own_nodes(function) if isinstance(n, ast.Return) and n.value is not None]
    line = max((n.lineno for n in values), default=None)
    return None if line is None else (line, source.lines[line - 1].strip())


def cut_lines(graph: Graph, nodes: Iterable[Node]) -> list[tuple[str, int]]:
    """(file, line) of the ops that `nodes` read that only cut and move the graph's leaves (layout
    ops on leaves or on such ops): the rank's state and inputs as cut from the reference's
    (shard_state's and shard_input's slices), and the program's moves of them before it computes
    with them; nearest first. A number put there for the rank (`first = 0 % ep * local` in
    shard_state) cuts values the program's own offsets, chosen right, do not match: the fault shows
    where the offsets are used, but the values read there come from these lines. Nodes of another
    graph (a repeated module's body) read none of this one's."""
    nodes = [n for n in nodes if n.id < len(graph.nodes) and graph[n.id] is n]
    cut: set[int] = set()
    for node in graph.nodes:
        if OPS[node.op].kind == "layout" and all(graph[i].op == "leaf" or i in cut for i in node.inputs):
            cut.add(node.id)
    lines: dict[tuple[str, int], None] = {}
    todo, seen = deque(n.id for n in nodes), {n.id for n in nodes}
    while todo:
        node = graph[todo.popleft()]
        if node.id in cut and node.loc is not None:
            lines.setdefault((node.loc.file, node.loc.line))
        fresh = [i for i in node.inputs if i not in seen]
        seen.update(fresh)
        todo.extend(fresh)
    return list(lines)


def source_of(file: str) -> _Source | None:
    """`file` parsed as it is now (None if it cannot be read or parsed)."""
    stamp = _stamp(file)
    return None if stamp is None else _parsed(file, stamp)


@functools.lru_cache(maxsize=1024)
def _choice(file: str, line: int, stamps: tuple[tuple[str, tuple[int, int] | None], ...],
            entries: frozenset[tuple[str, int]]) -> RankChoice | None:
    sources = {where: _parsed(where, stamp) for where, stamp in stamps if stamp is not None}
    source = sources.get(file)
    if source is None:
        return None
    scopes: Scopes = {source: source.reached(frozenset(first for where, first in entries if where == file))}
    for where, other in sources.items():
        if other is not None and other is not source:
            scopes[other] = other.reached(frozenset(first for at, first in entries if at == where)) or set()
    return source.choice(line, scopes)


@functools.lru_cache(maxsize=32)
def _parsed(file: str, stamp: tuple[int, int]) -> _Source | None:
    try:
        with open(file, encoding="utf-8") as handle:
            text = handle.read()
        return _Source(file, text, ast.parse(text))
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


def regroups_rank(value: ast.AST) -> bool:
    """Whether an expression takes a remainder or quotient of a rank (`(rank + 1) % world_size`, a
    neighbour's; `rank // tp`, a group's), as `RankExpr.origin` marks one."""
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, (ast.Mod, ast.FloorDiv)) and _names_rank(n.left)
               for n in ast.walk(value))


def _leaves(branch: ast.If) -> bool:
    """An `if` whose body leaves the block it is in (`continue`, `break`, `return`, `raise`)."""
    return bool(branch.body) and isinstance(branch.body[-1], (ast.Continue, ast.Break, ast.Return, ast.Raise))


def _zero(value: ast.AST) -> bool:
    return isinstance(value, ast.Constant) and type(value.value) is int and value.value == 0


def _neighbour(value: ast.AST) -> bool:
    """`(rank + 1) % world_size`, `(rank - 1) % n`: a rank a constant step away, wrapped around."""
    return isinstance(value, ast.BinOp) and isinstance(value.op, ast.Mod) and isinstance(value.left, ast.BinOp) \
        and isinstance(value.left.op, (ast.Add, ast.Sub)) and _names_rank(value.left.left) \
        and isinstance(value.left.right, ast.Constant)


def _names_rank(value: ast.AST) -> bool:
    return any(is_rank_name(n) for n in ast.walk(value))


def is_rank_name(node: ast.AST) -> bool:
    """A name or attribute that holds a rank (`rank`, `self.tp_rank`)."""
    return (isinstance(node, ast.Name) and holds_rank(node.id)
            or isinstance(node, ast.Attribute) and holds_rank(node.attr))


def _chosen(name: str, value: ast.AST) -> str | None:
    """What a rank's name is given, when it is a choice to report: no rank, or the rank regrouped."""
    if not holds_rank(name):
        return None
    if constant_for_rank(value):
        return NUMBER
    return REGROUPED if regroups_rank(value) else None


class _Source:
    def __init__(self, file: str, text: str, tree: ast.Module):
        self.file, self.text, self.tree = file, text, tree
        self.lines = text.splitlines()
        self.parent: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parent[child] = node
        self.calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        self.functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]

    # --- the search ---------------------------------------------------------------------------
    def choice(self, line: int, scopes: Scopes) -> RankChoice | None:
        """See `rank_choice`; `scopes`: the files whose calls count, with the scopes in each."""
        read = [n for n in ast.walk(self.tree) if isinstance(n, (ast.Name, ast.Attribute)) and n.lineno == line
                and isinstance(n.ctx, ast.Load)]
        slots: deque[Slot] = deque(dict.fromkeys(s for s in map(self._slots_used, read) if s is not None))
        seen: set[Slot] = set(slots)
        here = self.on_line(line)  # a neighbour picked here is no choice of a later site's: ring code picks them
        if here is not None and here.what == NUMBER:
            return here
        guarded = (self._rank_passed(test) or self._stand_in("", test) for test in self._guards(line))
        regrouped = next(filter(None, guarded), None)  # the nearest; a number further back is likelier
        if regrouped is not None and regrouped.what == NUMBER:
            return regrouped
        while slots and len(seen) < _LIMIT:
            slot = slots.popleft()
            name = slot[3]
            for source, at, value, scope in slot[0]._bindings(slot, scopes):
                what = _chosen(name, value)
                found = source._choice_at(at, name, value, what) if what is not None else \
                    source._rank_passed(value) or source._stand_in(name, value)
                if found is not None and found.what == NUMBER:
                    return found
                regrouped = regrouped or found
                for used in source._slots_read(value, scope):
                    if used not in seen:
                        seen.add(used)
                        slots.append(used)
        return regrouped

    def _slots_read(self, value: ast.expr, scope: Scope) -> Iterator[Slot]:
        """The slots an expression reads: its names, `self.x`, and what the functions of this file
        it calls return (`q_heads, kv_heads = local_heads(...)`, `q, k, v = self.split_qkv(qkv)`)."""
        for node in ast.walk(value):
            if isinstance(node, (ast.Name, ast.Attribute)):
                used = self._slots_used(node, scope)
                if used is not None:
                    yield used
            elif isinstance(node, ast.Call):
                yield from ((self, "return", f, f"{f.name}()") for f in self.functions if self._calls(node, f))

    def on_line(self, line: int) -> RankChoice | None:
        """See `chosen_on`: the outermost expressions of `line`'s statements, searched as `_stand_in` does."""
        roots = [n for n in ast.walk(self.tree) if isinstance(n, ast.expr) and n.lineno == line
                 and not (isinstance(self.parent.get(n), ast.expr) and self.parent[n].lineno == line)]
        for root in roots:
            if any(_neighbour(node) for node in ast.walk(root)):
                return self._choice_at(line, "", root, REGROUPED)
            found = self._stand_in("", root)
            if found is not None:
                return found
        return None

    def _guards(self, line: int) -> Iterator[ast.expr]:
        """The conditions `line` runs under, innermost first: the tests of the `if`s and `while`s it
        is in, and of the `if`s before it in those blocks that leave them (`if not visible(source,
        rank): continue`: a ring step that skips the block another rank's keys are in)."""
        statement = next((n for n in ast.walk(self.tree) if isinstance(n, ast.stmt) and n.lineno == line), None)
        at, parent = statement, self.parent.get(statement)
        while at is not None and parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for block in (getattr(parent, field, None) for field in ("body", "orelse", "finalbody")):
                if isinstance(block, list) and at in block:
                    yield from (s.test for s in reversed(block[: block.index(at)]) if isinstance(s, ast.If) and _leaves(s))
            if isinstance(parent, (ast.If, ast.While)):
                yield parent.test
            at, parent = parent, self.parent.get(parent)

    def _stand_in(self, name: str, value: ast.expr) -> RankChoice | None:
        """Where a rank is used in arithmetic (an offset, a range's bounds: `rank * rows`), a number
        in its place (`0 * rows`, `(0 + 1) * rows`, or regrouped: `0 % ep * local`; arithmetic on the
        number 0, which nobody writes for its own sake) or a neighbour's rank (`((rank + 1) %
        world_size) * rows`, unnamed)."""
        for node in ast.walk(value):
            if isinstance(node, ast.BinOp):
                regrouping = isinstance(node.op, (ast.Mod, ast.FloorDiv))
                for side in (node.left,) if regrouping else (node.left, node.right):
                    if _zero(side) or not regrouping and _neighbour(side):
                        return self._choice_at(node.lineno, name, value, NUMBER if _zero(side) else REGROUPED)
        return None

    def _slots_used(self, node: ast.AST, scope: Scope | None = None) -> Slot | None:
        """The slot a loaded name (`x`) or attribute of the method's instance (`self.x`) reads."""
        scope = scope or self._scope(node)
        if isinstance(node, ast.Name) and node.id != _self_name(scope):
            return (self, "var", scope, node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == _self_name(scope):
            owner = self._class(scope)
            return (self, "attr", owner, node.attr) if owner is not None else None
        return None

    def _bindings(self, slot: Slot, scopes: Scopes) -> Iterator[tuple[_Source, int, ast.expr, Scope]]:
        """(the file, line, value, the scope the value's names are read in) of every binding of `slot`."""
        _, kind, where, name = slot
        if kind == "return":
            for node in _own_nodes(where):
                if isinstance(node, ast.Return) and node.value is not None:
                    yield self, node.lineno, node.value, where
            return
        if kind == "attr":
            for method in where.body:
                if isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) and _self_name(method):
                    for target, value in assignments(method):
                        if isinstance(target, ast.Attribute) and target.attr == name and isinstance(target.value, ast.Name) \
                                and target.value.id == _self_name(method):
                            yield self, target.lineno, value, method
            return
        scope: Scope | None = where
        while scope is not None:
            if name in _parameters(scope):
                yield from self._arguments(scope, name, scopes)
                return
            found = [(self, t.lineno, v, scope) for t, v in assignments(scope) if isinstance(t, ast.Name) and t.id == name]
            if found:
                yield from found
                return
            scope = None if isinstance(scope, ast.Module) else self._scope(scope)

    def _arguments(self, function: Scope, name: str, scopes: Scopes) -> Iterator[tuple[_Source, int, ast.expr, Scope]]:
        """What the calls of `function` pass for its parameter `name`: those of this file, and of
        the other files the distributed side starts in (those in their `scopes`)."""
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        for source, reached in scopes.items():
            for call in source.calls:
                if reached is not None and source._scope(call) not in reached:
                    continue
                value = self._passed(call, function).get(name) if self._calls(call, function) else None
                if value is not None:
                    yield source, value.lineno, value, source._scope(call)

    def _passed(self, call: ast.Call, function: ast.FunctionDef | ast.AsyncFunctionDef) -> dict[str, ast.expr]:
        """The argument a call of `function` passes for each of its parameters (from a `*args` on,
        the sequence starred: `causal_attention(*(split_heads(t) for t in (q, k, v)))`)."""
        params = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
        if _self_name(function) and self._class(function) is not None:
            params = params[1:]
        if isinstance(call.func, ast.Attribute) and call.func.attr == "apply":
            params = params[1:]  # an autograd Function's forward: ctx first
        starred = next((i for i, a in enumerate(call.args) if isinstance(a, ast.Starred)), len(call.args))
        passed = dict(zip(params, call.args[:starred]))
        if starred < len(call.args):
            passed.update((name, call.args[starred].value) for name in params[starred:])
        passed.update((k.arg, k.value) for k in call.keywords if k.arg is not None)
        return passed

    def _rank_passed(self, value: ast.expr) -> RankChoice | None:
        """A call in `value`, of a function of this file, passing a number or a regrouped rank for a
        parameter named as a rank."""
        for call in (n for n in ast.walk(value) if isinstance(n, ast.Call)):
            for function in self.functions:
                if self._calls(call, function):
                    for name, argument in self._passed(call, function).items():
                        what = _chosen(name, argument)
                        if what is not None:
                            return self._choice_at(argument.lineno, name, argument, what)
        return None

    def _choice_at(self, line: int, name: str, value: ast.expr, what: str) -> RankChoice:
        code = self.lines[line - 1].strip()
        return RankChoice(self.file, line, code, name, ast.get_source_segment(self.text, value) or "", what)

    def _calls(self, call: ast.Call, function: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether `call` may call `function` (by its name; a class's by the class's, an autograd
        Function's forward by `apply`)."""
        func, owner = call.func, self._class(function)
        if owner is None:
            return isinstance(func, ast.Name) and func.id == function.name
        if function.name == "__init__":  # `Shard(...)`, or `layers.Shard(...)` from another file
            return isinstance(func, ast.Name) and func.id == owner.name or isinstance(func, ast.Attribute) and func.attr == owner.name
        if function.name == "forward" and isinstance(func, ast.Attribute) and func.attr == "apply":
            return isinstance(func.value, ast.Name) and func.value.id == owner.name
        return isinstance(func, ast.Attribute) and func.attr == function.name

    def reached(self, entries: frozenset[int]) -> set[ast.AST] | None:
        """The scopes the functions starting at `entries` run, by the calls of this file they make
        (a class constructed: all its methods, `forward` through `__call__`); None without entries here."""
        todo: list[ast.AST] = [n for n in ast.walk(self.tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                               and _first_line(n) in entries]
        if not todo:
            return None
        reached: set[ast.AST] = set()
        while todo:
            scope = todo.pop()
            if scope in reached:
                continue
            inner = [n for n in ast.walk(scope) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
            reached.update(inner)
            for call in (n for n in ast.walk(scope) if isinstance(n, ast.Call)):
                for function in self.functions:
                    if function not in reached and self._calls(call, function):
                        owner = self._class(function)
                        todo += [function] if owner is None else \
                            [m for m in owner.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        return reached

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


def _first_line(function: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    """The line Python's code object starts at (`co_firstlineno`): a decorated function's first decorator."""
    return min([function.lineno, *(d.lineno for d in getattr(function, "decorator_list", []))])


def _parameters(scope: Scope) -> set[str]:
    if isinstance(scope, ast.Module):
        return set()
    args = scope.args
    return {a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]} - {_self_name(scope)}


def assignments(scope: Scope) -> Iterator[tuple[ast.expr, ast.expr]]:
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
