"""Terms in the user's vocabulary: the one place a normal-form term becomes text for a person.

A term is written as the Python a user would write for the same value: tensors by their names
(`fc2.weight`, `inputs()[0]`), regions as slices (`fc2.weight[:, 256:512]`), layout changes as
tensor methods (`.view(2, 4, 8)`, `.permute(0, 2, 1)`, `.T`), sums with their coefficients as
fractions (`a - 1/4 * b`), products with `@` and `*`, other ops as `torch.<op>(...)`, a sum split
over ranks as this rank's `Partial(sum)` share. Deep terms are cut with `…`. Diagnoses call
`describe`; a new kind of finding needs nothing here, and a new term op reads as `torch.<op>(...)`
until it is given a form of its own below.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from shardproof.ir.aten_ops import Operand, is_open
from shardproof.report.model import Region

if TYPE_CHECKING:
    from shardproof.ir.graph import Node
    from shardproof.relations.rules import Rules
    from shardproof.relations.universe import Universe

LEAF_KINDS = {"state": "{}", "input": "inputs()[{}]", "reference-output": "the reference's output {}"}
INFIX = {"add": "+", "mul": "*", "div": "/", "matmul": "@", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
MOVES = {"slice", "view", "permute", "bcast", "repeat"}  # terms that only move elements
ATOM, PRODUCT, SUM = 0, 1, 2  # precedence of the text made: what needs parentheses inside what


def describe(u: Universe, t: int, depth: int = 3) -> str:
    """Term `t` as a Python expression, cut below `depth` levels of operations."""
    return _text(u, t, depth)[0]


def fraction(value: Any) -> str:
    """A number as a person writes it: 1/4, -1, 0.5, 2 (not 2.0), never Fraction(1, 4)."""
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def region(rules: Rules, side: str, t: int) -> Region:
    """Term `t` as the region of a whole tensor it is (the whole term itself when it is none)."""
    root, box = rules.as_region(t)
    return Region(side, _wrapped(_text(rules.u, root, 2), ATOM), rules.shape(root), tuple(box))


def placement(kind: str) -> str:
    """What a rank holds, as DTensor names its placement: a partial sum is `Partial(sum)`."""
    return {"partial sum": "Partial(sum)", "partial max": "Partial(max)"}.get(kind, kind)


def value_name(node: Node) -> str:
    """How the user's code names a node's value: the variable its line assigns (`scores`), else
    the expression of the line (`self.down(x)`, cut if long), else the op; an op of a line's
    backward is the gradient flowing back through that value."""
    loc = node.loc
    if loc is None:
        return f"the `{node.op}` result"
    code = loc.code.split("  #", 1)[0].strip()
    assigned = re.match(r"([A-Za-z_][\w.]*(?:\[[^\]]*\])?)\s*(?::[^=]+)?[-+*/@]?=(?!=)", code)
    entry = re.match(r"""(["'][^"']+["'])\s*:""", code)  # a dict entry: a loader's `"fc2.weight": ...`
    expression = assigned[1] if assigned else code.removeprefix("return ").strip()
    name = f"`{expression if len(expression) <= 48 else expression[:47] + '…'}`"
    if entry:
        name = f"the {entry[1]} entry"
    return f"the gradient flowing back through {name}" if loc.backward else name


def line_of(node: Node) -> str:
    """`line 31 of model.py`, or the op's name where the graph records no line."""
    return f"line {node.loc.line} of {node.loc.file.rsplit('/', 1)[-1]}" if node.loc else f"`{node.name}`"


def _text(u: Universe, t: int, depth: int) -> tuple[str, int]:
    term = u[t]
    if term.op == "leaf":
        kind, _, name = str(term.attrs[0]).rpartition(":")
        return LEAF_KINDS.get(kind, "{}").format(name), ATOM
    if term.op == "full":
        return fraction(term.attrs[0]), ATOM
    if depth == 0:
        return "…", ATOM
    deeper = depth if term.op in MOVES else depth - 1  # a chain of reshapes and slices reads as one step
    args = [_text(u, a, deeper) for a in term.args]
    form = _FORMS.get(term.op)
    if form is not None:
        return form(u, term, args)
    if term.op in INFIX and len(args) == 2:
        return f"{_wrapped(args[0], PRODUCT)} {INFIX[term.op]} {_wrapped(args[1], ATOM)}", PRODUCT
    if is_open(term.op):
        return _open(term, [text for text, _ in args]), ATOM
    inner = [text for text, _ in args] + [_attr(a) for a in term.attrs if a != ()]
    return f"torch.{term.op}({', '.join(inner)})", ATOM


def _open(term: Any, args: list[str]) -> str:
    """An open op (ir/aten_ops.py) as its call: `torch.cumsum(x, 1)`, its argument template with
    the operands written in, then the output it is (`[0]`)."""
    template, kwargs, path = term.attrs

    def fill(value: Any) -> str:
        if isinstance(value, Operand):
            return args[value.index] if value.index < len(args) else "…"
        if isinstance(value, (list, tuple)) and any(isinstance(v, Operand) for v in value):
            return "[" + ", ".join(fill(v) for v in value) + "]"
        return _attr(value)

    inner = [fill(a) for a in template] + [f"{k}={fill(v)}" for k, v in kwargs]
    return f"torch.{term.op.split('.')[1]}({', '.join(inner)})" + "".join(f"[{i}]" for i in path)


