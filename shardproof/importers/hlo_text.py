"""Parse XLA HLO text (`HloModule ...` dumps from Neuron, JAX, torch_xla) into plain records.

Only the syntax lives here; what each opcode means is `importers/hlo.py`. Every instruction is one
line: `[ROOT] %name = shape opcode(operands), key=value, ...`. Attribute values are kept as raw
text (everything up to the next comma outside brackets and strings) and read by the lowering that
needs them, so attributes no lowering uses never have to be understood. `/*index=N*/` comments
(long tuples) are dropped. Current XLA writes the Python stacks once, in tables after the
`HloModule` line (FileNames, FunctionNames, FileLocations, StackFrames), and metadata refers to
them by `stack_frame_id=N`: `HloModule.stack` reads them back. A line that does not fit raises
GraphFileError with file, line and what was expected there.
"""

from __future__ import annotations

import math
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
    """An array type (dtype, dims, and the layout when the dump states one) or a tuple of types."""

    dtype: str  # IR dtype name; "tuple" for tuples
    dims: Shape = ()
    elements: tuple["HloType", ...] = ()
    minor_to_major: Shape | None = None  # `{1,0}` after the dims; None when not stated (row-major)
    element: str = ""  # the HLO element type (`u32`): IR dtypes hold unsigned values in wider signed ones

    @property
    def physical_order(self) -> Shape:
        """The dims from major to minor as they lie in memory."""
        if self.minor_to_major is None:
            return tuple(range(len(self.dims)))
        return tuple(reversed(self.minor_to_major))


@dataclass(frozen=True)
class SourceFrame:
    file: str
    line: int
    function: str


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
    line: int
    params: list[HloType] | None = None  # the header's parameter types, when it lists them
    result: HloType | None = None  # the header's result type, when it states one
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
    header: str = ""  # the `HloModule` line's attributes
    tables: dict[str, dict[int, str]] = field(default_factory=dict)  # stack-frame table -> id -> entry
    _stacks: dict[int, tuple[SourceFrame, ...]] = field(default_factory=dict, repr=False)  # read once per frame id

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]

    def stack(self, frame_id: int) -> tuple[SourceFrame, ...]:
        """The Python stack of `stack_frame_id=N`, outermost call first (every instruction and
        each of its users asks: read once)."""
        if frame_id not in self._stacks:
            self._stacks[frame_id] = self._read_stack(frame_id)
        return self._stacks[frame_id]

    def _read_stack(self, frame_id: int) -> tuple[SourceFrame, ...]:
        """A frame's printed `parent_frame_id` is its parent's id plus one (1: no parent)."""
        frames, files, functions = self.tables.get("StackFrames", {}), self.tables.get("FileNames", {}), self.tables.get("FunctionNames", {})
        locations = self.tables.get("FileLocations", {})
        out, seen = [], set()
        while frame_id in frames and frame_id not in seen:
            seen.add(frame_id)
            fields = _fields(frames[frame_id])
            location = _fields(locations.get(fields.get("file_location_id", -1), ""))
            file = unquote(files.get(location.get("file_name_id", -1), '""'))
            function = unquote(functions.get(location.get("function_name_id", -1), '""'))
            out.append(SourceFrame(file, location.get("line", 0), function))
            frame_id = fields.get("parent_frame_id", 0) - 1
        return tuple(out[::-1])


def _fields(text: str) -> dict[str, int]:
    """`{file_name_id=1 line=8}` -> {"file_name_id": 1, "line": 8}."""
    return {k: int(v) for k, v in re.findall(r"(\w+)=(-?\d+)", text)}


_HEADER = re.compile(r"^(ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*(?=[({-])")
_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")
_COMMENT = re.compile(r'"(?:[^"\\]|\\.)*"|/\*.*?\*/')


def _without_comments(line: str) -> str:
    return _COMMENT.sub(lambda m: m.group(0) if m.group(0).startswith('"') else "", line)


def parse_hlo(text: str, path: str) -> HloModule:
    """Parse a whole module; raises GraphFileError on the first line that does not fit."""
    module_name, computations, entry, current = None, {}, None, None
    module_line, tables, table = "", {}, None
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _without_comments(raw).strip()
        if not line or line.startswith("//"):
            continue
        if module_name is None:
            if not line.startswith("HloModule"):
                raise GraphFileError(path, number, "an `HloModule name` line: this is not an HLO text dump", line)
            module_name = line.split()[1].rstrip(",") if len(line.split()) > 1 else "module"
            module_line = line
            continue
        if current is None and line in _TABLES:
            table = tables.setdefault(line, {})
            continue
        if current is None and table is not None and re.match(r"\d+\s", line):
            key, value = line.split(None, 1)
            table[int(key)] = value
            continue
        if current is None:
            table = None
            header = _HEADER.match(line)
            if header is None:
                raise GraphFileError(path, number, "a computation header `%name (params) -> type {`", line)
            current = _computation(header, line, path, number)
            if header.group(1):
                entry = current.name
            continue
        if line == "}":
            _check_definitions(current, path)
            if current.name in computations:
                raise GraphFileError(path, current.line, f"a new computation name (`{current.name}` is defined twice)", line)
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
    return HloModule(module_name, computations, entry, path, module_line, tables)


