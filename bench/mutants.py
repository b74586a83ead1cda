"""Mutants of a case file: one small change each, only in code the distributed side runs.

A mutant is a splice of the original text (one node's source range replaced), padded so every
other line keeps its number: a report's line is then compared with the mutated line directly.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

# torch.distributed and functional-collective calls; for each, the position of its input argument
COLLECTIVES = {
    "all_reduce": 0, "all_gather": 1, "all_gather_into_tensor": 1, "_all_gather_base": 1, "all_gather_tensor": 0,
    "reduce_scatter": 1, "reduce_scatter_tensor": 1, "_reduce_scatter_base": 1, "reduce_scatter_single": 1,
    "all_to_all": 1, "all_to_all_single": 1, "broadcast": 0, "reduce": 0, "all_reduce_coalesced": 0,
}
REDUCING = {"all_reduce", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single",
            "reduce"}
REDUCE_OPS = {"SUM": ("MAX", "AVG"), "AVG": ("MAX", "SUM"), "MAX": ("SUM",), "MIN": ("SUM",)}
FUNCOL_OPS = {"sum": ("max", "avg"), "avg": ("max", "sum"), "max": ("sum",)}
DISTRIBUTED_ROOTS = ("distributed", "shard_state", "shard_input", "distributed_step")
REFERENCE_ROOTS = ("reference", "inputs", "loss", "optimizer")
SIZE_NAME = re.compile(r"(^|_)(world_size|(tp|dp|sp|cp|ep)_size|tp_world_size)$")
RANK_NAME = re.compile(r"^(?!(per|num|n)_)(\w+_)?rank$")  # rank, tp_rank; not per_rank (a count)
STRICTER = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">"}
SWAPPABLE = {ast.Sub: "-", ast.Div: "/", ast.MatMult: "@"}


@dataclass(frozen=True)
class Mutant:
    path: Path
    operator: str
    line: int  # the changed code spans [line, end_line]
    end_line: int
    start: tuple[int, int]  # (line, column) range of the original text replaced
    end: tuple[int, int]
    replacement: str
    before: str

    def source(self, original: str) -> str:
        lines = original.splitlines(keepends=True)
        offsets = [0]
        for text in lines:
            offsets.append(offsets[-1] + len(text.encode()))
        data = original.encode()
        lo = offsets[self.start[0] - 1] + self.start[1]
        hi = offsets[self.end[0] - 1] + self.end[1]
        return (data[:lo] + self.replacement.encode() + data[hi:]).decode()

    def describe(self) -> str:
        after = " ".join(self.replacement.split())
        return f"{self.path.name}:{self.line} {self.operator}: `{' '.join(self.before.split())}` -> `{after}`"


def mutants(path: Path) -> list[Mutant]:
    """Every mutant of one case file, in source order."""
    text = path.read_text()
    tree = ast.parse(text)
    found = _Finder(path, text, tree)
    for node in _distributed_only(tree):
        found.visit(node)
    return sorted(found.mutants, key=lambda m: (m.line, m.start, m.operator, m.replacement))


def _distributed_only(tree: ast.Module) -> list[ast.AST]:
    """Top-level functions and classes the distributed entry points reach and the reference's do not."""
    defs = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    uses = {name: _names(node) for name, node in {**_aliases(tree), **defs}.items()}

    def reach(roots: tuple[str, ...]) -> set[str]:
        seen, todo = set(), [r for r in roots if r in defs]
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo += [u for u in uses[name] if u in uses and u not in seen]
        return seen

    shared = reach(REFERENCE_ROOTS)
    return [defs[name] for name in defs if name in reach(DISTRIBUTED_ROOTS) - shared]