def _wrapped(text: tuple[str, int], allowed: int) -> str:
    """Parenthesised if its precedence is looser than `allowed`."""
    return text[0] if text[1] <= allowed else f"({text[0]})"


def _attr(value: Any) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_attr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return fraction(value)


def index(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> str:
    """A box as a Python index: whole dims are `:`, trailing whole dims left out."""
    parts = [":" if (lo, hi) == (0, size) else f"{lo}:{hi}" for (lo, hi), size in zip(box, shape)]
    while parts and parts[-1] == ":":
        parts.pop()
    return f"[{', '.join(parts)}]" if parts else ""


def _slice(u: Universe, term: Any, args: list) -> tuple[str, int]:
    return f"{_wrapped(args[0], ATOM)}{index(term.attrs[0], u[term.args[0]].shape)}", ATOM


def _view(u: Universe, term: Any, args: list) -> tuple[str, int]:
    return f"{_wrapped(args[0], ATOM)}.view({', '.join(map(str, term.shape))})", ATOM


def _permute(u: Universe, term: Any, args: list) -> tuple[str, int]:
    perm = term.attrs[0]
    if tuple(perm) == (1, 0):
        return f"{_wrapped(args[0], ATOM)}.T", ATOM
    return f"{_wrapped(args[0], ATOM)}.permute({', '.join(map(str, perm))})", ATOM


def _bcast(u: Universe, term: Any, args: list) -> tuple[str, int]:
    """Broadcasting is implicit in Python where the base's dims are the trailing ones."""
    dims = term.attrs[0]
    trailing = tuple(range(len(term.shape) - len(dims), len(term.shape)))
    if tuple(dims) == trailing:
        return args[0]
    index = ", ".join(":" if d in dims else "None" for d in range(dims[0], len(term.shape)))
    return f"{_wrapped(args[0], ATOM)}[{index}]", ATOM


def _repeat(u: Universe, term: Any, args: list) -> tuple[str, int]:
    dim, times = term.attrs
    return f"{_wrapped(args[0], ATOM)}.repeat_interleave({times}, dim={dim})", ATOM


def _cat(u: Universe, term: Any, args: list) -> tuple[str, int]:
    return f"torch.cat([{', '.join(text for text, _ in args)}], dim={term.attrs[0]})", ATOM


def _lin(u: Universe, term: Any, args: list) -> tuple[str, int]:
    """a + b - 1/4 * c"""
    out = ""
    for (text, precedence), coefficient in zip(args, term.attrs[0]):
        negative = coefficient < 0
        size = -coefficient if negative else coefficient
        scaled = _wrapped((text, precedence), SUM if size == 1 else ATOM)
        scaled = scaled if size == 1 else f"{fraction(size)} * {scaled}"
        out += (" - " if negative else " + ") + scaled if out else ("-" if negative else "") + scaled
    return out, SUM


def _piece(u: Universe, term: Any, args: list) -> tuple[str, int]:
    """One rank's share of a sum (or max) over ranks: the rest of the sum is on the other ranks."""
    kind = {"piece": "Partial(sum)", "max_piece": "Partial(max)", "arg_piece": "Partial(argmax)", "top_piece": "Partial(topk)"}[term.op]
    _, lo, hi, size = term.attrs
    return f"{kind} share {lo}:{hi} of {size} of {_wrapped(args[0], ATOM)}", SUM


def _call(u: Universe, term: Any, args: list) -> tuple[str, int]:
    """A repeated module's call (partition/module_calls.py) as the module called: `model.norm(x)[0]`."""
    _, output, module = term.attrs
    return f"{module}({', '.join(text for text, _ in args)})[{output}]", ATOM


_FORMS = {
    "call": _call,
    "slice": _slice,
    "view": _view,
    "permute": _permute,
    "bcast": _bcast,
    "repeat": _repeat,
    "cat": _cat,
    "lin": _lin,
    "piece": _piece,
    "max_piece": _piece,
    "arg_piece": _piece,
    "top_piece": _piece,
    "neg": lambda u, term, args: (f"-{_wrapped(args[0], ATOM)}", PRODUCT),
    "pow": lambda u, term, args: (f"{_wrapped(args[0], ATOM)} ** {_attr(term.attrs[0])}", PRODUCT),
    "sum": lambda u, term, args: (f"{_wrapped(args[0], ATOM)}.sum({_dims(term.attrs)})", ATOM),
    "amax": lambda u, term, args: (f"{_wrapped(args[0], ATOM)}.amax({_dims(term.attrs)})", ATOM),
    "softmax": lambda u, term, args: (f"{_wrapped(args[0], ATOM)}.softmax({term.attrs[0]})", ATOM),
    "log_softmax": lambda u, term, args: (f"{_wrapped(args[0], ATOM)}.log_softmax({term.attrs[0]})", ATOM),
}


def _dims(attrs: tuple) -> str:
    dims = tuple(attrs[0]) if attrs else ()
    keep = ", keepdim=True" if len(attrs) > 1 and attrs[1] else ""
    return (str(dims[0]) if len(dims) == 1 else _attr(dims)) + keep
