"""Lower a parsed HLO module into the shardproof IR, for one rank.

`_LOWER` maps each opcode to a small function that emits IR through a GraphBuilder. An SPMD
module (one program for all ranks, as Neuron emits) is lowered once per rank: only collectives
depend on the rank (which replica group it is in). Constants whose values the dump elides
(`constant({...})`) become graph inputs, matched to the reference's like parameters.
"""

from __future__ import annotations

import itertools
import math
import re
from typing import Callable

import torch

from shardproof.errors import GraphFileError, UnsupportedOp
from shardproof.importers.graph_inputs import ImportedGraph
from shardproof.importers.hlo_sharding import Tiling, gspmd_tiling, sdy_meshes, sdy_tilings
from shardproof.importers.hlo_text import (
    HloModule,
    HloType,
    Instruction,
    SourceFrame,
    groups,
    int_list,
    parse_hlo,
    slice_ranges,
    unquote,
)
from shardproof.ir.aten_ops import Operand
from shardproof.importers.text import read_text
from shardproof.ir.build import GraphBuilder
from shardproof.ir.check import Inconsistent, check_node
from shardproof.ir.graph import Graph, Location
from shardproof.ir.ops import OPS, run_op
from shardproof.ir.run import constant

Value = int | tuple  # an IR node id, or a tuple of values for tuple-shaped instructions


def load_hlo(path: str) -> HloModule:
    return parse_hlo(read_text(path), path)