def _computation(header: re.Match, line: str, path: str, number: int) -> Computation:
    """A computation opened by its header; `(p0: f32[2], p1: s32[]) -> f32[2] {` typed when given."""
    computation = Computation(header["name"], number)
    cursor = _Line(line, path, number)
    cursor.pos = header.end()
    if cursor.peek("("):
        cursor.pos += 1
        params = _Line(cursor.balanced(")"), path, number)
        computation.params = []
        while not params.at_end():
            params.take(r"%?[\w.\-]+\s*:", "a parameter `name: type`")
            computation.params.append(params.type())
            if not params.at_end():
                params.take(r",", "`,` between parameters")
    if cursor.peek("->"):
        cursor.pos += 2
        computation.result = cursor.type()
    cursor.take(r"\{\s*$", "`{` ending the computation header")
    return computation


def _check_definitions(computation: Computation, path: str) -> None:
    """Every operand defined above its use, every name once, parameters numbered 0..n-1 once each
    with the header's types, one ROOT of the header's result type."""
    defined: dict[str, int] = {}
    for ins in computation.instructions:
        for operand in ins.operands:
            if operand not in defined:
                later = next((i.line for i in computation.instructions if i.name == operand), None)
                where = f" (it is defined below, at line {later})" if later else " (it is defined nowhere)"
                raise GraphFileError(path, ins.line, f"operands defined above their use: `%{operand}` is not{where}", ins.name)
        if ins.name in defined:
            raise GraphFileError(path, ins.line, f"a new instruction name (`%{ins.name}` is defined at line {defined[ins.name]})", ins.name)
        defined[ins.name] = ins.line
    if not computation.instructions:
        raise GraphFileError(path, computation.line, f"instructions in computation `{computation.name}`", "none")
    roots = [i for i in computation.instructions if i.root]
    if len(roots) > 1:
        raise GraphFileError(path, roots[1].line, f"one ROOT in computation `{computation.name}` (another at line {roots[0].line})", roots[1].name)
    parameters = [i for i in computation.instructions if i.opcode == "parameter"]
    numbers = []
    for ins in parameters:
        if not re.fullmatch(r"\s*\d+\s*", ins.literal):
            raise GraphFileError(path, ins.line, "a parameter number like `parameter(0)`", ins.literal)
        numbers.append(int(ins.literal))
    if sorted(numbers) != list(range(len(numbers))):
        ins = parameters[next((k for k, n in enumerate(numbers) if numbers.count(n) > 1 or n >= len(numbers)), -1)]
        raise GraphFileError(path, ins.line, f"parameters numbered 0..{len(numbers) - 1}, each once", f"parameter({ins.literal})")
    if computation.params is not None:
        if len(computation.params) != len(parameters):
            raise GraphFileError(path, computation.line, f"as many parameter instructions as the header lists ({len(computation.params)})", str(len(parameters)))
        for ins in parameters:
            if _array(ins.type) != _array(computation.params[int(ins.literal)]):
                raise GraphFileError(path, ins.line, f"the header's type for parameter {ins.literal}", _typed(ins.type))
    root = roots[0] if roots else computation.instructions[-1]
    if computation.result is not None and _array(root.type) != _array(computation.result):
        raise GraphFileError(path, root.line, f"the header's result type {_typed(computation.result)} at the ROOT", _typed(root.type))


def _array(t: HloType) -> tuple:
    """A type without its layout, for comparison."""
    return (t.dtype, t.dims, tuple(_array(e) for e in t.elements))


