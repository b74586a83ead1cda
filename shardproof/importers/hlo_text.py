"""Parse XLA HLO text (`HloModule ...` dumps from Neuron, JAX, torch_xla) into plain records.

Only the syntax lives here; what each opcode means is `importers/hlo.py`. Every instruction is one
line: `[ROOT] %name = shape opcode(operands), key=value, ...`. Attribute values are kept as raw
text (a balanced `{...}`, a quoted string, or a bare word) and read by the lowering that needs
them, so attributes no lowering uses never have to be understood. A line that does not fit
raises GraphFileError with file, line and what was expected there.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from shardproof.errors import GraphFileError

DTYPES = {
    "pred": "bool", "s8": "int8", "s16": "int16", "s32": "int32", "s64": "int64", "u8": "uint8",
    "u16": "int32", "u32": "int64", "u64": "int64", "f16": "float16", "bf16": "bfloat16",
    "f32": "float32", "f64": "float64",
}  # fmt: skip

Shape = tuple[int, ...]


@dataclass(frozen=True)
class HloType:
    """An array type (dtype and dims) or a tuple of types."""

    dtype: str  # IR dtype name; "tuple" for tuples
    dims: Shape = ()
    elements: tuple["HloType", ...] = ()


@dataclass
class Instruction:
    name: str
    type: HloType
    opcode: str
    operands: list[str]
    attrs: dict[str, str]
    line: int
    root: bool = False
    literal: str = ""  # the text inside the parentheses for constant(...) and parameter(...)


@dataclass
class Computation:
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def root(self) -> Instruction:
        roots = [i for i in self.instructions if i.root]
        return roots[0] if roots else self.instructions[-1]


@dataclass
class HloModule:
    name: str
    computations: dict[str, Computation]
    entry: str
    path: str

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(\(.*\))?\s*(->.*)?\{\s*$")


def parse_hlo(text: str, path: str) -> HloModule:
    """Parse a whole module; raises GraphFileError on the first line that does not fit."""
    module_name, computations, entry, current = None, {}, None, None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("//"):
            continue
        if module_name is None:
            if not line.startswith("HloModule"):
                raise GraphFileError(path, number, "an `HloModule name` line: this is not an HLO text dump", line)
            module_name = line.split()[1].rstrip(",") if len(line.split()) > 1 else "module"
            continue
        if current is None:
            header = _HEADER.match(line)
            if header is None:
                raise GraphFileError(path, number, "a computation header `%name (params) -> type {`", line)
            current = Computation(header["name"])
            if header.group(1):
                entry = current.name
            continue
        if line == "}":
            computations[current.name] = current
            current = None
            continue
        current.instructions.append(_Line(line, path, number).instruction())
    if module_name is None:
        raise GraphFileError(path, 1, "an `HloModule name` line: this is not an HLO text dump", "an empty file")
    if current is not None:
        raise GraphFileError(path, len(text.splitlines()), f"`}}` closing computation {current.name}", "end of file")
    if entry is None:
        raise GraphFileError(path, len(text.splitlines()), "an `ENTRY` computation", "none")
    return HloModule(module_name, computations, entry, path)


class _Line:
    """A cursor over one instruction line."""

    def __init__(self, text: str, path: str, number: int):
        self.text, self.path, self.number, self.pos = text, path, number, 0

    def fail(self, expected: str) -> GraphFileError:
        found = self.text[self.pos : self.pos + 40] or "end of line"
        return GraphFileError(self.path, self.number, expected, found)

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] == " ":
            self.pos += 1

    def take(self, pattern: str, expected: str) -> str:
        self.skip_space()
        match = re.compile(pattern).match(self.text, self.pos)
        if match is None:
            raise self.fail(expected)
        self.pos = match.end()
        return match.group(0)

    def peek(self, char: str) -> bool:
        self.skip_space()
        return self.text.startswith(char, self.pos)

    def instruction(self) -> Instruction:
        root = False
        if self.text.startswith("ROOT "):
            root, self.pos = True, 5
        name = self.take(r"%?[\w.\-]+", "an instruction name like `%add.1`").lstrip("%")
        self.take(r"=", "`=` after the instruction name")
        hlo_type = self.type()
        opcode = self.take(r"[\w\-]+", "an opcode like `add` or `dot`")
        self.take(r"\(", f"`(` after opcode `{opcode}`")
        inside = self.balanced(")")
        operands, literal = ([], inside) if opcode in ("constant", "parameter") else (self.operands(inside), "")
        attrs = {}
        while self.peek(","):
            self.pos += 1
            key = self.take(r"[\w\-]+", "an attribute name like `dimensions`")
            self.take(r"=", f"`=` after attribute `{key}`")
            attrs[key] = self.value()
        self.skip_space()
        if self.pos != len(self.text):
            raise self.fail("`, key=value` or the end of the instruction")
        return Instruction(name, hlo_type, opcode, operands, attrs, self.number, root, literal)

    def type(self) -> HloType:
        if self.peek("("):
            self.pos += 1
            elements = []
            while not self.peek(")"):
                elements.append(self.type())
                if self.peek(","):
                    self.pos += 1
            self.pos += 1
            return HloType("tuple", (), tuple(elements))
        token = self.take(r"[a-z]+\d*\[[^\]]*\](\{[^}]*\})?", "a shape like `f32[2,3]{1,0}`")
        base, dims = token.split("[", 1)
        if base not in DTYPES:
            raise GraphFileError(self.path, self.number, f"an element type ({', '.join(DTYPES)})", base)
        text = dims.split("]", 1)[0].replace("<=", "")
        return HloType(DTYPES[base], tuple(int(d) for d in text.split(",") if d.strip()))

    def operands(self, text: str) -> list[str]:
        names = []
        for part in _split_top(text):
            match = re.search(r"%?([\w.\-]+)\s*$", part)
            if match is None:
                raise GraphFileError(self.path, self.number, "an operand like `%name`", part)
            names.append(match.group(1))
        return names

    def balanced(self, close: str) -> str:
        """Text up to the matching `close`, skipping nested brackets and quoted strings."""
        start, depth = self.pos, 0
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == '"':
                self.string()
                continue
            if char in "({[":
                depth += 1
            elif char in ")}]":
                if depth == 0 and char == close:
                    self.pos += 1
                    return self.text[start : self.pos - 1]
                depth -= 1
            self.pos += 1
        raise self.fail(f"a closing `{close}`")

    def string(self) -> str:
        match = re.compile(r'"(?:[^"\\]|\\.)*"').match(self.text, self.pos)
        if match is None:
            raise self.fail("a closing `\"`")
        self.pos = match.end()
        return match.group(0)

    def value(self) -> str:
        self.skip_space()
        if self.peek("{"):
            self.pos += 1
            return "{" + self.balanced("}") + "}"
        if self.peek('"'):
            return self.string()
        return self.take(r"[^,\s]+", "an attribute value")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    tail = text[start:]
    if tail.strip():
        parts.append(tail)
    return [p.strip() for p in parts]


def int_list(text: str) -> tuple[int, ...]:
    """`{1,2}` -> (1, 2)."""
    inner = text.strip().strip("{}")
    return tuple(int(x) for x in inner.split(",") if x.strip())


def groups(text: str) -> list[tuple[int, ...]]:
    """`{{0,1},{2,3}}` -> [(0, 1), (2, 3)]; `{}` -> []."""
    return [tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([^{}]*)\}", text[1:-1])]


def slice_ranges(text: str) -> list[tuple[int, int, int]]:
    """`{[0:256], [0:1024:1]}` -> [(0, 256, 1), (0, 1024, 1)]."""
    out = []
    for inner in re.findall(r"\[([^\]]*)\]", text):
        numbers = [int(x) for x in inner.split(":")]
        out.append((numbers[0], numbers[1], numbers[2] if len(numbers) > 2 else 1))
    return out


def unquote(text: str) -> str:
    if len(text) >= 2 and text[0] == text[-1] == '"':
        return text[1:-1].encode("latin-1", "backslashreplace").decode("unicode_escape")
    return text