def world_size_of(module: HloModule) -> int | None:
    """The number of ranks an SPMD module runs on: `num_partitions=` when the module says, else
    the ranks its collectives span."""
    stated = re.search(r"\bnum_partitions=(\d+)", module.header)
    if stated and int(stated.group(1)) > 1:
        return int(stated.group(1))
    members = [r for c in module.computations.values() for i in c.instructions for g in _replica_groups(i, module.path) for r in g]
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
        self.meshes = sdy_meshes(module.header)
        self.sites = _Sites(module)
        self.caller: Location | None = None  # where the call being inlined is located
        self.instructions = {i.name: i for c in module.computations.values() for i in c.instructions}
        self.partitioned = self._partitioned()

    def run(self) -> ImportedGraph:
        entry = self.module.entry_computation
        parameters = sorted((i for i in entry.instructions if i.opcode == "parameter"), key=lambda i: int(i.literal))
        arguments = [self.parameter(i) for i in parameters]
        root = self.computation(entry.name, arguments)
        if self.partitioned and "sharding" in entry.root.attrs and entry.root.opcode != "tuple":
            self.b.at(entry.root.name, self.locate(entry.root))
            root = self.gather(root, self.tiling(entry.root.attrs["sharding"], entry.root))
        self.graph.outputs = list(_flatten(root))
        return self.imported

    def parameter(self, instruction: Instruction) -> int:
        """An entry parameter; one that states a sharding in a partitioned module is the rank's
        tile of a global input, cut here, so the inputs relate to the reference's as stated."""
        self.b.at(instruction.name, self.locate(instruction))
        name = _op_name(instruction)
        if name:
            self.imported.labels[instruction.name] = name
        dims, dtype = instruction.type.dims, instruction.type.dtype
        tiling = self.tiling(instruction.attrs["sharding"], instruction) if "sharding" in instruction.attrs and self.partitioned else None
        if tiling is None or not tiling.sharded:
            return self.imported.add_input(instruction.name, dims, dtype)
        full = tuple(size * count for size, (_, count, _) in zip(dims, tiling.dims))
        for dim, (index, count, members) in enumerate(tiling.dims):
            if count > 1:
                self.imported.split_along(instruction.name, dim, (index, members))
        return self.cut(self.imported.add_input(instruction.name, full, dtype), tiling)

    def _partitioned(self) -> bool:
        """Whether parameters are already each rank's tiles: a module run on several ranks whose
        shardings are no longer annotations for a partitioner to come (Shardy's meshes on the
        module line, GSPMD's `Sharding` custom calls)."""
        if (world_size_of(self.module) or 1) == 1 or self.rank is None or "xla.sdy.meshes" in self.module.header:
            return False
        return not any(i.attrs.get("custom_call_target") == '"Sharding"' for i in self.instructions.values())

    def computation(self, name: str, arguments: list[Value]) -> Value:
        """Lower a computation on these arguments, in its own scope: `call`, `fusion` and the
        entry all come through here, so a called computation is inlined at each call."""
        computation = self.module.computations.get(name.lstrip("%"))
        if computation is None:
            raise GraphFileError(self.module.path, 0, f"a computation named {name}", name)
        outer, self.env = self.env, {}
        try:
            for instruction in computation.instructions:
                if instruction.opcode == "parameter":
                    self.env[instruction.name] = arguments[int(instruction.literal)]
                    continue
                self.env[instruction.name] = self.lowered(instruction)
            return self.env[computation.root.name]
        finally:
            self.env = outer

    def lowered(self, instruction: Instruction) -> Value:
        """The instruction's IR, every node checked against its operands and the result against the
        declared type: a dump that contradicts itself is refused at its line."""
        self.b.at(instruction.name, self.locate(instruction))
        lower = _LOWER.get(instruction.opcode)
        if lower is None:
            raise UnsupportedOp(f"HLO {instruction.opcode}", f"{self.module.path}:{instruction.line}")
        before = len(self.graph.nodes)
        try:
            value = lower(self, instruction)
            for node in self.graph.nodes[before:]:
                check_node(self.graph, node)
        except Inconsistent as err:
            raise GraphFileError(self.module.path, instruction.line, str(err), f"{instruction.opcode} %{instruction.name}") from None
        except (ValueError, IndexError, KeyError, ZeroDivisionError, RuntimeError) as err:
            # attributes that do not fit the operands (a dim past their rank, a number that is none)
            raise GraphFileError(
                self.module.path, instruction.line, f"a `{instruction.opcode}` whose attributes fit its operands "
                f"({type(err).__name__}: {err})", f"%{instruction.name}",
            ) from None
        self.declared(instruction, value, instruction.type)
        return value

    def declared(self, instruction: Instruction, value: Value, declared: HloType) -> None:
        """The value has the shape (or tuple structure) the instruction declares."""
        if declared.dtype == "tuple":
            if not isinstance(value, tuple) or len(value) != len(declared.elements):
                raise GraphFileError(self.module.path, instruction.line, f"a tuple of {len(declared.elements)} as declared", f"%{instruction.name}")
            for element, of in zip(value, declared.elements):
                self.declared(instruction, element, of)
        elif isinstance(value, tuple) or self.graph[value].shape != declared.dims:
            computed = "a tuple" if isinstance(value, tuple) else str(list(self.graph[value].shape))
            raise GraphFileError(
                self.module.path, instruction.line, f"the declared shape {list(declared.dims)}, but `{instruction.opcode}` computes "
                f"{computed} from its operands", f"%{instruction.name}",
            )

    # --- helpers ------------------------------------------------------------------------------
    def operand(self, instruction: Instruction, index: int) -> int:
        value = self.env[instruction.operands[index]]
        if not isinstance(value, int):
            raise GraphFileError(self.module.path, instruction.line, "an array operand", instruction.operands[index])
        return value

    def operands(self, instruction: Instruction, count: int | None = None) -> list[int]:
        """All operands, as arrays; `count` of them when the opcode takes that many."""
        if count is not None and len(instruction.operands) != count:
            raise GraphFileError(
                self.module.path, instruction.line, f"{count} operand{'s' if count > 1 else ''} for `{instruction.opcode}`",
                f"{len(instruction.operands)}",
            )
        return [self.operand(instruction, i) for i in range(len(instruction.operands))]

    def only(self, instruction: Instruction) -> int:
        return self.operands(instruction, 1)[0]

    def attr(self, instruction: Instruction, key: str) -> str:
        if key not in instruction.attrs:
            raise GraphFileError(self.module.path, instruction.line, f"attribute `{key}=` on {instruction.opcode}", instruction.name)
        return instruction.attrs[key]

    def locate(self, instruction: Instruction) -> Location:
        code = f"{instruction.opcode}({', '.join('%' + o for o in instruction.operands)})"
        frame = self.sites.frame(instruction)
        if frame is None:
            return self.caller or Location(self.module.path, instruction.line, code)
        return Location(frame[0], frame[1], code)

    def group(self, instruction: Instruction) -> tuple[int, ...]:
        found = _replica_groups(instruction, self.module.path)
        if not found:
            return tuple(range(self.world_size))
        members = [r for g in found for r in g]
        if len(set(members)) != len(members) or not all(0 <= r < self.world_size for r in members):
            raise GraphFileError(self.module.path, instruction.line, f"replica groups holding each of ranks 0..{self.world_size - 1} at most once", str(found))
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
        parameters = {i.name for i in computation.instructions if i.opcode == "parameter"}
        if len(parameters) != 2 or set(computation.root.operands) != parameters:
            raise GraphFileError(
                self.module.path, computation.root.line, f"a reducer combining its two parameters ({', '.join(sorted(parameters))})",
                ", ".join(computation.root.operands),
            )
        if opcode not in _REDUCERS:
            raise UnsupportedOp(f"HLO reduction by `{opcode}`", f"{self.module.path}:{instruction.line}")
        return _REDUCERS[opcode]

    def tiling(self, sharding: str, instruction: Instruction) -> Tiling:
        tiling = gspmd_tiling(sharding, self.rank or 0, len(instruction.type.dims))
        if tiling is None:
            raise UnsupportedOp(f"HLO sharding {sharding}", f"{self.module.path}:{instruction.line}")
        return tiling

    def cut(self, value: int, tiling: Tiling) -> int:
        """This rank's tile of a global array."""
        for dim, (index, count, _) in enumerate(tiling.dims):
            if count > 1:
                size = self.b.shape(value)[dim] // count
                value = self.b.slice(value, dim, index * size, (index + 1) * size)
        return value

    def gather(self, value: int, tiling: Tiling) -> int:
        """The global array from every rank's tile: an all-gather along each split dim."""
        for dim, (_, count, members) in enumerate(tiling.dims):
            if count > 1:
                shape = list(self.b.shape(value))
                shape[dim] *= count
                value = self.b.add("all_gather", (value,), (dim, members), tuple(shape), self.b.dtype(value))
        return value

    def module_instruction(self, name: str) -> Instruction | None:
        return self.instructions.get(name)

    def module_type(self, name: str):
        instruction = self.instructions.get(name)
        return instruction.type if instruction is not None else None

    def sdy(self, instruction: Instruction, key: str, ndims: list[int]) -> list[Tiling]:
        text = re.search(key.replace(".", r"\.") + r'="((?:[^"\\]|\\.)*)"', instruction.attrs.get("frontend_attributes", ""))
        tilings = sdy_tilings(text.group(1), self.meshes, self.rank or 0, ndims) if text else None
        if tilings is None:
            raise UnsupportedOp(f"HLO custom-call without a readable `{key}`", f"{self.module.path}:{instruction.line}")
        return tilings

    def static(self, value: int) -> int | None:
        """The integer a scalar computes when it depends on constants and the rank alone (a
        rank's slice offset: `partition-id` times a size), else None."""
        ancestors = self.graph.ancestors(self.graph[value])
        if len(ancestors) > 64 or any(OPS[n.op].kind in ("leaf", "collective", "call", "random") for n in ancestors):
            return None
        values: dict[int, torch.Tensor] = {}
        for node in ancestors:
            values[node.id] = constant(node) if node.op == "const" else run_op(node.op, [values[i] for i in node.inputs], node.attrs)
        return int(values[value].reshape(-1)[0])


