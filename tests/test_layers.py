"""Imports run one way: front ends produce programs, the one driver proves and reports them. Read
from the source (not by importing), so a test of layering never depends on what was imported before."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "shardproof"
PYTORCH_FRONT_END = {"shardproof.api", "shardproof.capture", "shardproof.case", "shardproof.state", "shardproof.steps",
                     "shardproof.oracle"}
GRAPH_FRONT_END = {"shardproof.importers"}
DRIVER = {"shardproof.driver"}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports() -> dict[str, set[str]]:
    """Module -> the shardproof modules it imports (at run time: `TYPE_CHECKING` blocks left out)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardproof"):
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names if a.name.startswith("shardproof")}
        found[_module(path)] = names
    return found


def _closure(start: str, imports: dict[str, set[str]]) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for name in imports.get(stack.pop(), ()):
            if name not in seen:
                seen.add(name)
                stack.append(name)
    return seen


def _in(name: str, layer: set[str]) -> bool:
    return any(name == top or name.startswith(top + ".") for top in layer)


def test_the_driver_never_imports_a_front_end() -> None:
    imported = _closure("shardproof.driver", _imports())
    assert not [m for m in imported if _in(m, PYTORCH_FRONT_END | GRAPH_FRONT_END)]


def test_front_ends_do_not_import_each_other() -> None:
    imports = _imports()
    graph_side = set().union(*(_closure(m, imports) for m in imports if _in(m, GRAPH_FRONT_END)))
    assert not [m for m in graph_side if _in(m, PYTORCH_FRONT_END)]
    pytorch_side = set().union(*(_closure(m, imports) for m in imports if _in(m, PYTORCH_FRONT_END)))
    assert not [m for m in pytorch_side if _in(m, GRAPH_FRONT_END)]


def test_only_front_ends_import_the_driver() -> None:
    imports = _imports()
    importers_of_driver = {m for m, names in imports.items() if any(_in(n, DRIVER) for n in names)}
    assert importers_of_driver <= {"shardproof.api", "shardproof.importers.verify"}
