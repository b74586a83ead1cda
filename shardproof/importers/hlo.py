"""Lower a parsed HLO module into the shardproof IR, for one rank.

`_LOWER` maps each opcode to a small function that emits IR through a GraphBuilder. An SPMD
module (one program for all ranks, as Neuron emits) is lowered once per rank: only collectives
depend on the rank (which replica group it is in). Constants whose values the dump elides
(`constant({...})`) become graph inputs, matched to the reference's like parameters.
"""

from __future__ import annotations

import math
import re
from typing import Callable

from shardproof.errors import GraphFileError, UnsupportedOp
from shardproof.importers.graph_inputs import ImportedGraph
from shardproof.importers.hlo_text import (
    HloModule,
    Instruction,
    groups,
    int_list,
    parse_hlo,
    slice_ranges,
    unquote,
)
from shardproof.ir.build import GraphBuilder
from shardproof.ir.graph import Graph, Location

Value = int | tuple  # an IR node id, or a tuple of values for tuple-shaped instructions


def load_hlo(path: str) -> HloModule:
    with open(path, encoding="utf-8") as handle:
        return parse_hlo(handle.read(), path)


def world_size_of(module: HloModule) -> int | None:
    """The number of ranks an SPMD module's collectives span, if it has any."""
    members = [r for i in module.entry_computation.instructions for g in _replica_groups(i) for r in g]
    return max(members) + 1 if members else None


def lower_hlo(module: HloModule, rank: int | None, world_size: int) -> ImportedGraph:
    return _Lowering(module, rank, world_size).run()


class _Lowering:
    def __init__(self, module: HloModule, rank: int | None, world_size: int):
        self.module, self.rank, self.world_size = module, rank, world_size
        self.graph = Graph(rank=rank)
        self.b = GraphBuilder(self.graph)
        self.env: dict[str, Value] = {}
        self.imported = ImportedGraph(self.graph, module.path)

    def run(self) -> ImportedGraph:
        entry = self.module.entry_computation
        parameters = sorted((i for i in entry.instructions if i.opcode == "parameter"), key=lambda i: int(i.literal))
        for instruction in parameters:
            self.b.at(instruction.name, self.locate(instruction))
            self.env[instruction.name] = self.imported.add_input(instruction.name, instruction.type.dims, instruction.type.dtype)
        for instruction in entry.instructions:
            if instruction.opcode == "parameter":
                continue
            self.b.at(instruction.name, self.locate(instruction))
            lower = _LOWER.get(instruction.opcode)
            if lower is None:
                raise UnsupportedOp(f"HLO {instruction.opcode}", f"{self.module.path}:{instruction.line}")
            self.env[instruction.name] = lower(self, instruction)
        root = self.env[entry.root.name]
        self.graph.outputs = list(_flatten(root))
        return self.imported

    # --- helpers ------------------------------------------------------------------------------
    def operand(self, instruction: Instruction, index: int) -> int:
        value = self.env[instruction.operands[index]]
        if not isinstance(value, int):
            raise GraphFileError(self.module.path, instruction.line, "an array operand", instruction.operands[index])
        return value

    def operands(self, instruction: Instruction) -> list[int]:
        return [self.operand(instruction, i) for i in range(len(instruction.operands))]

    def attr(self, instruction: Instruction, key: str) -> str:
        if key not in instruction.attrs:
            raise GraphFileError(self.module.path, instruction.line, f"attribute `{key}=` on {instruction.opcode}", instruction.name)
        return instruction.attrs[key]

    def locate(self, instruction: Instruction) -> Location:
        code = f"{instruction.opcode}({', '.join('%' + o for o in instruction.operands)})"
        frame = _user_frame(instruction.attrs.get("metadata", ""))
        if frame is None:
            return Location(self.module.path, instruction.line, code)
        return Location(frame[0], frame[1], code)

    def group(self, instruction: Instruction) -> tuple[int, ...]:
        found = _replica_groups(instruction)
        if not found:
            return tuple(range(self.world_size))
        mine = [g for g in found if self.rank in g]
        if len(mine) != 1:
            raise GraphFileError(self.module.path, instruction.line, f"exactly one replica group holding rank {self.rank}", str(found))
        return mine[0]

    def reducer(self, instruction: Instruction) -> str:
        """The IR reduction a `to_apply` computation performs (its root: add, maximum, ...)."""
        name = self.attr(instruction, "to_apply").lstrip("%")
        computation = self.module.computations.get(name)
        if computation is None:
            raise GraphFileError(self.module.path, instruction.line, f"a computation named {name}", name)
        opcode = computation.root.opcode
        if opcode not in _REDUCERS:
            raise UnsupportedOp(f"HLO reduction by `{opcode}`", f"{self.module.path}:{instruction.line}")
        return _REDUCERS[opcode]