class _Sites:
    """Where each instruction is in the user's code, from its metadata: a stack frame of the
    module's tables (`stack_frame_id=N`) or `source_file=`/`source_line=`.

    The site is the innermost user frame, except for a value returned out of a helper (a function
    the module calls from several lines): that is located at the line that called the helper, in
    the caller, where a reduction missing from between the helper's result and its use belongs."""

    def __init__(self, module: HloModule):
        self.module = module
        self.user_frames: dict[int, list[SourceFrame]] = {}  # stack frame id -> its frames in user code
        self.users: dict[str, list[Instruction]] = {}
        self.callers: dict[tuple[str, str], set[tuple[str, int]]] = {}
        calls: dict[str, list[str]] = {}  # computation -> the instructions that call it
        for computation in module.computations.values():
            for instruction in computation.instructions:
                for operand in instruction.operands:
                    self.users.setdefault(operand, []).append(instruction)
                target = instruction.attrs.get("calls") or (instruction.attrs.get("to_apply") if instruction.opcode == "call" else None)
                if target:
                    calls.setdefault(target.lstrip("%"), []).append(instruction.name)
                stack = self.stack(instruction)
                for caller, callee in zip(stack, stack[1:]):
                    self.callers.setdefault(_function(callee), set()).add((caller.file, caller.line))
        for name, callers in calls.items():  # a called computation's result is used where its callers' are
            computation = module.computations.get(name)
            if computation is not None:
                used = [u for c in callers for u in self.users.get(c, [])]
                self.users.setdefault(computation.root.name, []).extend(used)

    def stack(self, instruction: Instruction) -> list[SourceFrame]:
        frame_id = re.search(r"stack_frame_id=(\d+)", instruction.attrs.get("metadata", ""))
        if frame_id is None:
            return []
        number = int(frame_id.group(1))
        if number not in self.user_frames:  # the frames in the user's code, not in jax or installed packages
            self.user_frames[number] = [f for f in self.module.stack(number) if not _library(f.file)]
        return self.user_frames[number]

    def frame(self, instruction: Instruction) -> tuple[str, int] | None:
        stack = self.stack(instruction)
        if not stack:
            return _user_frame(instruction.attrs.get("metadata", ""))
        shared = len(stack)  # how deep the value's users share its stack
        for user in self.users.get(instruction.name, []):
            theirs = self.stack(user)
            if theirs:
                common = 0
                while common < min(len(stack), len(theirs)) and _function(stack[common]) == _function(theirs[common]):
                    common += 1
                shared = min(shared, common)
        depth = len(stack)
        while depth > 1 and shared < depth and len(self.callers.get(_function(stack[depth - 1]), ())) > 1:
            depth -= 1
        site = stack[depth - 1]
        return site.file, site.line


