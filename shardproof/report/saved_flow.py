"""Where a number an autograd Function's backward reads from `ctx` was computed: in its forward.

A custom backward uses what its forward saved (`ctx.smoothing = smoothing`, read back as
`smoothing = ctx.smoothing`). A number computed wrong in the forward (a smoothing coefficient, a
vocabulary size) makes the forward's value wrong, and the backward's constant with it; the fault
shows where the backward weighs a term by that constant, but is fixed where the forward computed
it. So when the loss fails as well as a gradient found at a line of the backward, the forward's
line that computed the number the backward's line reads first comes before that line. This reads the
source (`ast`, as rank_flow does): the names the backward's line reads, their bindings from `ctx`
in the backward, the forward's stores to those attributes, and the binding of the value stored
there when that one is a name; the nearest of them that computes (arithmetic, a call) is the line.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from shardproof.report.rank_flow import assignments, source_of


@dataclass(frozen=True)
class SavedValue:
    """The forward's line `line` (of `code`) that computed `name`, which the backward reads at `used`."""

    file: str
    line: int
    code: str
    name: str
    used: int


def saved_origin(file: str, line: int) -> SavedValue | None:
    """The forward's binding that computed the first value `line`, a line of an autograd Function's
    `backward`, reads from `ctx`; None when there is none (a line of no backward, a value not
    saved on `ctx`, one the forward only copies from a parameter) or the file cannot be read."""
    source = source_of(file)
    if source is None:
        return None
    backward = next((f for f in source.functions if f.name == "backward" and f.lineno < line <= (f.end_lineno or 0)), None)
    owner = source.parent.get(backward) if backward is not None else None
    forward = next((m for m in getattr(owner, "body", []) if isinstance(m, ast.FunctionDef) and m.name == "forward"), None)
    if forward is None or not backward.args.args or not forward.args.args:
        return None
    read = sorted((n for n in ast.walk(backward) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                   and n.lineno == line), key=lambda n: n.col_offset)
    for name in dict.fromkeys(n.id for n in read):
        for attr in _loaded_from(backward, name, backward.args.args[0].arg):
            found = _computed(forward, attr)
            if found is not None:
                at, what = found
                return SavedValue(file, at, source.lines[at - 1].strip(), what, line)
    return None


def _loaded_from(backward: ast.FunctionDef, name: str, ctx: str) -> list[str]:
    """The attributes of `ctx` that `name` is bound to in the backward (`name = ctx.attr`)."""
    return [value.attr for target, value in assignments(backward)
            if isinstance(target, ast.Name) and target.id == name and _on(value, ctx)]


def _computed(forward: ast.FunctionDef, attr: str) -> tuple[int, str] | None:
    """(line, name) of the forward's computation of what it stores in `ctx.attr`: the store itself
    when it computes, else the binding of the name stored, when that one computes."""
    ctx = forward.args.args[0].arg
    stores = [(target.lineno, value) for target, value in assignments(forward)
              if isinstance(target, ast.Attribute) and target.attr == attr and _on(target, ctx)]
    for at, value in stores:
        if _computes(value):
            return at, attr
        if isinstance(value, ast.Name):
            bound = [(t.lineno, v) for t, v in assignments(forward) if isinstance(t, ast.Name) and t.id == value.id
                     and t.lineno <= at]
            line, computed = max(bound, key=lambda b: b[0], default=(0, None))
            if computed is not None and _computes(computed):
                return line, value.id
    return None


def _on(node: ast.expr, ctx: str) -> bool:
    return isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == ctx


def _computes(value: ast.expr) -> bool:
    return isinstance(value, (ast.BinOp, ast.UnaryOp, ast.Call))