_REDUCERS = {"add": "sum", "maximum": "amax"}
_NEUTRAL = {"sum": 0.0, "amax": -math.inf}


def _replica_groups(instruction: Instruction) -> list[tuple[int, ...]]:
    text = instruction.attrs.get("replica_groups")
    return groups(text) if text else []


def _user_frame(metadata: str) -> tuple[str, int] | None:
    """The innermost frame outside installed packages: Neuron records the whole Python stack in
    source_file ("file\\n----\\n['a.py:1', ...]"); other producers give source_file/source_line."""
    match = re.search(r'source_file="((?:[^"\\]|\\.)*)"', metadata)
    if match is None:
        return None
    text = unquote(f'"{match.group(1)}"')
    frames = re.findall(r"'([^']+):(\d+)'", text)
    frames = [(f, int(n)) for f, n in frames if "-packages/" not in f]
    if frames:
        return frames[-1]
    line = re.search(r"source_line=(\d+)", metadata)
    return (text.split("\n", 1)[0], int(line.group(1))) if line else None


def _flatten(value: Value) -> list[int]:
    if isinstance(value, tuple):
        return [x for v in value for x in _flatten(v)]
    return [value]


# --- lowerings ------------------------------------------------------------------------------------
def _elementwise(op: str) -> Callable[[_Lowering, Instruction], int]:
    def lower(lo: _Lowering, ins: Instruction) -> int:
        args = lo.operands(ins)
        return lo.b.add(op, tuple(args), (), ins.type.dims, ins.type.dtype)

    return lower


def _subtract(lo: _Lowering, ins: Instruction) -> int:
    a, b = lo.operands(ins)
    return lo.b.subtract(a, b)


def _constant(lo: _Lowering, ins: Instruction) -> int:
    text = ins.literal.strip()
    if "..." in text:  # values elided by the dump: an input, matched to the reference's
        return lo.imported.add_input(ins.name, ins.type.dims, ins.type.dtype, constant=True)
    values = [_number(v, lo, ins) for v in re.findall(r"[^\s{},]+", text)]
    if len(values) == 1:
        return lo.b.full(values[0], ins.type.dims, ins.type.dtype)
    if len(values) != math.prod(ins.type.dims):
        raise GraphFileError(lo.module.path, ins.line, f"{math.prod(ins.type.dims)} constant values", text)
    return lo.b.add("const", (), (("values", tuple(values)),), ins.type.dims, ins.type.dtype)


def _number(text: str, lo: _Lowering, ins: Instruction) -> float | int | bool:
    words = {"true": True, "false": False, "inf": math.inf, "-inf": -math.inf, "nan": math.nan}
    if text in words:
        return words[text]
    try:
        return int(text) if re.fullmatch(r"-?\d+", text) else float(text)
    except ValueError:
        raise GraphFileError(lo.module.path, ins.line, "a number in the constant", text) from None


def _iota(lo: _Lowering, ins: Instruction) -> int:
    dim = int(lo.attr(ins, "iota_dimension"))
    size = ins.type.dims[dim]
    line = lo.b.add("const", (), (("arange", 0, size, 1),), (size,), ins.type.dtype)
    return lo.b.place(line, ins.type.dims, (dim,))