def _function(frame: SourceFrame) -> tuple[str, str]:
    return frame.file, frame.function


def _library(path: str) -> bool:
    return "-packages/" in path or "/jax/_src/" in path


def _op_name(instruction: Instruction) -> str:
    match = re.search(r'op_name="((?:[^"\\]|\\.)*)"', instruction.attrs.get("metadata", ""))
    return unquote(f'"{match.group(1)}"') if match else ""


_REDUCERS = {"add": "sum", "maximum": "amax"}
_NEUTRAL = {"sum": 0.0, "amax": -math.inf}


def _replica_groups(instruction: Instruction, path: str) -> list[tuple[int, ...]]:
    text = instruction.attrs.get("replica_groups")
    try:
        return groups(text) if text else []
    except (ValueError, IndexError):
        raise GraphFileError(path, instruction.line, "replica groups like {{0,1},{2,3}}", text) from None


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
        _same_shapes(lo, ins, args)
        return lo.b.add(op, tuple(args), (), ins.type.dims, ins.type.dtype)

    return lower


def _same_shapes(lo: _Lowering, ins: Instruction, args: list[int]) -> None:
    """HLO elementwise operands have the instruction's shape: it never broadcasts implicitly."""
    for arg in args:
        if lo.b.shape(arg) != ins.type.dims:
            raise GraphFileError(
                lo.module.path, ins.line, f"operands of the declared shape {list(ins.type.dims)} (HLO does not broadcast)",
                str(list(lo.b.shape(arg))),
            )


def _subtract(lo: _Lowering, ins: Instruction) -> int:
    a, b = lo.operands(ins, 2)
    _same_shapes(lo, ins, [a, b])
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
    value, dims = lo.only(ins), int_list(ins.attrs.get("dimensions", "{}"))
    placed = tuple(ins.type.dims[d] for d in dims)
    if placed != lo.b.shape(value) or len(set(dims)) != len(dims):
        raise GraphFileError(
            lo.module.path, ins.line, f"operand dims {list(lo.b.shape(value))} at distinct dims={{{','.join(map(str, dims))}}} of "
            f"{list(ins.type.dims)}", str(list(placed)),
        )
    return lo.b.place(value, ins.type.dims, dims)