def _aliases(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level `name = value` (a function's alias: `reduce = _Reduce.apply`): name -> value."""
    return {target.id: node.value for node in tree.body if isinstance(node, ast.Assign)
            for target in node.targets if isinstance(target, ast.Name)}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def _wrappers(tree: ast.Module) -> set[str]:
    """Module-level functions and autograd Functions whose body issues a collective (transitively)."""
    defs = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    calls = {name: {_callee(n) for n in ast.walk(node) if isinstance(n, ast.Call)}
             | {n.func.value.id for n in ast.walk(node) if isinstance(n, ast.Call) and _callee(n) == "apply"
                and isinstance(n.func, ast.Attribute) and isinstance(n.func.value, ast.Name)}
             for name, node in defs.items()}
    found: set[str] = set()
    while True:
        more = {name for name, called in calls.items() if name not in found and called & (set(COLLECTIVES) | found)}
        more |= {name for name, value in _aliases(tree).items() if name not in found and _names(value) & found}
        if not more:
            return found
        found |= more


class _Finder(ast.NodeVisitor):
    def __init__(self, path: Path, text: str, tree: ast.Module):
        self.path, self.text = path, text
        self.wrappers = _wrappers(tree)
        self.defs = {node.name: node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
        self.dist = _dist_alias(tree)
        self.mutants: list[Mutant] = []
        self.sizes: list[str | None] = []  # the world-size name in scope of each enclosing function

    # one helper per operator ------------------------------------------------------------------

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        names = {a.arg for a in [*node.args.args, *node.args.kwonlyargs]}
        names |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self.sizes.append("world_size" if "world_size" in names else None)
        self.generic_visit(node)
        self.sizes.pop()

    def visit_Call(self, node: ast.Call) -> None:
        name = _callee(node)
        wrapper = node.func.value.id if name == "apply" and isinstance(node.func, ast.Attribute) \
            and isinstance(node.func.value, ast.Name) else name if not isinstance(self.defs.get(name), ast.ClassDef) else ""
        position = COLLECTIVES.get(name, 0 if wrapper in self.wrappers else None)
        if position is not None and len(node.args) > position and not isinstance(node.args[position], ast.Starred):
            self._add(node, "collective deleted", self._segment(node.args[position]), parenthesize=True)
        if name in REDUCING and not any(k.arg == "op" for k in node.keywords) and len(node.args) < 3 and self.dist:
            self._insert_before_close(node, "ReduceOp changed", f"op={self.dist}.ReduceOp.MAX")
        if name in ("all_reduce", "reduce_scatter_tensor", "all_reduce_coalesced"):
            for arg in node.args:
                if isinstance(arg, ast.Constant) and arg.value in FUNCOL_OPS:
                    for other in FUNCOL_OPS[arg.value]:
                        self._add(arg, "ReduceOp changed", repr(other))
        if name == "get_rank":
            self._add(node, "rank replaced", "0")
        for keyword in node.keywords:
            value = _int_constant(keyword.value)
            if keyword.arg == "dim" and value is not None:
                for other in (value + 1, value - 1):
                    self._add(keyword.value, "dim changed", str(other))
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Attribute) and node.value.attr == "ReduceOp" and node.attr in REDUCE_OPS:
            for other in REDUCE_OPS[node.attr]:
                self._add(node, "ReduceOp changed", f"{self._segment(node.value)}.{other}")
        elif isinstance(node.ctx, ast.Load) and _is_rank(node.attr):
            self._add(node, "rank replaced", "0")
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load) and _is_rank(node.id):
            self._add(node, "rank replaced", "0")
            if self.sizes and self.sizes[-1]:
                self._add(node, "rank replaced", f"(({node.id} + 1) % {self.sizes[-1]})")

    def visit_BinOp(self, node: ast.BinOp) -> None:
        self._size_division(node, node.op, node.right)
        symbol = SWAPPABLE.get(type(node.op))
        if symbol:
            left, right = self._segment(node.left), self._segment(node.right)
            if "\n" not in left + right:
                self._add(node, "operands swapped", f"({right}) {symbol} ({left})", parenthesize=True)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._size_division(node, node.op, node.value)
        self.generic_visit(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        if len(node.ops) == 1 and type(node.ops[0]) in STRICTER:
            left, right = self._segment(node.left), self._segment(node.comparators[0])
            if "\n" not in left + right:
                self._add(node, "comparison changed", f"{left} {STRICTER[type(node.ops[0])]} {right}",
                          parenthesize=True)
        self.generic_visit(node)

    def visit_Slice(self, node: ast.Slice) -> None:
        if node.lower is not None and node.upper is not None and node.step is None:
            lower, upper = self._segment(node.lower), self._segment(node.upper)
            if "\n" not in lower + upper:
                self._add(node, "slice shifted", f"({lower}) + 1:({upper}) + 1")
        self.generic_visit(node)

    def _size_division(self, node: ast.AST, op: ast.operator, divisor: ast.expr) -> None:
        name = divisor.id if isinstance(divisor, ast.Name) else divisor.attr if isinstance(divisor, ast.Attribute) else ""
        if isinstance(op, ast.Div) and SIZE_NAME.search(name):
            self._add(divisor, "/ world_size dropped", "1")
            text = self._segment(divisor)
            self._add(divisor, "/ world_size doubled", f"({text} * {text})")

    # splicing ---------------------------------------------------------------------------------

    def _segment(self, node: ast.AST) -> str:
        return ast.get_source_segment(self.text, node) or ""

    def _add(self, node: ast.AST, operator: str, replacement: str, parenthesize: bool = False) -> None:
        before = self._segment(node)
        lines = node.end_lineno - node.lineno
        extra = lines - replacement.count("\n")
        if extra < 0:
            return
        if extra or parenthesize:
            replacement = f"({replacement}{chr(10) * extra})"
        self.mutants.append(Mutant(self.path, operator, node.lineno, node.end_lineno, (node.lineno, node.col_offset),
                                   (node.end_lineno, node.end_col_offset), replacement, before))

    def _insert_before_close(self, call: ast.Call, operator: str, keyword: str) -> None:
        """A keyword added to a call: inserted before its closing parenthesis, no line moved."""
        end = (call.end_lineno, call.end_col_offset - 1)
        text = keyword if not call.args and not call.keywords else f", {keyword}"
        self.mutants.append(Mutant(self.path, operator, call.lineno, call.end_lineno, end, end, text,
                                   self._segment(call)))


def _dist_alias(tree: ast.Module) -> str | None:
    """How the module names torch.distributed (`dist`, `torch.distributed`), if it imports it."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed":
                    return alias.asname or "torch.distributed"
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            return next(a.asname or a.name for a in node.names if a.name == "distributed")
    return None


def _int_constant(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and type(node.operand.value) is int:
        return -node.operand.value
    return None


def _is_rank(name: str) -> bool:
    """A name holding a rank (`rank`, `tp_rank`); `get_rank()` calls are mutated as calls."""
    return bool(RANK_NAME.match(name)) and name != "get_rank"


def all_mutants(paths: list[Path]) -> Iterator[Mutant]:
    for path in paths:
        yield from mutants(path)