def _broadcast(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.place(lo.operand(ins, 0), ins.type.dims, int_list(ins.attrs.get("dimensions", "{}")))


def _reshape(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.view(lo.operand(ins, 0), ins.type.dims)


def _transpose(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.permute(lo.operand(ins, 0), int_list(lo.attr(ins, "dimensions")))


def _convert(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.convert(lo.operand(ins, 0), ins.type.dtype)


def _identity(lo: _Lowering, ins: Instruction) -> int:
    return lo.operand(ins, 0)


def _slice(lo: _Lowering, ins: Instruction) -> int:
    value = lo.operand(ins, 0)
    for dim, (start, end, stride) in enumerate(slice_ranges(lo.attr(ins, "slice"))):
        if stride != 1:
            raise UnsupportedOp("HLO slice with stride != 1", f"{lo.module.path}:{ins.line}")
        value = lo.b.slice(value, dim, start, end)
    return value


def _concatenate(lo: _Lowering, ins: Instruction) -> int:
    (dim,) = int_list(lo.attr(ins, "dimensions"))
    return lo.b.cat(lo.operands(ins), dim)


def _compare(lo: _Lowering, ins: Instruction) -> int:
    direction = lo.attr(ins, "direction")
    ops = {"LT": "lt", "LE": "le", "GT": "gt", "GE": "ge", "EQ": "eq", "NE": "ne"}
    if direction not in ops:
        raise GraphFileError(lo.module.path, ins.line, "direction=LT|LE|GT|GE|EQ|NE", direction)
    return _elementwise(ops[direction])(lo, ins)


def _dot(lo: _Lowering, ins: Instruction) -> int:
    """dot with dimension numbers as permute + reshape + matmul; the output is
    (batch dims, lhs free dims, rhs free dims) as in XLA."""
    lhs, rhs = lo.operands(ins)
    dims = {k: int_list(ins.attrs.get(k, "{}")) for k in ("lhs_batch_dims", "rhs_batch_dims", "lhs_contracting_dims", "rhs_contracting_dims")}
    lb, rb, lc, rc = dims["lhs_batch_dims"], dims["rhs_batch_dims"], dims["lhs_contracting_dims"], dims["rhs_contracting_dims"]
    lf = tuple(d for d in range(len(lo.b.shape(lhs))) if d not in lb + lc)
    rf = tuple(d for d in range(len(lo.b.shape(rhs))) if d not in rb + rc)
    left = _as_matrix(lo, lhs, lb, lf, lc)
    right = _as_matrix(lo, rhs, rb, rc, rf)
    product = lo.b.matmul(left, right)
    return lo.b.view(lo.b.convert(product, ins.type.dtype), ins.type.dims)


def _as_matrix(lo: _Lowering, value: int, batch: tuple, rows: tuple, cols: tuple) -> int:
    """Permute to (batch, rows, cols) and merge rows and cols into one dim each."""
    shape = lo.b.shape(value)
    moved = lo.b.permute(value, batch + rows + cols)
    merged = tuple(shape[d] for d in batch) + (math.prod(shape[d] for d in rows), math.prod(shape[d] for d in cols))
    return lo.b.view(moved, merged)


def _reduce(lo: _Lowering, ins: Instruction) -> Value:
    if len(ins.operands) != 2:
        raise UnsupportedOp("HLO variadic reduce", f"{lo.module.path}:{ins.line}")
    value, init = lo.operands(ins)
    op = lo.reducer(ins)
    reduced = lo.b.reduce(op, value, int_list(lo.attr(ins, "dimensions")), keepdim=False)
    node = lo.graph[init]
    if node.op == "const" and node.attrs[0] == ("full", _NEUTRAL[op]):
        return reduced
    combine = {"sum": "add", "amax": "maximum"}[op]
    return lo.b.binary(combine, reduced, init)


def _select(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.add("where", tuple(lo.operands(ins)), (), ins.type.dims, ins.type.dtype)


def _collective(op: str) -> Callable[[_Lowering, Instruction], int]:
    """all-reduce / all-gather / reduce-scatter over this rank's replica group; over a group of
    one rank each is the identity."""

    def lower(lo: _Lowering, ins: Instruction) -> int:
        group = lo.group(ins)
        if len(group) == 1:
            return lo.operand(ins, 0)
        reduce_op = {"sum": "sum", "amax": "max"}[lo.reducer(ins)] if op != "all_gather" else None
        dim = int_list(lo.attr(ins, "dimensions"))[0] if op != "all_reduce" else None
        attrs = {"all_reduce": (reduce_op, group), "all_gather": (dim, group), "reduce_scatter": (dim, reduce_op, group)}[op]
        return lo.b.add(op, (lo.operand(ins, 0),), attrs, ins.type.dims, ins.type.dtype)

    return lower


def _gather(lo: _Lowering, ins: Instruction) -> int:
    """The gather form that picks whole slices along one dim (a row lookup) as an embedding."""
    operand, indices = lo.operands(ins)
    shape = lo.b.shape(operand)
    index_map = int_list(lo.attr(ins, "start_index_map"))
    dim = index_map[0] if len(index_map) == 1 else None
    collapsed = int_list(ins.attrs.get("collapsed_slice_dims", "{}"))
    sizes = int_list(lo.attr(ins, "slice_sizes"))
    index_rank = len(lo.b.shape(indices))
    vector_dim = int(ins.attrs.get("index_vector_dim", str(index_rank)))
    whole = all(s == n for d, (s, n) in enumerate(zip(sizes, shape)) if d != dim)
    if dim is None or collapsed != (dim,) or sizes[dim] != 1 or not whole or vector_dim not in (index_rank, index_rank - 1):
        raise UnsupportedOp("HLO gather other than a lookup of whole slices along one dim", f"{lo.module.path}:{ins.line}")
    if vector_dim == index_rank - 1 and lo.b.shape(indices)[-1] == 1 and index_rank > 1:
        indices = lo.b.view(indices, lo.b.shape(indices)[:-1])
    rest = tuple(d for d in range(len(shape)) if d != dim)
    table = lo.b.view(lo.b.permute(operand, (dim,) + rest), (shape[dim], math.prod(shape[d] for d in rest)))
    ids = lo.b.shape(indices)
    rows = lo.b.add("embedding", (table, indices), (), ids + (lo.b.shape(table)[1],), ins.type.dtype)
    offsets = int_list(lo.attr(ins, "offset_dims"))
    batch_dims = tuple(d for d in range(len(ins.type.dims)) if d not in offsets)
    looked_up = lo.b.view(rows, ids + tuple(shape[d] for d in rest))
    order = batch_dims + offsets  # where each dim of `looked_up` goes in the output
    return lo.b.permute(looked_up, tuple(order.index(d) for d in range(len(order))))


def _tuple(lo: _Lowering, ins: Instruction) -> tuple:
    return tuple(lo.env[name] for name in ins.operands)


def _get_tuple_element(lo: _Lowering, ins: Instruction) -> Value:
    return lo.env[ins.operands[0]][int(lo.attr(ins, "index"))]


def _custom_call(lo: _Lowering, ins: Instruction) -> Value:
    target = unquote(lo.attr(ins, "custom_call_target"))
    lower = _CUSTOM_CALLS.get(target)
    if lower is None:
        raise UnsupportedOp(f"HLO custom-call `{target}`", f"{lo.module.path}:{ins.line}")
    return lower(lo, ins)


def _neuron_rms_norm(lo: _Lowering, ins: Instruction) -> int:
    """AwsNeuronRmsNorm(x, weight, eps): backend_config holds the normalised dim."""
    x, weight, eps = lo.operands(ins)
    node = lo.graph[eps]
    if node.op != "const" or node.attrs[0][0] != "full":
        raise UnsupportedOp("AwsNeuronRmsNorm with a non-constant epsilon", f"{lo.module.path}:{ins.line}")
    dim = int(unquote(ins.attrs.get("backend_config", '"2"')) or 2)
    return lo.b.convert(lo.b.rms_norm(x, weight, (dim,), node.attrs[0][1]), ins.type.dtype)


_CUSTOM_CALLS: dict[str, Callable[[_Lowering, Instruction], Value]] = {
    "AwsNeuronTransferWithStaticRing": _identity,  # moves a weight into device memory
    "AwsNeuronRmsNorm": _neuron_rms_norm,
}

_LOWER: dict[str, Callable[[_Lowering, Instruction], Value]] = {
    "constant": _constant,
    "iota": _iota,
    "broadcast": _broadcast,
    "reshape": _reshape,
    "bitcast": _reshape,
    "transpose": _transpose,
    "convert": _convert,
    "copy": _identity,
    "slice": _slice,
    "concatenate": _concatenate,
    "dot": _dot,
    "reduce": _reduce,
    "select": _select,
    "compare": _compare,
    "add": _elementwise("add"),
    "multiply": _elementwise("mul"),
    "divide": _elementwise("div"),
    "maximum": _elementwise("maximum"),
    "minimum": _elementwise("minimum"),
    "and": _elementwise("logical_and"),
    "or": _elementwise("logical_or"),
    "subtract": _subtract,
    **{name: _elementwise(op) for name, op in {
        "negate": "neg", "exponential": "exp", "log": "log", "sqrt": "sqrt", "rsqrt": "rsqrt", "tanh": "tanh",
        "logistic": "sigmoid", "sine": "sin", "cosine": "cos", "abs": "abs", "not": "logical_not",
    }.items()},  # fmt: skip
    "all-reduce": _collective("all_reduce"),
    "all-gather": _collective("all_gather"),
    "reduce-scatter": _collective("reduce_scatter"),
    "gather": _gather,
    "tuple": _tuple,
    "get-tuple-element": _get_tuple_element,
    "custom-call": _custom_call,
}