def _reshape(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.view(lo.only(ins), ins.type.dims)


def _transpose(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.permute(lo.only(ins), int_list(lo.attr(ins, "dimensions")))


def _convert(lo: _Lowering, ins: Instruction) -> int:
    return lo.b.convert(lo.only(ins), ins.type.dtype)


def _identity(lo: _Lowering, ins: Instruction) -> int:
    return lo.only(ins)


def _slice(lo: _Lowering, ins: Instruction) -> int:
    value = lo.only(ins)
    ranges = slice_ranges(lo.attr(ins, "slice"))
    if len(ranges) != len(lo.b.shape(value)):
        raise GraphFileError(lo.module.path, ins.line, f"one [start:end] per operand dim ({len(lo.b.shape(value))})", str(len(ranges)))
    for dim, (start, end, stride) in enumerate(ranges):
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
    lhs, rhs = lo.operands(ins, 2)
    dims = {k: int_list(ins.attrs.get(k, "{}")) for k in ("lhs_batch_dims", "rhs_batch_dims", "lhs_contracting_dims", "rhs_contracting_dims")}
    lb, rb, lc, rc = dims["lhs_batch_dims"], dims["rhs_batch_dims"], dims["lhs_contracting_dims"], dims["rhs_contracting_dims"]
    ls, rs = lo.b.shape(lhs), lo.b.shape(rhs)
    lf = tuple(d for d in range(len(ls)) if d not in lb + lc)
    rf = tuple(d for d in range(len(rs)) if d not in rb + rc)
    computed = tuple(ls[d] for d in lb + lf) + tuple(rs[d] for d in rf)
    if [ls[d] for d in lb + lc] != [rs[d] for d in rb + rc] or computed != ins.type.dims:
        raise GraphFileError(
            lo.module.path, ins.line, f"batch and contracting dims of equal sizes and the shape they give, {list(computed)}",
            f"{list(ls)} x {list(rs)} -> {list(ins.type.dims)}",
        )
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
    args = lo.operands(ins, 3)
    _same_shapes(lo, ins, args[1:] if lo.b.shape(args[0]) == () else args)
    return lo.b.add("where", tuple(args), (), ins.type.dims, ins.type.dtype)


def _collective(op: str) -> Callable[[_Lowering, Instruction], Value]:
    """all-reduce / all-gather / reduce-scatter over this rank's replica group, of each operand
    (XLA combines several into one instruction returning a tuple); over a group of one rank each
    is the identity."""

    def lower(lo: _Lowering, ins: Instruction) -> Value:
        group = lo.group(ins)
        types = ins.type.elements if ins.type.dtype == "tuple" else (ins.type,)
        results = []
        for index, out in enumerate(types):
            value = lo.operand(ins, index)
            if len(group) == 1:
                results.append(value)
                continue
            reduce_op = {"sum": "sum", "amax": "max"}[lo.reducer(ins)] if op != "all_gather" else None
            dim = int_list(lo.attr(ins, "dimensions"))[0] if op != "all_reduce" else None
            attrs = {"all_reduce": (reduce_op, group), "all_gather": (dim, group), "reduce_scatter": (dim, reduce_op, group)}[op]
            results.append(lo.b.add(op, (value,), attrs, out.dims, out.dtype))
        return tuple(results) if ins.type.dtype == "tuple" else results[0]

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


def _bitcast(lo: _Lowering, ins: Instruction) -> int:
    """A bitcast reinterprets memory: with layouts it is the operand in its physical dim order,
    reshaped to the result's physical dims, then put back in the result's logical order; a
    row-major reshape only when both layouts are the default."""
    source = lo.module_type(ins.operands[0])
    value = lo.operand(ins, 0)
    physical_in = source.physical_order if source is not None else tuple(range(len(lo.b.shape(value))))
    physical_out = ins.type.physical_order
    moved = lo.b.permute(value, physical_in)
    laid = lo.b.view(moved, tuple(ins.type.dims[d] for d in physical_out))
    return lo.b.permute(laid, tuple(physical_out.index(d) for d in range(len(physical_out))))


def _call(lo: _Lowering, ins: Instruction) -> Value:
    """`call` and `fusion`: the called computation inlined on the operands."""
    target = ins.attrs.get("to_apply") or lo.attr(ins, "calls")
    outer, lo.caller = lo.caller, lo.b.loc
    try:
        return lo.computation(target, [lo.env[name] for name in ins.operands])
    finally:
        lo.caller = outer


def _partition_id(lo: _Lowering, ins: Instruction) -> int:
    if lo.rank is None:
        raise UnsupportedOp("HLO partition-id in a module run on one device", f"{lo.module.path}:{ins.line}")
    return lo.b.full(lo.rank, ins.type.dims, ins.type.dtype)


def _replica_id(lo: _Lowering, ins: Instruction) -> int:
    """SPMD programs run as partitions of one replica."""
    return lo.b.full(0, ins.type.dims, ins.type.dtype)


def _starts(lo: _Lowering, ins: Instruction, first: int, sizes: tuple[int, ...], shape: tuple[int, ...]) -> list[int]:
    """The start indices of a dynamic slice or update, each known from constants and the rank,
    clamped into range as XLA does."""
    starts = []
    for dim, operand in enumerate(ins.operands[first:]):
        start = lo.static(lo.env[operand])
        if start is None:
            raise UnsupportedOp(f"HLO {ins.opcode} at an offset computed from data", f"{lo.module.path}:{ins.line}")
        starts.append(min(max(start, 0), shape[dim] - sizes[dim]))
    return starts


def _dynamic_slice(lo: _Lowering, ins: Instruction) -> int:
    value = lo.operand(ins, 0)
    sizes = int_list(lo.attr(ins, "dynamic_slice_sizes"))
    starts = _starts(lo, ins, 1, sizes, lo.b.shape(value))
    lo.b.at(ins.name, _offset_site(lo, ins.operands[1:]) or lo.b.loc)
    for dim, start in enumerate(starts):
        value = lo.b.slice(value, dim, start, start + sizes[dim])
    return value


def _offset_site(lo: _Lowering, operands: list[str]) -> Location | None:
    """Where the user computed a slice's offsets, when on another line of the slice's file than
    the slice (`start = axis_index(...) * chunk` before `dynamic_slice(x, start, ...)`): the
    slice's site, since a rank's slice at a wrong offset is fixed where the offset is computed."""
    own = lo.b.loc
    if own is None:
        return None
    computed = [
        node for operand in operands for node in lo.graph.ancestors(lo.graph[lo.env[operand]])
        if node.op not in ("leaf", "const") and node.loc is not None and node.loc.file == own.file and node.loc.line != own.line
    ]
    latest = max(computed, key=lambda node: node.id, default=None)
    return None if latest is None else Location(own.file, latest.loc.line, own.code)


def _dynamic_update_slice(lo: _Lowering, ins: Instruction) -> int:
    value, update = lo.operand(ins, 0), lo.operand(ins, 1)
    starts = _starts(lo, ins, 2, lo.b.shape(update), lo.b.shape(value))

    def paste(base: int, dim: int) -> int:
        if dim == len(starts):
            return update
        start, size, whole = starts[dim], lo.b.shape(update)[dim], lo.b.shape(base)[dim]
        middle = paste(lo.b.slice(base, dim, start, start + size), dim + 1)
        parts = [lo.b.slice(base, dim, 0, start)] if start else []
        parts.append(middle)
        if start + size < whole:
            parts.append(lo.b.slice(base, dim, start + size, whole))
        return lo.b.cat(parts, dim) if len(parts) > 1 else middle

    return paste(value, 0)


def _pad(lo: _Lowering, ins: Instruction) -> int:
    """`padding=lo_hi[_interior]x...`: edge padding by the pad value (negative: a slice)."""
    value, pad_value = lo.operands(ins)
    for dim, spec in enumerate(lo.attr(ins, "padding").split("x")):
        low, high, *interior = (int(n) for n in spec.split("_"))
        if interior and interior[0]:
            raise UnsupportedOp("HLO pad with interior padding", f"{lo.module.path}:{ins.line}")
        size = lo.b.shape(value)[dim]
        value = lo.b.slice(value, dim, max(-low, 0), size - max(-high, 0))
        parts = []
        for amount in (low, None, high):
            if amount is None:
                parts.append(value)
            elif amount > 0:
                shape = list(lo.b.shape(value))
                shape[dim] = amount
                parts.append(lo.b.broadcast_to(pad_value, tuple(shape)))
        value = lo.b.cat(parts, dim) if len(parts) > 1 else value
    return value


def _reduce_window(lo: _Lowering, ins: Instruction) -> int:
    """A windowed reduction with unit strides (a cumulative sum): the padded operand's shifted
    windows, one slice per window offset, combined elementwise."""
    value, init = lo.operands(ins)
    window = _fields(lo.attr(ins, "window"))
    size = window.get("size", [])
    if any(v != 1 for key in ("stride", "lhs_dilate", "rhs_dilate") for v in window.get(key, [])):
        raise UnsupportedOp("HLO reduce-window with strides or dilation", f"{lo.module.path}:{ins.line}")
    combine = {"sum": "add", "amax": "maximum"}[lo.reducer(ins)]
    for dim, (low, high) in enumerate(window.get("pad", [(0, 0)] * len(size))):
        if low or high:
            shape = list(lo.b.shape(value))
            parts = []
            for amount in (low, None, high):
                if amount is None:
                    parts.append(value)
                elif amount:
                    shape[dim] = amount
                    parts.append(lo.b.broadcast_to(init, tuple(shape)))
            value = lo.b.cat(parts, dim)
    out = ins.type.dims
    result = None
    for offsets in itertools.product(*(range(w) for w in size)):
        part = value
        for dim, k in enumerate(offsets):
            part = lo.b.slice(part, dim, k, k + out[dim])
        result = part if result is None else lo.b.binary(combine, result, part)
    return result


def _fields(text: str) -> dict[str, list]:
    """`{size=1x3 pad=0_2x0_0}` -> {"size": [1, 3], "pad": [(0, 2), (0, 0)]}."""
    out: dict[str, list] = {}
    for key, value in re.findall(r"(\w+)=([\d_x\-]+)", text):
        parts = value.split("x")
        out[key] = [tuple(int(n) for n in p.split("_")) for p in parts] if "_" in value else [int(p) for p in parts]
    return out


def _all_to_all(lo: _Lowering, ins: Instruction) -> int:
    """Split along `dimensions`, chunk j to rank j of the group, received chunks concatenated in
    rank order: rank r's result is chunk r of every rank's tensor, which is chunk r of each block
    of the all-gather."""
    if len(ins.operands) != 1 or "dimensions" not in ins.attrs:
        raise UnsupportedOp("HLO all-to-all over a tuple", f"{lo.module.path}:{ins.line}")
    value = lo.operand(ins, 0)
    (dim,) = int_list(ins.attrs["dimensions"])
    group = lo.group(ins)
    n, size = len(group), lo.b.shape(value)[dim]
    shape = list(lo.b.shape(value))
    shape[dim] *= n
    gathered = lo.b.add("all_gather", (value,), (dim, group), tuple(shape), lo.b.dtype(value))
    me, chunk = group.index(lo.rank), size // n
    return lo.b.cat([lo.b.slice(gathered, dim, j * size + me * chunk, j * size + (me + 1) * chunk) for j in range(n)], dim)


def _collective_permute(lo: _Lowering, ins: Instruction) -> int:
    """Each rank receives the tensor of its source in `source_target_pairs` (zeros if none): the
    source's block of an all-gather over every rank."""
    value = lo.operand(ins, 0)
    sources = [s for s, t in groups(lo.attr(ins, "source_target_pairs")) if t == lo.rank]
    if not sources:
        return lo.b.full(0, ins.type.dims, ins.type.dtype)
    shape = lo.b.shape(value)
    ranks = tuple(range(lo.world_size))
    stacked = lo.b.view(value, (1,) + shape)
    gathered = lo.b.add("all_gather", (stacked,), (0, ranks), (len(ranks),) + shape, lo.b.dtype(value))
    return lo.b.view(lo.b.slice(gathered, 0, sources[0], sources[0] + 1), shape)


def _open(op: str, order: tuple[int, ...] | None = None) -> Callable[[_Lowering, Instruction], int]:
    """An elementwise HLO op with a torch twin: the open op of that name (`ir/aten_ops.py`), its
    operands in `order` when torch takes them in another."""

    def lower(lo: _Lowering, ins: Instruction) -> int:
        args = lo.operands(ins)
        args = [args[i] for i in order] if order else args
        return lo.b.add(op, tuple(args), (tuple(Operand(i) for i in range(len(args))), (), ()), ins.type.dims, ins.type.dtype)

    return lower


def _shift_right_logical(lo: _Lowering, ins: Instruction) -> int:
    """Equal to the arithmetic shift on unsigned types (held in wider signed IR dtypes, never negative)."""
    if not ins.type.element.startswith("u"):
        raise UnsupportedOp(f"HLO shift-right-logical on signed {ins.type.element}", f"{lo.module.path}:{ins.line}")
    return _open("aten.bitwise_right_shift.Tensor")(lo, ins)


def _global_to_local(lo: _Lowering, ins: Instruction) -> Value:
    """Shardy's entry to a `shard_map` body: each operand's tile for this rank, as `in_shardings` state."""
    values = [lo.env[name] for name in ins.operands]
    tilings = lo.sdy(ins, "xla.sdy.in_shardings", [len(lo.b.shape(v)) for v in values])
    cut = tuple(lo.cut(v, t) for v, t in zip(values, tilings))
    return cut if ins.type.dtype == "tuple" else cut[0]


def _local_to_global(lo: _Lowering, ins: Instruction) -> Value:
    """Shardy's exit from a `shard_map` body: the global arrays, gathered as `out_shardings` state."""
    values = [lo.env[name] for name in ins.operands]
    tilings = lo.sdy(ins, "xla.sdy.out_shardings", [len(lo.b.shape(v)) for v in values])
    gathered = tuple(lo.gather(v, t) for v, t in zip(values, tilings))
    return gathered if ins.type.dtype == "tuple" else gathered[0]


def _full_to_shard(lo: _Lowering, ins: Instruction) -> int:
    """GSPMD's entry to a manual region: the tile the operand's `Sharding` annotation states."""
    source = lo.module_instruction(ins.operands[0])
    if source is None or "sharding" not in source.attrs:
        raise UnsupportedOp("HLO SPMDFullToShardShape of an operand without a sharding", f"{lo.module.path}:{ins.line}")
    return lo.cut(lo.operand(ins, 0), lo.tiling(source.attrs["sharding"], source))


def _shard_to_full(lo: _Lowering, ins: Instruction) -> int:
    return lo.gather(lo.operand(ins, 0), lo.tiling(lo.attr(ins, "sharding"), ins))


def _tuple(lo: _Lowering, ins: Instruction) -> tuple:
    return tuple(lo.env[name] for name in ins.operands)


def _get_tuple_element(lo: _Lowering, ins: Instruction) -> Value:
    value, index = lo.env[ins.operands[0]], int(lo.attr(ins, "index"))
    if not isinstance(value, tuple) or not 0 <= index < len(value):
        raise GraphFileError(lo.module.path, ins.line, "an index into a tuple operand", f"index={index}")
    return value[index]


def _custom_call(lo: _Lowering, ins: Instruction) -> Value:
    target = unquote(lo.attr(ins, "custom_call_target"))
    lower = _CUSTOM_CALLS.get(target)
    if lower is None:
        raise UnsupportedOp(f"HLO custom-call `{target}`", f"{lo.module.path}:{ins.line}")
    return lower(lo, ins)


def _neuron_rms_norm(lo: _Lowering, ins: Instruction) -> int:
    """AwsNeuronRmsNorm(x, weight, eps): backend_config holds the normalised dim."""
    x, weight, eps = lo.operands(ins, 3)
    node = lo.graph[eps]
    if node.op != "const" or node.attrs[0][0] != "full":
        raise UnsupportedOp("AwsNeuronRmsNorm with a non-constant epsilon", f"{lo.module.path}:{ins.line}")
    dim = int(unquote(ins.attrs.get("backend_config", '"2"')) or 2)
    return lo.b.convert(lo.b.rms_norm(x, weight, (dim,), node.attrs[0][1]), ins.type.dtype)


_CUSTOM_CALLS: dict[str, Callable[[_Lowering, Instruction], Value]] = {
    "AwsNeuronTransferWithStaticRing": _identity,  # moves a weight into device memory
    "AwsNeuronRmsNorm": _neuron_rms_norm,
    "Sharding": _identity,  # an annotation: the value, laid out as its `sharding=` says
    "xla.sdy.FuncResultSharding": _identity,
    "xla.sdy.GlobalToLocalShape": _global_to_local,
    "xla.sdy.LocalToGlobalShape": _local_to_global,
    "SPMDFullToShardShape": _full_to_shard,
    "SPMDShardToFullShape": _shard_to_full,
}

_LOWER: dict[str, Callable[[_Lowering, Instruction], Value]] = {
    "constant": _constant,
    "iota": _iota,
    "broadcast": _broadcast,
    "reshape": _reshape,
    "bitcast": _bitcast,
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
    "call": _call,
    "fusion": _call,
    "partition-id": _partition_id,
    "replica-id": _replica_id,
    "dynamic-slice": _dynamic_slice,
    "dynamic-update-slice": _dynamic_update_slice,
    "pad": _pad,
    "reduce-window": _reduce_window,
    "all-to-all": _all_to_all,
    "collective-permute": _collective_permute,
    "clamp": _open("aten.clamp.Tensor", (1, 0, 2)),  # clamp(min, x, max)
    "shift-right-logical": _shift_right_logical,
    "erf": _elementwise("erf"),
    "opt-barrier": _identity,
    **{name: _open(op) for name, op in {
        "remainder": "aten.fmod.Tensor", "sign": "aten.sign.default", "power": "aten.pow.Tensor_Tensor",
        "exponential-minus-one": "aten.expm1.default", "log-plus-one": "aten.log1p.default", "floor": "aten.floor.default",
        "ceil": "aten.ceil.default", "round-nearest-even": "aten.round.default", "is-finite": "aten.isfinite.default",
        "atan2": "aten.atan2.default", "xor": "aten.bitwise_xor.Tensor", "shift-left": "aten.bitwise_left_shift.Tensor",
        "shift-right-arithmetic": "aten.bitwise_right_shift.Tensor", "tan": "aten.tan.default", 
    }.items() },  # fmt: skip
}