def _typed(t: HloType) -> str:
    if t.dtype == "tuple":
        return "(" + ", ".join(_typed(e) for e in t.elements) + ")"
    return f"{t.dtype}{list(t.dims)}"


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

    def at_end(self) -> bool:
        self.skip_space()
        return self.pos >= len(self.text)

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
        text, _, layout = dims.partition("]")
        dims_text = [d.strip().removeprefix("<=") for d in text.split(",") if d.strip()]
        if not all(d.isdigit() for d in dims_text):
            raise GraphFileError(self.path, self.number, "dims that are whole numbers", token)
        sizes = tuple(int(d) for d in dims_text)
        order = layout.strip("{}").split(":")[0]  # tiling and memory space after `:` say nothing of the order
        if layout and (not re.fullmatch(r"[\d,\s]*", order) or sorted(int(d) for d in order.split(",") if d.strip()) != list(range(len(sizes)))):
            raise GraphFileError(self.path, self.number, f"a layout that is a permutation of the dims 0..{len(sizes) - 1}", token)
        minor_to_major = tuple(int(d) for d in order.split(",") if d.strip()) if layout else None
        return HloType(DTYPES[base], sizes, (), minor_to_major if minor_to_major or not sizes else None, base)

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
        start = self.pos
        self._scan(close)
        if self.pos == len(self.text):
            raise self.fail(f"a closing `{close}`")
        self.pos += 1
        return self.text[start : self.pos - 1]

    def _scan(self, stop: str) -> int:
        """Move to the next `stop` outside brackets and strings, or to the end; the bracket depth
        left open there."""
        depth = 0
        while self.pos < len(self.text):
            char = self.text[self.pos]
            if char == '"':
                self.string()
                continue
            if char == stop and depth == 0:
                break
            if char in "({[":
                depth += 1
            elif char in ")}]":
                depth -= 1
            self.pos += 1
        return depth

    def string(self) -> str:
        match = re.compile(r'"(?:[^"\\]|\\.)*"').match(self.text, self.pos)
        if match is None:
            raise self.fail("a closing `\"`")
        self.pos = match.end()
        return match.group(0)

    def value(self) -> str:
        """Up to the next comma outside brackets and strings (`{...}`, `"..."`, `[2,2]<=[4]`,
        `mesh['tp'=2] {'tp'}`)."""
        self.skip_space()
        start = self.pos
        if self._scan(",") or self.pos == start:
            raise self.fail("an attribute value")
        return self.text[start : self.pos].strip()


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
    """Replica groups in any of XLA's three forms, as lists of device ids:
    `{{0,1},{2,3}}` (explicit; `{}` -> []), `[2,2]<=[2,2]T(1,0)` (an iota: group count and size,
    the devices 0..n-1 reshaped and transposed) and `mesh['dp'=2,'tp'=2] {'tp'}` (a mesh's axes,
    `'a':(pre)size` for a sub-axis)."""
    text = text.strip()
    if text.startswith("["):
        return [tuple(int(d) for d in row) for row in iota_devices(text)]
    if text.startswith("mesh"):
        return _mesh_groups(text)
    return [tuple(int(x) for x in g.split(",") if x.strip()) for g in re.findall(r"\{([^{}]*)\}", text[1:-1])]


def iota_devices(text: str) -> "numpy.ndarray":
    """`[a,b]<=[n]` or `[a,b]<=[c,d]T(1,0)`: devices 0..n-1 reshaped to [c,d], transposed, reshaped to [a,b]."""
    import numpy

    match = re.fullmatch(r"\[([\d,\s]*)\]\s*<=\s*\[([\d,\s]*)\](?:T\(([\d,\s]*)\))?", text.strip())
    if match is None:
        raise ValueError(f"not an iota device list: {text}")
    shape, reshape = int_list(match[1]), int_list(match[2])
    devices = numpy.arange(math.prod(reshape)).reshape(reshape)
    if match[3]:
        devices = devices.transpose(int_list(match[3]))
    return devices.reshape(shape)


def _mesh_groups(text: str) -> list[tuple[int, ...]]:
    match = re.fullmatch(r"mesh\[(.*?)\]\s*\{(.*)\}", text, re.S)
    if match is None:
        raise ValueError(f"not a mesh replica group: {text}")
    axes = [(name, int(size)) for name, size in re.findall(r"'([^']+)'\s*=\s*(\d+)", match[1])]
    names = [a for a, _ in axes]
    refs = [(name, int(pre or 1), int(size) if size else None) for name, pre, size in re.findall(r"'([^']+)'(?::\((\d+)\)(\d+))?", match[2])]
    sizes = [s for _, s in axes]
    members: dict[tuple, list[tuple[tuple, int]]] = {}
    for device in range(math.prod(sizes)):
        coords = list(unravel(device, sizes))
        rest, grouped = list(coords), []
        for name, pre, size in refs:
            axis = names.index(name)
            size = size or sizes[axis]
            stride = sizes[axis] // (pre * size)  # `pre` counts the sub-axes more major than this one
            part = (coords[axis] // stride) % size
            grouped.append(part)
            rest[axis] -= part * stride
        members.setdefault(tuple(rest), []).append((tuple(grouped), device))
    return [tuple(d for _, d in sorted(group)) for group in members.values()]


def unravel(index: int, sizes: list[int]) -> tuple[int, ...]:
    """Row-major coordinates of `index` in a grid of `sizes`."""
    coords = []
    for size in reversed(sizes):
        coords.append(index % size)
        index //= size
    return tuple(reversed(coords))


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
