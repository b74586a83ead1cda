"""Lower an aten FX graph (from make_fx) into the shardproof IR.

Aten has hundreds of ops; many are spellings of a few meanings (t/transpose/permute are all
`permute`, view/reshape/squeeze/unsqueeze/flatten are all `view`, ...). The table `_LOWER` maps
those onto the IR ops whose distribution laws are written by hand. Every other op, and every call
a hand lowering declines (`Declined`: a strided slice, a tensor exponent), is broken into smaller
ops by torch's own decompositions where torch has one (`ir/decompose.py`), else kept whole as an
open op under its own name (`ir/aten_ops.py`): nothing a program can run is refused.

The graph is not functionalized by torch (functionalize rejects DTensor's autograd.Functions);
the lowering does it. make_fx routes every later read of a written tensor through the writing
node, so an in-place op lowers as its out-of-place meaning; a write into memory that older nodes
still read (its base, other views: `out[..., a:b] = shard`, an all-reduce of a flat view of a
gradient) is scattered back into the memory's root and those views are read again from it
(`Lowerer.written_back`, the alias structure in `ir/aliasing.py`).
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from shardproof.errors import UnsupportedOp
from shardproof.ir import aten_ops
from shardproof.ir.aliasing import IDENTITY, PART, Step, Views, written_by_collective
from shardproof.ir.all_to_all import even_splits
from shardproof.ir.decompose import decomposed_graph, decomposition_of
from shardproof.ir.graph import Graph, Location
from shardproof.ir.rank_expr import RankExpr, mentions_rank, rank_origins

Value = Any  # an IR node id, or a (nested) tuple of them for multi-output ops
LocationOf = Callable[[fx.Node], Location | None]


class Lowerer:
    """Walks one FX graph in order and emits IR nodes into `graph`."""

    def __init__(
        self,
        gm: fx.GraphModule,
        leaf_names: list[str],
        locate: LocationOf,
        reduce_ops: list[str],
        group_ranks: Callable[[Any], tuple[int, ...]],
        rank: int | None,
    ):
        self.gm = gm
        self.graph = Graph(rank=rank)
        self.leaf_names = leaf_names
        self.locate = locate
        self.reduce_ops = list(reduce_ops)  # c10d in-place collectives' ops, in call order
        self._group_ranks = group_ranks
        self.env: dict[fx.Node, Value] = {}
        self.current: fx.Node | None = None
        self._scalars: dict[tuple, int] = {}
        self._silent: dict[tuple[str, int], tuple[Location, int]] = {}  # backward lines whose ops emitted nothing
        self.site: fx.Node | None = None  # the node whose decomposition is being lowered: its line is every piece's
        self._decomposing: list[Any] = []  # targets being decomposed (a decomposition may call its own op)

    # --- emitting -------------------------------------------------------------------------
    def emit(self, op: str, inputs: tuple[int, ...], attrs: tuple = (), shape=None, dtype=None) -> int:
        node = self.current
        val = node.meta.get("val") if node is not None else None
        if shape is None:
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else ()
        if dtype is None:
            dtype = str(val.dtype).removeprefix("torch.") if isinstance(val, torch.Tensor) else "float32"
        site = self.site or node
        name = site.name if site is not None else op
        return self.graph.add(op, inputs, attrs, shape, dtype, name, self._with_rank_chosen(self.location(node), attrs, inputs))

    def _with_rank_chosen(self, loc: Location | None, attrs: tuple, inputs: tuple[int, ...]) -> Location | None:
        """`loc`, with the line that chose the rank its offsets (its attrs', its scalar operands',
        those of the ops its line made before it) stand for, when another (see `Location.rank_chosen`)."""
        operands = [self.graph[i] for i in inputs]
        held = (attrs, [o.attrs for o in operands if o.op == "const"])
        chosen = {o for o in rank_origins(held) if o is not None}
        chosen |= {o.loc.rank_chosen for o in operands if o.loc and o.loc.rank_chosen and loc and (o.loc.file, o.loc.line) == (loc.file, loc.line)}
        if loc is None or len(chosen) != 1 or next(iter(chosen)).line == loc.line:
            return loc
        return replace(loc, rank_chosen=next(iter(chosen)))

    def location(self, node: fx.Node | None) -> Location | None:
        """Where the user wrote `node`: inside a decomposition, where they wrote the op decomposed."""
        site = self.site or node
        return self.locate(site) if site is not None else None

    def group_ranks(self, group: Any) -> tuple[int, ...]:
        return self._group_ranks(self.env[group] if isinstance(group, fx.Node) else group)

    def shape(self, value: int) -> tuple[int, ...]:
        return self.graph[value].shape

    def dtype(self, value: int) -> str:
        return self.graph[value].dtype

    def scalar(self, value: float | int | bool | RankExpr, dtype: str | None = None) -> int:
        """A 0-d constant; python numbers in aten calls become these (a symbolic rank's too: its
        value is taken at each rank)."""
        symbolic = isinstance(value, RankExpr)
        dtype = dtype or ("bool" if isinstance(value, bool) else "int64" if symbolic or isinstance(value, int) else "float32")
        key = (("rank", value.form) if symbolic else value, dtype)  # a RankExpr compared to an int would guard
        if key not in self._scalars:
            name = f"scalar_{value.describe() if symbolic else value}"
            self._scalars[key] = self.graph.add("const", (), (("full", value),), (), dtype, name)
        return self._scalars[key]

    def tensor(self, arg: Any) -> int:
        """An operand that may be a node or a python number."""
        if isinstance(arg, fx.Node):
            value = self.env[arg]
            if not isinstance(value, int):
                raise UnsupportedOp(f"tuple used as tensor ({arg.name})")
            return value
        if isinstance(arg, (int, float, bool, RankExpr)):
            return self.scalar(arg)
        raise UnsupportedOp(f"operand of type {type(arg).__name__}")

    # --- walking ----------------------------------------------------------------------------
    def run(self) -> Graph:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(self.leaf_names):
            raise ValueError(f"{len(placeholders)} graph inputs for {len(self.leaf_names)} leaves")
        for node, name in zip(placeholders, self.leaf_names):
            self.current = node
            self.env[node] = self.emit("leaf", (), (name,))
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "get_attr":
                self.env[node] = self.get_attr(node)
            elif node.op == "output":
                self.graph.outputs = [self.tensor(a) for a in _flatten(node.args[0])]
        self.mark_silent_steps()
        return self.graph

    def get_attr(self, node: fx.Node) -> Value:
        return self.get_attr_of(self.gm, node)

    def get_attr_of(self, module: Any, node: fx.Node) -> Value:
        obj = getattr(module, node.target)
        if isinstance(obj, torch.Tensor):
            return self.constant_tensor(obj)
        return obj  # process groups, reduce ops: consumed by collective lowerings

    def constant_tensor(self, tensor: torch.Tensor) -> int:
        """A tensor baked into the graph; a fake one only has a value if fake mode kept it, a meta one never."""
        real = getattr(tensor, "constant", None)
        real = tensor if real is None and not _is_fake(tensor) else real
        if tensor.numel() == 0:  # no values to know (a cache's `torch.tensor([])`)
            real = torch.empty(tensor.shape, dtype=tensor.dtype)
        if real is None or real.is_meta:
            users = list(self.current.users) if self.current is not None else []
            raise UnsupportedOp(
                "a tensor constant whose value fake tensors do not know (a tensor attribute made in "
                "__init__ that is neither a parameter nor a buffer? register it as a buffer)",
                _at(self.locate(users[0])) if users else "",
            )
        with unset_fake_temporarily():  # capture runs under FakeTensorMode, which would fake `real` again
            values = real.flatten().tolist()
        attrs = (("full", values[0]),) if len(values) == 1 else (("values", tuple(values)),)
        dtype = str(real.dtype).removeprefix("torch.")
        return self.graph.add("const", (), attrs, tuple(real.shape), dtype, node_name(self.current))

    def call(self, node: fx.Node) -> Value:
        if node.target is operator.getitem:
            container, index = node.args
            return self.env[container][index]
        key = _aten_key(node.target)
        written = _written(node)
        lowerings = self.lowerings(key) or (self.lowerings(key.removesuffix("_")) if written else [])
        kwargs = {k: v for k, v in node.kwargs.items() if not _only_written(v, written)}  # out= holds a result, not an operand
        before = len(self.graph.nodes)
        result = next((r for r in (self.lowered(node, lower, kwargs) for lower in lowerings) if r is not _DECLINED), _DECLINED)
        if result is _DECLINED:
            result = self.open_op(node, key, kwargs)
        if written and not _only_metadata(node):
            self.written_back(node, key, written, result)
        if len(self.graph.nodes) == before and isinstance(result, int):
            here = self.location(node)
            if here is not None and here.backward:
                self._silent.setdefault((here.file, here.line), (here, result))
        return result

    def lowerings(self, key: str) -> list[Callable[..., Value]]:
        """The hand lowerings of an op, by its `namespace.name` key, tried in order until one does
        not decline (front ends add their own after these)."""
        return [_LOWER[key]] if key in _LOWER else []

    def lowered(self, node: fx.Node, lower: Callable[..., Value], kwargs: dict[str, Any]) -> Value:
        """The hand lowering's IR, or _DECLINED where it declines these arguments (the nodes it
        emitted before declining are dropped)."""
        before = len(self.graph.nodes)
        try:
            return lower(self, *node.args, **kwargs)
        except Declined:
            del self.graph.nodes[before:]
            self._scalars = {k: v for k, v in self._scalars.items() if v < before}
            return _DECLINED

    # --- open ops: what no hand lowering covers --------------------------------------------------
    def open_op(self, node: fx.Node, key: str, kwargs: dict[str, Any]) -> Value:
        """An op without a hand lowering: broken into smaller ops where torch's decomposition
        tables can (recursively, each piece lowered like any op), else kept as itself, an open op
        (`ir/aten_ops.py`)."""
        if not isinstance(node.target, torch._ops.OpOverload):
            raise UnsupportedOp(key, _at(self.location(node)))
        target = _functional(node.target)
        if target is None:
            raise UnsupportedOp(key, _at(self.location(node)) + " (an in-place op with no out-of-place form)")
        decomposition = decomposition_of(target)
        if decomposition is not None and target not in self._decomposing and not mentions_rank((node.args, kwargs)):
            traced = decomposed_graph(target, decomposition, node, kwargs)
            if traced is not None:
                return self.inlined(node, target, *traced)
        return self.aten_call(node, target, kwargs)

    def aten_call(self, node: fx.Node, target: Any, kwargs: dict[str, Any]) -> Value:
        return self.open_call(target, self.values(node.args), {k: self.values(v) for k, v in kwargs.items()}, node.meta.get("val"))

    def open_call(self, target: Any, args: Any, kwargs: dict[str, Any], out: Any) -> Value:
        """One IR node per tensor of `out`: op `aten.<name>.<overload>`, attrs the argument template
        (`args` and `kwargs` hold `_TensorValue`s where tensors go) and the output's path. A
        pointwise op's operands are broadcast first, as ours are."""
        operands: list[int] = []
        pointwise = torch.Tag.pointwise in target.tags
        out_shape = tuple(out.shape) if pointwise and isinstance(out, torch.Tensor) else None

        def operand(value: Any) -> int | None:
            if not isinstance(value, _TensorValue):
                return None
            tensor = broadcast_to(self, value.id, out_shape) if out_shape is not None else value.id
            operands.append(tensor)
            return len(operands) - 1

        template = aten_ops.template(args, operand)
        named = tuple(sorted((k, aten_ops.template(v, operand)) for k, v in kwargs.items()))
        name = aten_ops.name_of(target)
        return self.outputs(out, lambda path, val: self.emit(
            name, tuple(operands), (template, named, path), tuple(val.shape), _dtype_name(val.dtype)))

    def values(self, arg: Any) -> Any:
        """An argument with graph nodes replaced by what they hold: tensors as `_TensorValue`s,
        lists of tensors as tuples of them, other objects (process groups, ...) as they are."""
        if isinstance(arg, fx.Node):
            return _tensor_values(self.env[arg]) if _holds_tensors(arg) else self.env[arg]
        if isinstance(arg, (list, tuple)):
            return tuple(self.values(a) for a in arg)
        return arg

    def outputs(self, val: Any, emit: Callable[[tuple[int, ...], torch.Tensor], int], path: tuple[int, ...] = ()) -> Value:
        """`emit(path, tensor)` for each tensor of an op's output, in the output's nesting."""
        if isinstance(val, torch.Tensor):
            return emit(path, val)
        if isinstance(val, (tuple, list)):
            return tuple(self.outputs(v, emit, path + (i,)) for i, v in enumerate(val))
        if val is None:
            return None
        raise UnsupportedOp(f"{type(val).__name__} output", _at(self.location(self.current)))

    def inlined(self, node: fx.Node, target: Any, sub: fx.GraphModule, operands: list[fx.Node]) -> Value:
        """The decomposition `sub` of `node` lowered in its place, every op at `node`'s line."""
        outer_site, outer_current = self.site, self.current
        self.site = outer_site or node
        self._decomposing.append(target)
        try:
            placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
            for placeholder, operand in zip(placeholders, operands):
                self.env[placeholder] = self.env[operand]
            result: Value = None
            for inner in sub.graph.nodes:
                self.current = inner
                if inner.op == "call_function":
                    self.env[inner] = self.call(inner)
                elif inner.op == "get_attr":
                    self.env[inner] = self.get_attr_of(sub, inner)
                elif inner.op == "output":
                    result = _structured(inner.args[0], self.env)
            return result
        finally:
            self._decomposing.pop()
            self.site, self.current = outer_site, outer_current

    def mark_silent_steps(self) -> None:
        """A backward formula that emits no op (only reads its saved tensors, and returns the
        gradient it was given, as DTensor's log_softmax backward under loss_parallel does) leaves no
        trace in the IR. An unused same-shape view at its forward line records that it ran, so a
        diagnosis can point at a step that should have computed something."""
        located = {(n.loc.file, n.loc.line) for n in self.graph.nodes if n.loc is not None and n.loc.backward}
        for line, (loc, value) in self._silent.items():
            if line not in located:
                shape = self.shape(value)
                self.graph.add("view", (value,), (shape,), shape, self.dtype(value), "backward_step", loc)

    # --- writes into shared memory, made functional (ir/aliasing.py) ----------------------------
    @functools.cached_property
    def views(self) -> Views:
        return Views(self.gm.graph)

    def written_back(self, node: fx.Node, key: str, written: list[fx.Node], result: Value) -> None:
        """After `node` wrote `written`, the values sharing their memory that are read later see the
        write: each new value is scattered back into the memory's root through the chain of views
        that made it, and the root's older views read later are recomputed from the new root."""
        views = self.views
        here = views.order[node]
        roots = [views.chain(target)[-1] for target in written]
        if not any(self._read_later(views, member, here) for root in roots for member in views.family(root)):
            return
        new_values = _written_values(result, len(written))
        if new_values is None:
            raise UnsupportedOp(f"in-place {key} on aliased memory", _at(self.location(node)))
        for i, (target, value) in enumerate(zip(written, new_values)):
            # before the last, every view of the memory takes the write: the next target may be one
            self._propagate(views, target, value, here, every=i < len(written) - 1)

    def _read_later(self, views: Views, member: fx.Node, here: int) -> bool:
        return views.order[member] < here and any(views.order[user] > here for user in member.users)

    def _propagate(self, views: Views, target: fx.Node, value: int, here: int, every: bool = False) -> None:
        """`target` holds `value` now: so does every view of its memory read later (`every`: every
        view made before the write, such as the other targets of one op writing several)."""
        chain = views.chain(target)
        values = {target: value}
        for child, source in zip(chain, chain[1:]):
            values[source] = self._unviewed(views.steps[child], child, self.env[source], values[child])
        family = [m for m in views.family(chain[-1]) if views.order[m] < here]
        needed: set[fx.Node] = set(family) if every else set()
        for member in reversed(family):  # a member is needed if read later or viewed by one that is
            if self._read_later(views, member, here) or any(c in needed for c in views.children.get(member, [])):
                needed.add(member)
        relowered: set[fx.Node] = set()
        for member in family:
            if member in needed:
                self.env[member] = values[member] if member in values else self._replayed(views.steps[member], member, relowered)

    def _replayed(self, step: Step, member: fx.Node, relowered: set[fx.Node]) -> Value:
        """`member`'s value read again out of its (new) source."""
        if step.how == IDENTITY:
            return self.env[step.source]
        outer = self.current
        try:
            if step.how == PART:
                container = member.args[0]
                if container not in relowered:
                    self.current = container
                    self.env[container] = self.call(container)
                    relowered.add(container)
                return self.env[container][step.index]
            self.current = member
            return self.call(member)
        finally:
            self.current = outer

    def _unviewed(self, step: Step, child: fx.Node, source: int, new: int) -> int:
        """The source's value once `child`, a view of it, holds `new`: the inverse of the view op
        (a reshape back, the inverse permutation) or a write of `new` into the region it reads."""
        if step.how == IDENTITY:
            return new
        source_val, child_val = step.source.meta["val"], child.meta["val"]
        if step.how == PART:
            return _into_part(self, source, new, source_val, child_val, child.args[0])
        name = child.target._schema.name.removeprefix("aten::")
        args = list(child.args[1:]) + list(child.kwargs.values())
        if name in _RESHAPES:
            return _as_buffer(self, new, tuple(source_val.shape))
        if name in ("permute", "transpose", "t", "numpy_T", "mT", "swapaxes"):
            perm = _permutation(name, args, len(source_val.shape))
            return self.emit("permute", (new,), (tuple(perm.index(d) for d in range(len(perm))),), tuple(source_val.shape), self.dtype(new))
        if name in ("slice", "narrow", "select"):
            dim, start, end, step_size = _region(name, args, tuple(source_val.shape))
            if step_size == 1:
                piece = _as_buffer(self, new, tuple(child_val.shape[:dim]) + (end - start,) + tuple(source_val.shape[dim + 1 :]))
                return _written_over(self, source, piece, dim, start, end, 1)
        scatter = getattr(torch.ops.aten, f"{name}_scatter", None)
        if scatter is None or name == "expand":
            raise UnsupportedOp(f"a write through `{name}`", _at(self.location(self.current)))
        values = (_TensorValue(source), _TensorValue(new), *self.values(tuple(child.args[1:])))
        return self.open_call(scatter.default, values, {}, source_val)

class Declined(Exception):
    """A hand lowering that does not cover this call's arguments (a strided slice, a tensor
    exponent): the call is lowered as an open op instead."""


_DECLINED = object()  # what `Lowerer.lowered` returns for a declined call (None means "no value")


@dataclass(frozen=True)
class _TensorValue:
    """An IR value standing where an op's argument template has a tensor."""

    id: int


def _holds_tensors(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val))


def _tensor_values(value: Value) -> Any:
    if isinstance(value, tuple):
        return tuple(_tensor_values(v) for v in value)
    return None if value is None else _TensorValue(value)


def _structured(value: Any, env: dict[fx.Node, Value]) -> Value:
    """A graph's output (nodes, possibly nested) as the IR values they hold."""
    if isinstance(value, fx.Node):
        return env[value]
    if isinstance(value, (list, tuple)):
        return tuple(_structured(v, env) for v in value)
    return value


def _functional(target: Any) -> Any | None:
    """The out-of-place overload of an in-place op (`add_.Tensor` -> `add.Tensor`) or of one
    writing into `out=` (`_chunk_cat.out` -> `_chunk_cat.default`); other ops as they are; None
    where there is none."""
    schema = target._schema
    if not any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return target
    namespace, name = schema.name.split("::")
    if target._overloadname == "out":
        return getattr(getattr(getattr(torch.ops, namespace), name), "default", None)
    packet = getattr(getattr(torch.ops, namespace), name.removesuffix("_"), None) if name.endswith("_") else None
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def node_name(node: fx.Node | None) -> str:
    return node.name if node is not None else "const"


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _at(loc: Location | None) -> str:
    return f"{loc.short()}  {loc.code}" if loc else ""


def _written(node: fx.Node) -> list[fx.Node]:
    """The graph values an op writes into: `Tensor(a!)` arguments; for c10d collectives the first."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return []
    by_collective = written_by_collective(node)
    if by_collective is not None:
        return _nodes_in(by_collective)
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            written.extend(_nodes_in(value))
    return written


def _only_written(arg: Any, written: list[fx.Node]) -> bool:
    """`arg` is tensors the op writes into (`out=`, a list of them), none of which it reads."""
    nodes = _nodes_in(arg)
    return bool(nodes) and all(n in written for n in nodes)


def _written_values(result: Value, count: int) -> list[int] | None:
    """The new values of the tensors an op wrote, from what its lowering returned: the value (an
    in-place op), or the list first in the result (an in-place collective's (tensors, work)), or the
    one tensor first (all_gather_into_tensor's (tensor, work)), or one value per tensor (a foreach
    op: `_foreach_copy_`)."""
    if isinstance(result, int) and count == 1:
        return [result]
    if isinstance(result, tuple) and result and isinstance(result[0], int) and count == 1:
        return [result[0]]
    if isinstance(result, (list, tuple)) and len(result) == count and all(isinstance(v, int) for v in result):
        return list(result)
    if isinstance(result, tuple) and result and isinstance(result[0], (list, tuple)) and len(result[0]) == count:
        return list(result[0]) if all(isinstance(v, int) for v in result[0]) else None
    return None


# View ops that read their input's elements in row-major order, only shaped anew.
_RESHAPES = {"view", "_reshape_alias", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten", "view_as", "_unsafe_view"}


def _permutation(name: str, args: list, rank: int) -> list[int]:
    """The dims of the source a permuting view's dims are, in order."""
    if name == "permute":
        return [_dim(d, rank) for d in args[0]]
    perm = list(range(rank))
    if name in ("transpose", "swapaxes"):
        d0, d1 = (_dim(d, rank) for d in args[:2])
    else:  # t, numpy_T, mT: the last two (t of a 1-d tensor: itself)
        d0, d1 = (rank - 2, rank - 1) if rank >= 2 else (0, 0)
        if name == "numpy_T":
            return list(reversed(perm))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return perm


def _region(name: str, args: list, shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    """(dim, start, end, step) of the source a slice, narrow or select reads."""
    dim = _dim(args[0] if args else 0, len(shape))
    if name == "select":
        index = args[1] + shape[dim] if args[1] < 0 else args[1]
        return dim, index, index + 1, 1
    if name == "narrow":
        return dim, args[1], args[1] + args[2], 1
    padded = list(args) + [None] * (4 - len(args))
    start, end = _slice_range(shape[dim], padded[1], padded[2], padded[3] or 1)
    return dim, start, end, padded[3] or 1


def _into_part(lo: Lowerer, source: int, new: int, source_val: torch.Tensor, part_val: torch.Tensor, container: fx.Node) -> int:
    """`source` with one part of its split (or unbind) replaced by `new`: where the part lies is
    read off the memory offsets the fake tensors keep."""
    source_shape, part_shape = tuple(source_val.shape), tuple(part_val.shape)
    offset = part_val.storage_offset() - source_val.storage_offset()
    if len(part_shape) < len(source_shape):  # unbind: one index of its dim
        dim = _dim(container.args[1] if len(container.args) > 1 else 0, len(source_shape))
        part_shape = part_shape[:dim] + (1,) + part_shape[dim:]
        length = 1
    else:
        dim = next((d for d, (a, b) in enumerate(zip(source_shape, part_shape)) if a != b), 0)
        length = part_shape[dim]
    start = offset // source_val.stride()[dim] if source_val.stride()[dim] else 0
    return _written_over(lo, source, _as_buffer(lo, new, part_shape), dim, start, start + length, 1)


def _only_metadata(node: fx.Node) -> bool:
    """In-place view ops (unsqueeze_, t_, ...) change a tensor's shape, never the shared data."""
    return torch.Tag.inplace_view in getattr(node.target, "tags", ())


def _nodes_in(value: Any) -> list[fx.Node]:
    return [v for v in _flatten(value) if isinstance(v, fx.Node)]


def _aten_key(target: Any) -> str:
    text = str(target)
    parts = text.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else text


def _flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    return [] if value is None else [value]


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


# --- lowerings, grouped by meaning ------------------------------------------------------------
def _passthrough(lo: Lowerer, x, *args, **kwargs) -> int:
    return lo.tensor(x)


def _conjugate(lo: Lowerer, x) -> int:
    """The complex conjugate is the identity on real tensors (tanh's backward formula conjugates)."""
    value = lo.tensor(x)
    if lo.dtype(value).startswith("complex"):
        raise Declined
    return value


def _view(lo: Lowerer, x, *args, **kwargs) -> int:
    out_shape = tuple(lo.current.meta["val"].shape)
    value = lo.tensor(x)
    if lo.shape(value) == out_shape:
        return value
    return lo.emit("view", (value,), (out_shape,))


def _permute(lo: Lowerer, x, perm, **kwargs) -> int:
    value = lo.tensor(x)
    rank = len(lo.shape(value))
    perm = tuple(_dim(p, rank) for p in perm)
    if perm == tuple(range(rank)):
        return value
    return lo.emit("permute", (value,), (perm,))


def _transpose(lo: Lowerer, x, d0: int = 0, d1: int = 1, **kwargs) -> int:
    rank = len(lo.shape(lo.tensor(x)))
    perm = list(range(rank))
    if rank >= 2:
        d0, d1 = _dim(d0, rank), _dim(d1, rank)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permute(lo, x, perm)


def slice_value(lo: Lowerer, value: int, dim: int, start: int, end: int) -> int:
    size = lo.shape(value)[dim]
    start, end = _clamped(start, size), _clamped(end, size)
    end = start if end < start else end
    length = int(end - start)  # an int at every rank a symbolic slice is traced for (see capture/symbolic_rank)
    if length == size:
        return value
    shape = list(lo.shape(value))
    shape[dim] = length
    return lo.emit("slice", (value,), (dim, start, end), tuple(shape), lo.dtype(value))


def _slice(lo: Lowerer, x, dim: int = 0, start=None, end=None, step: int = 1) -> int:
    value = lo.tensor(x)
    dim = _dim(dim, len(lo.shape(value)))
    start, end = _slice_range(lo.shape(value)[dim], start, end, step)
    return slice_value(lo, value, dim, start, end) if step == 1 else _strided(lo, value, dim, start, end, step)


def _strided(lo: Lowerer, value: int, dim: int, start: int, end: int, step: int) -> int:
    """`x[start:end:step]` along `dim` as layout ops. When `step` divides the dim, the dim viewed
    as a (size / step, step) grid holds the slice in column `start % step`, rows from
    `start // step`; else the k elements taken lie in k blocks of `step` from `start` (the last
    one, if its block would run past the dim, taken on its own)."""
    shape = lo.shape(value)
    count = max(0, -(-(end - start) // step))
    if shape[dim] % step == 0:
        return _grid_column(lo, value, dim, start // step, count, start % step, step)
    whole = count if start + step * count <= shape[dim] else count - 1
    parts = [_grid_column(lo, slice_value(lo, value, dim, start, start + step * whole), dim, 0, whole, 0, step)] if whole else []
    if whole < count:
        last = start + step * whole
        parts.append(slice_value(lo, value, dim, last, last + 1))
    if len(parts) == 1:
        return parts[0]
    return lo.emit("cat", tuple(parts), (dim,), _with(shape, dim, count), lo.dtype(value))


def _grid_column(lo: Lowerer, value: int, dim: int, row: int, rows: int, column: int, step: int) -> int:
    """Rows [row, row + rows) of column `column` of `dim` viewed as a (size / step, step) grid."""
    grid = _as_grid(lo, value, dim, step)
    cell = slice_value(lo, slice_value(lo, grid, dim, row, row + rows), dim + 1, column, column + 1)
    return _as_buffer(lo, cell, _with(lo.shape(value), dim, rows))


def _as_grid(lo: Lowerer, value: int, dim: int, step: int) -> int:
    """`value` with `dim` viewed as a (size / step, step) grid."""
    shape = lo.shape(value)
    return _as_buffer(lo, value, shape[:dim] + (shape[dim] // step, step) + shape[dim + 1 :])


def _slice_range(size: int, start: int | None, end: int | None, step: int) -> tuple[int, int]:
    """aten's [start, end) on a dim of `size` (None for the ends, negative from the back), clamped.
    A symbolic offset with a step is not lowered here (see capture/symbolic_rank)."""
    if step != 1 and (isinstance(start, RankExpr) or isinstance(end, RankExpr)):
        raise Declined
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return _clamped(start, size), _clamped(end, size)


def _clamped(index: int | RankExpr, size: int) -> int | RankExpr:
    """`index` within [0, size]; itself when it is (so a symbolic offset stays symbolic)."""
    return 0 if index < 0 else size if index > size else index


def _narrow(lo: Lowerer, x, dim: int, start: int, length: int) -> int:
    return _slice(lo, x, dim, start, start + length)


def _select(lo: Lowerer, x, dim: int, index: int) -> int:
    value = lo.tensor(x)
    shape = lo.shape(value)
    dim = _dim(dim, len(shape))
    index = index + shape[dim] if index < 0 else index
    piece = slice_value(lo, value, dim, index, index + 1)
    out_shape = shape[:dim] + shape[dim + 1 :]
    return lo.emit("view", (piece,), (out_shape,), out_shape, lo.dtype(value))


def _slice_scatter(lo: Lowerer, base, src, dim: int = 0, start=None, end=None, step: int = 1) -> int:
    return _written_over(lo, lo.tensor(base), lo.tensor(src), dim, start, end, step)


def _slice_backward(lo: Lowerer, grad, input_sizes: list[int], dim: int, start: int, end: int, step: int) -> int:
    """The gradient of a slice: the slice's gradient in place, zeros elsewhere."""
    value = lo.tensor(grad)
    return _written_over(lo, _zeros(lo, input_sizes, value), value, dim, start, end, step)


def _select_backward(lo: Lowerer, grad, input_sizes: list[int], dim: int, index: int) -> int:
    value = lo.tensor(grad)
    return _row_written(lo, _zeros(lo, input_sizes, value), value, dim, index)


def _select_scatter(lo: Lowerer, base, src, dim: int, index: int) -> int:
    return _row_written(lo, lo.tensor(base), lo.tensor(src), dim, index)


def _row_written(lo: Lowerer, base: int, row: int, dim: int, index: int) -> int:
    """`base` with its `index`-th entry along `dim` replaced by `row` (which lacks that dim)."""
    shape = lo.shape(base)
    dim = _dim(dim, len(shape))
    index = index + shape[dim] if index < 0 else index
    one = _with(shape, dim, 1)
    return _written_over(lo, base, lo.emit("view", (row,), (one,), one, lo.dtype(row)), dim, index, index + 1, 1)


def _written_over(lo: Lowerer, base: int, src: int, dim: int, start: int | None, end: int | None, step: int) -> int:
    """`base` with `src` written over [start, end) of `dim`: the untouched parts of base around src."""
    shape = lo.shape(base)
    dim = _dim(dim, len(shape))
    start, end = _slice_range(shape[dim], start, end, step)
    if step != 1:
        return _strided_written_over(lo, base, src, dim, start, step)
    before = [slice_value(lo, base, dim, 0, start)] if start > 0 else []  # no empty slices: nothing reads them
    after = [slice_value(lo, base, dim, end, shape[dim])] if end < shape[dim] else []
    parts = [*before, src, *after]
    return parts[0] if len(parts) == 1 else lo.emit("cat", tuple(parts), (dim,), shape, lo.dtype(base))


def _strided_written_over(lo: Lowerer, base: int, src: int, dim: int, start: int, step: int) -> int:
    """`base` with `src` written at start, start + step, ... of `dim`, as layout ops (the mirror of
    `_strided`): the dim's first whole blocks of `step` viewed as a grid take src's entries in
    column `start % step`; an entry past them (the dim not a multiple of `step`) is written alone."""
    shape, count = lo.shape(base), lo.shape(src)[dim]
    whole = shape[dim] - shape[dim] % step
    inside = sum(1 for i in range(count) if start + i * step < whole)
    parts = []
    if whole:
        grid = _as_grid(lo, slice_value(lo, base, dim, 0, whole), dim, step)
        column = slice_value(lo, grid, dim + 1, start % step, start % step + 1)
        if inside:
            cells = _as_buffer(lo, slice_value(lo, src, dim, 0, inside), _with(lo.shape(column), dim, inside))
            column = _written_over(lo, column, cells, dim, start // step, start // step + inside, 1)
        grid = _written_over(lo, grid, column, dim + 1, start % step, start % step + 1, 1)
        parts.append(_as_buffer(lo, grid, _with(shape, dim, whole)))
    if whole < shape[dim]:
        tail = slice_value(lo, base, dim, whole, shape[dim])
        if inside < count:
            offset = start + inside * step - whole
            tail = _written_over(lo, tail, slice_value(lo, src, dim, inside, count), dim, offset, offset + 1, 1)
        parts.append(tail)
    return parts[0] if len(parts) == 1 else lo.emit("cat", tuple(parts), (dim,), shape, lo.dtype(base))


def _with(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    """`shape` with `dim` of `size`."""
    return shape[:dim] + (size,) + shape[dim + 1 :]


def _zeros(lo: Lowerer, shape: list[int], like: int) -> int:
    return lo.emit("const", (), (("full", 0),), tuple(shape), lo.dtype(like))


def _split_sizes(lo: Lowerer, x, sizes: list[int], dim: int = 0) -> tuple[int, ...]:
    value = lo.tensor(x)
    dim = _dim(dim, len(lo.shape(value)))
    out, start = [], 0
    for size in sizes:
        out.append(slice_value(lo, value, dim, start, start + size))
        start += size
    return tuple(out)


def _as_strided(lo: Lowerer, x, size, stride, storage_offset=None) -> int:
    """A strided view that reads a run of a contiguous tensor's memory in row-major order (FSDP2
    views its flat all-gathered and reduce-scattered buffers as parameters and gradients so) is a
    slice of the tensor flattened, reshaped. Of a view that is not contiguous (a transpose), it
    reads the memory under the view, not the view's elements in order: the run is taken from the
    contiguous tensor the view was made from (a kernel reading its argument from the data pointer).
    Other strides decline: an open op."""
    val = x.meta.get("val") if isinstance(x, fx.Node) else None
    size = tuple(size)
    if not isinstance(val, torch.Tensor) or tuple(stride) != _contiguous_strides(size):
        raise Declined
    offset = val.storage_offset() if storage_offset is None else storage_offset
    if not val.is_contiguous():
        x = _dense_source(lo, x)
        val = x.meta["val"]
    start = offset - val.storage_offset()
    numel = math.prod(size)
    if start < 0 or start + numel > val.numel():
        raise Declined
    value = lo.tensor(x)
    flat = lo.emit("view", (value,), ((val.numel(),),), (val.numel(),), lo.dtype(value))
    return lo.emit("view", (slice_value(lo, flat, 0, start, start + numel),), (size,), size, lo.dtype(value))


def _dense_source(lo: Lowerer, x: fx.Node) -> fx.Node:
    """The contiguous value whose memory the view `x` reads (up its chain of views), or Declined."""
    storage = x.meta["val"].untyped_storage()._cdata
    for source in lo.views.chain(x)[1:]:
        val = source.meta.get("val")
        if isinstance(val, torch.Tensor) and val.is_contiguous() and val.untyped_storage()._cdata == storage:
            return source
    raise Declined


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(size):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _split(lo: Lowerer, x, split_size, dim: int = 0) -> tuple[int, ...]:
    if isinstance(split_size, (list, tuple)):
        return _split_sizes(lo, x, split_size, dim)
    total = lo.shape(lo.tensor(x))[_dim(dim, len(lo.shape(lo.tensor(x))))]
    sizes = [min(split_size, total - s) for s in range(0, total, split_size)] or [0]
    return _split_sizes(lo, x, sizes, dim)


def _chunk(lo: Lowerer, x, chunks: int, dim: int = 0) -> tuple[int, ...]:
    total = lo.shape(lo.tensor(x))[_dim(dim, len(lo.shape(lo.tensor(x))))]
    return _split(lo, x, max(1, math.ceil(total / chunks)), dim)


def _unbind(lo: Lowerer, x, dim: int = 0) -> tuple[int, ...]:
    total = lo.shape(lo.tensor(x))[_dim(dim, len(lo.shape(lo.tensor(x))))]
    return tuple(_select(lo, x, dim, i) for i in range(total))


def _cat(lo: Lowerer, tensors, dim: int = 0) -> int:
    values = [lo.tensor(t) for t in tensors]
    values = [v for v in values if math.prod(lo.shape(v)) > 0 or len(lo.shape(v)) > 1]
    if len(values) == 1:
        return values[0]
    dim = _dim(dim, len(lo.shape(values[0])))
    return lo.emit("cat", tuple(values), (dim,))


def _stack(lo: Lowerer, tensors, dim: int = 0) -> int:
    """torch.stack: each tensor viewed with a new size-1 dim at `dim`, then concatenated there."""
    values = [lo.tensor(t) for t in tensors]
    shape = lo.shape(values[0])
    dim = _dim(dim, len(shape) + 1)
    one = shape[:dim] + (1,) + shape[dim:]
    rows = [lo.emit("view", (v,), (one,), one, lo.dtype(v)) for v in values]
    if len(rows) == 1:
        return rows[0]
    return lo.emit("cat", tuple(rows), (dim,), shape[:dim] + (len(rows),) + shape[dim:], lo.dtype(values[0]))


def _constant_pad(lo: Lowerer, x, pad: list[int], value: float = 0.0) -> int:
    """F.pad(x, pad, value=v): per dim from the last, v-filled blocks concatenated before and
    after (a negative pad crops)."""
    out = lo.tensor(x)
    rank = len(lo.shape(out))
    for i in range(0, len(pad), 2):
        dim, before, after = rank - 1 - i // 2, pad[i], pad[i + 1]
        out = slice_value(lo, out, dim, max(0, -before), lo.shape(out)[dim] - max(0, -after))
        shape = lo.shape(out)

        def block(width: int) -> list[int]:
            size = tuple(width if d == dim else s for d, s in enumerate(shape))
            return [lo.emit("const", (), (("full", value),), size, lo.dtype(out))] if width > 0 else []

        parts = [*block(before), out, *block(after)]
        if len(parts) > 1:
            total = tuple(sum(lo.shape(p)[dim] for p in parts) if d == dim else s for d, s in enumerate(shape))
            out = lo.emit("cat", tuple(parts), (dim,), total, lo.dtype(out))
    return out


def broadcast_to(lo: Lowerer, value: int, shape: tuple[int, ...]) -> int:
    """Make broadcasting explicit: leading 1-dims by view, then expand."""
    have = lo.shape(value)
    if have == tuple(shape):
        return value
    if len(have) < len(shape):
        padded = (1,) * (len(shape) - len(have)) + have
        value = lo.emit("view", (value,), (padded,), padded, lo.dtype(value))
        have = padded
    if have == tuple(shape):
        return value
    return lo.emit("expand", (value,), (tuple(shape),), tuple(shape), lo.dtype(value))


def _expand(lo: Lowerer, x, size, **kwargs) -> int:
    value = lo.tensor(x)
    out_shape = tuple(lo.current.meta["val"].shape)
    return broadcast_to(lo, value, out_shape)


def _convert(lo: Lowerer, x, *args, **kwargs) -> int:
    value = lo.tensor(x)
    out = lo.current.meta["val"]
    dtype = str(out.dtype).removeprefix("torch.")
    if dtype == lo.dtype(value):
        return value
    return lo.emit("convert", (value,), (dtype,))


def _elementwise(op: str) -> Callable[..., int]:
    def lower(lo: Lowerer, *args, **kwargs) -> int:
        out_shape = tuple(lo.current.meta["val"].shape)
        operands = [lo.tensor(a) for a in args if isinstance(a, (fx.Node, int, float, bool, RankExpr))]
        operands = [broadcast_to(lo, v, out_shape) for v in operands]
        return lo.emit(op, tuple(operands))

    return lower


def _unary(op: str, attrs: tuple = ()) -> Callable[..., int]:
    return lambda lo, x, *args, **kwargs: lo.emit(op, (lo.tensor(x),), attrs)


def _scaled(lo: Lowerer, y, alpha) -> int:
    out_shape = tuple(lo.current.meta["val"].shape)
    value = broadcast_to(lo, lo.tensor(y), out_shape)
    if alpha == 1:
        return value
    return lo.emit("mul", (value, broadcast_to(lo, lo.scalar(alpha), out_shape)))


def _add(lo: Lowerer, x, y, alpha=1) -> int:
    out_shape = tuple(lo.current.meta["val"].shape)
    return lo.emit("add", (broadcast_to(lo, lo.tensor(x), out_shape), _scaled(lo, y, alpha)))


def _sub(lo: Lowerer, x, y, alpha=1) -> int:
    out_shape = tuple(lo.current.meta["val"].shape)
    negated = lo.emit("neg", (_scaled(lo, y, alpha),), (), out_shape)
    return lo.emit("add", (broadcast_to(lo, lo.tensor(x), out_shape), negated))


def _rsub(lo: Lowerer, x, y, alpha=1) -> int:
    return _sub(lo, y, x, alpha)


def _div(lo: Lowerer, x, y, rounding_mode=None) -> int:
    if rounding_mode is not None:
        raise Declined
    return _elementwise("div")(lo, x, y)


def _pow(lo: Lowerer, x, exponent) -> int:
    if not isinstance(exponent, (int, float)):
        raise Declined
    return lo.emit("pow", (lo.tensor(x),), (float(exponent),))


def _reduce(op: str) -> Callable[..., int]:
    def lower(lo: Lowerer, x, dims=None, keepdim: bool = False, **kwargs) -> int:
        value = lo.tensor(x)
        rank = len(lo.shape(value))
        if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
            dims = list(range(rank))
        dims = (dims,) if isinstance(dims, int) else dims
        dims = tuple(sorted(_dim(d, rank) for d in dims))
        return lo.emit(op, (value,), (dims, bool(keepdim)))

    return lower


def _max(lo: Lowerer, x, dim=None, keepdim: bool = False) -> Value:
    """torch.max: over everything, elementwise against a tensor, or over one dim (values, indices)."""
    if dim is None:
        return _reduce("amax")(lo, x)
    if isinstance(dim, fx.Node):
        return _elementwise("maximum")(lo, x, dim)
    value = lo.tensor(x)
    attrs = ((_dim(dim, len(lo.shape(value))),), bool(keepdim))
    values, indices = lo.current.meta["val"]
    return tuple(
        lo.emit(op, (value,), attrs, tuple(out.shape), str(out.dtype).removeprefix("torch."))
        for op, out in (("amax", values), ("argmax", indices))
    )


def _argmax(lo: Lowerer, x, dim=None, keepdim: bool = False) -> int:
    """torch.argmax over one dim is the index half of torch.max over it (one op, one set of rules);
    over the flattened tensor it stays an open op."""
    if dim is None:
        raise Declined
    return lo.emit("argmax", (lo.tensor(x),), ((_dim(dim, len(lo.shape(lo.tensor(x)))),), bool(keepdim)))


def _mean(lo: Lowerer, x, dims=None, keepdim: bool = False, **kwargs) -> int:
    total = _reduce("sum")(lo, x, dims, keepdim)
    count = math.prod(lo.shape(lo.tensor(x))) // max(1, math.prod(lo.shape(total)))
    return lo.emit("div", (total, broadcast_to(lo, lo.scalar(count), lo.shape(total))))  # 1/count exactly


def _layer_norm(lo: Lowerer, x, normalized_shape, weight=None, bias=None, eps: float = 1e-5) -> tuple:
    """native_layer_norm as its arithmetic, so rules see (x - mean) * rsqrt(var + eps) * w + b."""
    value = lo.tensor(x)
    dims = tuple(range(len(lo.shape(value)) - len(normalized_shape), len(lo.shape(value))))
    mean = _mean_of(lo, value, dims)
    centered = _combine(lo, "add", value, lo.emit("neg", (mean,), (), lo.shape(mean), lo.dtype(mean)))
    variance = _mean_of(lo, _combine(lo, "mul", centered, centered), dims)
    shifted = _combine(lo, "add", variance, lo.scalar(float(eps)))
    rstd = lo.emit("rsqrt", (shifted,), (), lo.shape(shifted), lo.dtype(shifted))
    out = _combine(lo, "mul", centered, rstd)
    for op, param in (("mul", weight), ("add", bias)):
        if param is not None:
            out = _combine(lo, op, out, lo.tensor(param))
    return (out, mean, rstd)


def _combine(lo: Lowerer, op: str, a: int, b: int) -> int:
    """A broadcasting binary op on IR values, for lowerings that emit several nodes per FX node."""
    shape = tuple(torch.broadcast_shapes(lo.shape(a), lo.shape(b)))
    return lo.emit(op, (broadcast_to(lo, a, shape), broadcast_to(lo, b, shape)), (), shape, lo.dtype(a))


def _mean_of(lo: Lowerer, value: int, dims: tuple[int, ...]) -> int:
    shape = tuple(1 if d in dims else n for d, n in enumerate(lo.shape(value)))
    total = lo.emit("sum", (value,), (dims, True), shape, lo.dtype(value))
    return _combine(lo, "div", total, lo.scalar(max(1, math.prod(lo.shape(value)) // math.prod(shape))))


def _softmax(op: str) -> Callable[..., int]:
    def lower(lo: Lowerer, x, dim: int, *args, **kwargs) -> int:
        value = lo.tensor(x)
        return lo.emit(op, (value,), (_dim(dim, len(lo.shape(value))),))

    return lower


def _mm(lo: Lowerer, a, b) -> int:
    """mm/bmm; undoes aten's flattening of batch dims so batch slices stay visible."""
    va, vb = lo.tensor(a), lo.tensor(b)
    out_shape = tuple(lo.current.meta["val"].shape)
    src_a, src_b = _flattened_source(lo, va), _flattened_source(lo, vb)
    if len(out_shape) == 2 and src_a is not None and len(lo.shape(vb)) == 2:
        batch = lo.shape(src_a)[:-1]
        inner = lo.emit("matmul", (src_a, vb), (), batch + out_shape[-1:])
        return lo.emit("view", (inner,), (out_shape,))
    if len(out_shape) == 3 and src_a is not None and src_b is not None:
        batch_a, batch_b = lo.shape(src_a)[:-2], lo.shape(src_b)[:-2]
        if batch_a == batch_b and lo.shape(src_a)[-2:] == lo.shape(va)[-2:] and lo.shape(src_b)[-2:] == lo.shape(vb)[-2:]:
            inner = lo.emit("matmul", (src_a, src_b), (), batch_a + out_shape[-2:])
            return lo.emit("view", (inner,), (out_shape,))
    return lo.emit("matmul", (va, vb))


def _flattened_source(lo: Lowerer, value: int) -> int | None:
    """The tensor a `view` flattened leading dims of, keeping the trailing matrix dims (also through
    a transpose of the matrix dims, as bmm's backward applies to its saved flattened operands)."""
    node = lo.graph[value]
    if node.op == "permute" and len(node.shape) == 3 and node.attrs[0] == (0, 2, 1):
        src = _flattened_source(lo, node.inputs[0])
        if src is None:
            return None
        n = len(lo.shape(src))
        perm = tuple(range(n - 2)) + (n - 1, n - 2)
        shape = lo.shape(src)[:-2] + node.shape[-2:]
        return lo.emit("permute", (src,), (perm,), shape, node.dtype)
    if node.op != "view":
        return None
    src = node.inputs[0]
    src_shape = lo.shape(src)
    keep = 1 if len(node.shape) == 2 else 2
    if len(src_shape) <= len(node.shape) or src_shape[-keep:] != node.shape[-keep:]:
        return None
    return src


def _addmm(lo: Lowerer, bias, a, b, beta=1, alpha=1) -> int:
    if beta != 1 or alpha != 1:
        raise Declined
    product = _mm(lo, a, b)
    return lo.emit("add", (product, broadcast_to(lo, lo.tensor(bias), lo.shape(product))))


def _embedding(lo: Lowerer, weight, ids, *args, **kwargs) -> int:
    return lo.emit("embedding", (lo.tensor(weight), lo.tensor(ids)))


def _gather(lo: Lowerer, x, dim: int, index, sparse_grad: bool = False) -> int:
    value = lo.tensor(x)
    return lo.emit("gather", (value, lo.tensor(index)), (_dim(dim, len(lo.shape(value))),))


def _clamp(lo: Lowerer, x, min=None, max=None) -> int:
    """clamp(x, min, max) = minimum(maximum(x, min), max)."""
    value = lo.tensor(x)
    for op, bound in (("maximum", min), ("minimum", max)):
        if bound is not None:
            value = lo.emit(op, (value, broadcast_to(lo, lo.tensor(bound), lo.shape(value))), (), lo.shape(value), lo.dtype(value))
    return value


def _scatter(op: str) -> Callable[..., int]:
    """scatter / scatter_add with a src tensor, or scatter with a scalar value (broadcast to the index)."""

    def lower(lo: Lowerer, x, dim: int, index, src, **kwargs) -> int:
        if kwargs.get("reduce") is not None:
            raise Declined
        value, where = lo.tensor(x), lo.tensor(index)
        source = broadcast_to(lo, lo.tensor(src), lo.shape(where))
        return lo.emit(op, (value, where, source), (_dim(dim, len(lo.shape(value))),))

    return lower


def _index(lo: Lowerer, x, indices) -> int:
    """`x[arange(n), idx]`, entry idx[i] of row i: a gather along dim 1 (cross entropy's label
    lookup). When x and idx are flattenings of the same leading dims, the gather is taken on the
    unflattened tensors, where a reference's `gather(logits, -1, labels[..., None])` looks.
    `x[arange(n)]` (`x[arange(n), :]`, as Megatron's backward reads every row) is x; `x[:, idx]`
    with one constant index is `index_select`'s rows."""
    value = lo.tensor(x)
    shape = lo.shape(value)
    if _every_row(lo, indices, shape):
        return value
    dim = len(indices) - 1
    if isinstance(indices[-1], fx.Node) and all(i is None for i in indices[:-1]):
        rows = _constant_rows(lo, lo.tensor(indices[-1]), shape[dim])
        if rows is not None:
            return _rows_joined(lo, value, dim, rows)
    if len(indices) == 1 and isinstance(indices[0], fx.Node) and shape:
        return _rows_at(lo, value, lo.tensor(indices[0]))
    if len(indices) != 2 or len(shape) < 2 or not all(isinstance(i, fx.Node) for i in indices):
        raise Declined
    rows, idx = (lo.tensor(i) for i in indices)
    if not _is_arange(lo, rows, shape[0]) or lo.shape(idx) != shape[:1]:
        raise Declined
    table, ids = _unflattened(lo, value, idx)
    lead = lo.shape(ids)
    tail = lo.shape(table)[len(lead) + 1 :]
    column_shape = lead + (1,) * (1 + len(tail))
    index_shape = lead + (1,) + tail
    column = lo.emit("view", (ids,), (column_shape,), column_shape, lo.dtype(ids))
    index = broadcast_to(lo, column, index_shape)
    gathered = lo.emit("gather", (table, index), (len(lead),), index_shape, lo.dtype(table))
    return lo.emit("view", (gathered,), (tuple(lo.current.meta["val"].shape),))


def _rows_at(lo: Lowerer, x: int, ids: int) -> int:
    """`x[ids]`, integer ids into x's leading dim: the embedding of x's rows flattened, so a stack of
    expert weights read per routing slot is a lookup as a table's rows are (the laws of lookups
    into a rank's range of rows apply). Bool masks select a data-dependent count: declined."""
    if not lo.dtype(ids).startswith("int"):  # (uint8 ids index as a mask too)
        raise Declined
    shape = lo.shape(x)
    width = math.prod(shape[1:])
    table = x if len(shape) == 2 else lo.emit("view", (x,), ((shape[0], width),), (shape[0], width), lo.dtype(x))
    rows_shape = lo.shape(ids) + (width,)
    rows = lo.emit("embedding", (table, ids), (), rows_shape, lo.dtype(x))
    out_shape = lo.shape(ids) + shape[1:]
    return rows if out_shape == rows_shape else lo.emit("view", (rows,), (out_shape,), out_shape, lo.dtype(x))


def _is_arange(lo: Lowerer, value: int, n: int) -> bool:
    return lo.graph[value].op == "const" and lo.graph[value].attrs[0] == ("arange", 0, n, 1)


def _index_select(lo: Lowerer, x, dim: int, index) -> int:
    """`x.index_select(dim, idx)` with indices the graph holds as a constant: the rows picked, a
    slice per run of consecutive indices, joined along dim. A permutation of the ranks' blocks put
    back in order is then a cat of the blocks, which the layout laws read; other indices stay open."""
    value = lo.tensor(x)
    dim = _dim(dim, len(lo.shape(value)))
    rows = _constant_rows(lo, lo.tensor(index), lo.shape(value)[dim])
    if rows is None:
        raise Declined
    return _rows_joined(lo, value, dim, rows)


def _rows_joined(lo: Lowerer, value: int, dim: int, rows: list[int]) -> int:
    """Rows `rows` of `value` along `dim`: a slice per run of consecutive rows, joined along dim."""
    runs: list[list[int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1][1] += 1
        else:
            runs.append([row, row + 1])
    parts = tuple(slice_value(lo, value, dim, lo_, hi) for lo_, hi in runs)
    return parts[0] if len(parts) == 1 else lo.emit("cat", parts, (dim,))


def _constant_rows(lo: Lowerer, index: int, size: int) -> list[int] | None:
    """The entries of a 1-D integer constant, all rows of a dim of `size`, or None."""
    node = lo.graph[index]
    if node.op != "const" or len(node.shape) != 1 or not node.shape[0] or not node.dtype.startswith(("int", "uint")):
        return None
    kind, values = node.attrs[0][0], node.attrs[0][1]
    rows = [values] * node.shape[0] if kind == "full" else list(values) if kind == "values" else None
    if rows is None or not all(type(i) is int and 0 <= i < size for i in rows):
        return None
    return rows


def _every_row(lo: Lowerer, indices: list, shape: tuple[int, ...]) -> bool:
    """The indices are one `arange(n)` over all n rows: every row, in order."""
    return len(indices) == 1 and isinstance(indices[0], fx.Node) and bool(shape) and _is_arange(lo, lo.tensor(indices[0]), shape[0])


def _unflattened(lo: Lowerer, x: int, idx: int) -> tuple[int, int]:
    """(X, I) with x = view(X) and idx = view(I) merging the leading dims I has; else (x, idx)."""
    x_node, idx_node = lo.graph[x], lo.graph[idx]
    if x_node.op == "view" and idx_node.op == "view":
        table, ids = x_node.inputs[0], idx_node.inputs[0]
        lead = lo.shape(ids)
        if lo.shape(table)[: len(lead)] == lead and lo.shape(table)[len(lead) :] == lo.shape(x)[1:]:
            return table, ids
    return x, idx


def _where(lo: Lowerer, cond, x, y) -> int:
    out_shape = tuple(lo.current.meta["val"].shape)
    operands = tuple(broadcast_to(lo, lo.tensor(a), out_shape) for a in (cond, x, y))
    return lo.emit("where", operands)


def _masked_fill(lo: Lowerer, x, mask, value) -> int:
    return _where(lo, mask, value, x)


def _index_put(lo: Lowerer, x, indices, values, accumulate: bool = False) -> int:
    """`x[mask] = v` with one boolean mask over leading dims, or `x[arange(n), idx] = v` (`+=` with
    accumulate), entry idx[i] of row i: a scatter along dim 1 (a one-hot write, as cross
    entropy's backward spells it)."""
    target = lo.tensor(x)
    if len(indices) == 2 and all(isinstance(i, fx.Node) for i in indices):
        return _row_wise_put(lo, target, *(lo.tensor(i) for i in indices), values, accumulate)
    shape = lo.shape(target)
    if _every_row(lo, indices, shape):  # x[arange(n)] = v writes every row
        value = broadcast_to(lo, lo.tensor(values), shape)
        return lo.emit("add", (target, value), (), shape, lo.dtype(target)) if accumulate else value
    masks = [i for i in indices if i is not None]
    if len(masks) != 1 or len(indices) != 1:
        raise Declined
    mask = lo.tensor(masks[0])
    if lo.dtype(mask) != "bool":
        if accumulate:
            return _accumulated_rows(lo, target, mask, None, lo.tensor(values))
        raise Declined
    if accumulate:
        raise Declined
    mask_shape = lo.shape(mask)
    padded = mask_shape + (1,) * (len(shape) - len(mask_shape))
    if padded != mask_shape:
        mask = lo.emit("view", (mask,), (padded,), padded, "bool")
    mask = broadcast_to(lo, mask, shape)
    value = broadcast_to(lo, lo.tensor(values), shape)
    return lo.emit("where", (mask, value, target), (), shape, lo.dtype(target))


def _masked_put_accumulate(lo: Lowerer, x, mask, indices, values) -> int:
    """`x.index_put_(indices, values, accumulate=True)` where `mask` (its entries) is true: the
    decomposition torch gives an embedding's backward."""
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        raise Declined
    return _accumulated_rows(lo, lo.tensor(x), lo.tensor(indices[0]), lo.tensor(mask), lo.tensor(values))


def _embedding_backward(lo: Lowerer, grad, ids, num_weights, padding_idx=-1, scale_grad_by_freq=False) -> int:
    """An embedding's weight gradient: the rows of grad summed into the rows their ids name, but
    the padding row's. (torch's decomposition also masks ids out of range; the forward lookup
    raised on those, so on any program that ran they are none.)"""
    if scale_grad_by_freq:
        raise Declined
    index, g = lo.tensor(ids), lo.tensor(grad)
    table = lo.emit("const", (), (("full", 0.0),), (int(num_weights), lo.shape(g)[-1]), lo.dtype(g))
    if padding_idx is None or padding_idx < 0:
        return _accumulated_rows(lo, table, index, None, g)
    padding = broadcast_to(lo, lo.scalar(int(padding_idx), lo.dtype(index)), lo.shape(index))
    return _accumulated_rows(lo, table, index, lo.emit("ne", (index, padding), (), lo.shape(index), "bool"), g)


def _accumulated_rows(lo: Lowerer, target: int, ids: int, mask: int | None, values: int) -> int:
    """`x[ids] += v` (row ids[i] of x gets row i of v; rows named twice sum), only the rows `mask`
    keeps: x + onehot^T @ v, onehot row i a scatter of mask[i] at column ids[i] (the form the
    one-hot rules normalise). A row mask already in v (a vocab-parallel embedding's gradient,
    `where(m, 0, g)`, masked like its forward's `output[m] = 0`) moves into the one-hot:
    onehot^T @ where(m, 0, g) = where(m, 0, onehot)^T @ g, so that a rank's one-hot is its
    vocabulary's slice of the reference's."""
    shape, id_shape = lo.shape(target), lo.shape(ids)
    count, width, dtype = math.prod(id_shape), math.prod(shape[1:]), lo.dtype(target)
    if lo.shape(values) != id_shape + shape[1:] or (mask is not None and math.prod(lo.shape(mask)) != count):
        raise Declined  # a mask per element, not per row: no one-hot
    keep = [lo.emit("view", (mask,), ((count, 1),), (count, 1), "bool")] if mask is not None else []
    masked = _row_masked(lo, values, id_shape)
    if masked is not None:
        row_mask, values = masked
        rows = lo.emit("view", (row_mask,), ((count, 1),), (count, 1), "bool")
        keep.append(lo.emit("logical_not", (rows,), (), (count, 1), "bool"))
    while len(keep) > 1:
        keep[:2] = [lo.emit("logical_and", tuple(keep[:2]), (), (count, 1), "bool")]
    weights = lo.emit("convert", (keep[0],), (dtype,), (count, 1), dtype) if keep else lo.emit("const", (), (("full", 1.0),), (count, 1), dtype)
    zeros = lo.emit("const", (), (("full", 0.0),), (count, shape[0]), dtype)
    column = lo.emit("view", (ids,), ((count, 1),), (count, 1), lo.dtype(ids))
    hot = lo.emit("scatter_add", (zeros, column, weights), (1,), (count, shape[0]), dtype)
    flat = lo.emit("view", (values,), ((count, width),), (count, width), lo.dtype(values))
    hot_t = lo.emit("permute", (hot,), ((1, 0),), (shape[0], count), dtype)
    summed = _as_buffer(lo, lo.emit("matmul", (hot_t, flat), (), (shape[0], width), dtype), shape)
    return lo.emit("add", (target, summed), (), shape, dtype)


def _row_masked(lo: Lowerer, value: int, rows: tuple[int, ...]) -> tuple[int, int] | None:
    """(m, x) when `value` is where(m broadcast along its trailing dims, 0, x), m one per row of `rows`."""
    node = lo.graph[value]
    if node.op != "where":
        return None
    cond, zero, kept = (lo.graph[i] for i in node.inputs)
    while zero.op in ("view", "expand"):
        zero = lo.graph[zero.inputs[0]]
    if zero.op != "const" or zero.attrs[0] != ("full", 0) or kept.shape != node.shape:
        return None
    if cond.op != "expand" or math.prod(lo.shape(cond.inputs[0])) != math.prod(rows) or lo.shape(cond.inputs[0])[: len(rows)] != rows:
        return None
    return cond.inputs[0], kept.id


def _row_wise_put(lo: Lowerer, target: int, rows: int, idx: int, values, accumulate: bool) -> int:
    """`x[arange(n), idx] = v`, on the unflattened tensors when x and idx flatten the same leading
    dims (as in `_index`, so the write meets the lookup `x[arange(n), idx]` read)."""
    shape = lo.shape(target)
    if len(shape) != 2 or not _is_arange(lo, rows, shape[0]) or lo.shape(idx) != shape[:1]:
        raise Declined
    table, ids = _unflattened(lo, target, idx)
    lead = lo.shape(ids)
    column_shape = lead + (1,)
    index = lo.emit("view", (ids,), (column_shape,), column_shape, lo.dtype(ids))
    source = lo.tensor(values)
    source = lo.emit("view", (broadcast_to(lo, source, shape[:1]),), (column_shape,), column_shape, lo.dtype(target))
    written = lo.emit("scatter_add" if accumulate else "scatter", (table, index, source), (len(lead),), lo.shape(table), lo.dtype(target))
    return _as_buffer(lo, written, shape)


def _full(lo: Lowerer, size, fill_value, **kwargs) -> int:
    return lo.emit("const", (), (("full", fill_value),))


def _filled(value: float) -> Callable[..., int]:
    return lambda lo, *args, **kwargs: lo.emit("const", (), (("full", value),))


def _empty(lo: Lowerer, *args, **kwargs) -> int:
    return lo.emit("const", (), (("empty",),))


def _arange(lo: Lowerer, *args, **kwargs) -> int:
    numbers = [a for a in args if isinstance(a, (int, float))]
    start, end, step = (0, numbers[0], 1) if len(numbers) == 1 else (*numbers[:2], numbers[2] if len(numbers) > 2 else 1)
    return lo.emit("const", (), (("arange", start, end, step),))


def _mask(op: str) -> Callable[..., int]:
    return lambda lo, x, diagonal=0: lo.emit(op, (lo.tensor(x),), (diagonal,))


def _copy(lo: Lowerer, dst, src, *args) -> int:
    """`dst.copy_(src)` means src, cast to dst's dtype and broadcast to its shape."""
    value, target = lo.tensor(src), lo.tensor(dst)
    if lo.dtype(value) != lo.dtype(target):
        value = lo.emit("convert", (value,), (lo.dtype(target),), lo.shape(value), lo.dtype(target))
    return broadcast_to(lo, value, lo.shape(target))


def _fill(lo: Lowerer, x, value) -> int:
    if isinstance(value, fx.Node):
        return _copy(lo, x, value)
    return lo.emit("const", (), (("full", value),))


# --- collectives ---------------------------------------------------------------------------------
_REDUCE_NAMES = {"SUM": "sum", "AVG": "mean", "MAX": "max", "MIN": "min"}


def _reduce_op(lo: Lowerer, reduce_op: Any) -> str:
    """An in-place collective's ReduceOp, read off its argument (c10d's ReduceOp object, which both
    tracers keep); where that says nothing, the one capture recorded at the call. (A call through
    an alias of torch's function, as Megatron's `dist_reduce_scatter_func`, is not recorded there.)"""
    value = lo.env.get(reduce_op, reduce_op) if isinstance(reduce_op, fx.Node) else reduce_op
    recorded = lo.reduce_ops.pop(0) if lo.reduce_ops else "sum"
    if not (isinstance(value, torch.ScriptObject) and value._has_method("op")):
        return recorded
    return _REDUCE_NAMES.get(torch.distributed.ReduceOp.RedOpType(value.op()).name, "unsupported")


def _all_reduce_inplace(lo: Lowerer, tensors, group, reduce_op, *args) -> tuple:
    op = _reduce_op(lo, reduce_op)
    ranks = lo.group_ranks(group)
    outs = [lo.emit("all_reduce", (lo.tensor(t),), (op, ranks), lo.shape(lo.tensor(t)), lo.dtype(lo.tensor(t))) for t in tensors]
    return (outs, None)


def gathered(lo: Lowerer, value: int, ranks: tuple[int, ...]) -> int:
    shape = lo.shape(value)
    out_shape = (shape[0] * len(ranks),) + shape[1:]
    return lo.emit("all_gather", (value,), (0, ranks), out_shape, lo.dtype(value))


def _all_gather_list(lo: Lowerer, outputs, inputs, group, *args) -> tuple:
    ranks = lo.group_ranks(group)
    result = []
    for out_list, x in zip(outputs, inputs):
        value = lo.tensor(x)
        whole = gathered(lo, value, ranks)
        size = lo.shape(value)[0]
        result.append([slice_value(lo, whole, 0, i * size, (i + 1) * size) for i in range(len(out_list))])
    return (result, None)


def _all_gather_base(lo: Lowerer, output, x, group, *args) -> tuple:
    """all_gather_into_tensor fills the output buffer's flat memory rank after rank: the
    concatenation along dim 0, read in the buffer's own shape (which may split other dims)."""
    whole = gathered(lo, lo.tensor(x), lo.group_ranks(group))
    return (_as_buffer(lo, whole, lo.shape(lo.tensor(output))), None)


def _reduce_scatter_base(lo: Lowerer, output, x, group, reduce_op=None, *args) -> tuple:
    """reduce_scatter_tensor gives rank i chunk i of the summed input's flat memory, in the output
    buffer's shape: dim 0 chunks of the input read as (ranks * out[0], *out[1:])."""
    op = _reduce_op(lo, reduce_op)
    ranks = lo.group_ranks(group)
    out_shape = lo.shape(lo.tensor(output))
    stacked = (len(ranks) * out_shape[0],) + out_shape[1:] if out_shape else (len(ranks),)
    value = _as_buffer(lo, lo.tensor(x), stacked)
    scattered = lo.emit("reduce_scatter", (value,), (0, op, ranks), out_shape or (1,), lo.dtype(value))
    return (_as_buffer(lo, scattered, out_shape), None)


def _as_buffer(lo: Lowerer, value: int, shape: tuple[int, ...]) -> int:
    """`value`'s row-major memory read in `shape` (a no-op when the shapes agree)."""
    if lo.shape(value) == tuple(shape):
        return value
    return lo.emit("view", (value,), (tuple(shape),), tuple(shape), lo.dtype(value))


def _f_all_reduce(lo: Lowerer, x, op: str, group_name) -> int:
    op = {"avg": "mean"}.get(op, op)
    return lo.emit("all_reduce", (lo.tensor(x),), (op, lo.group_ranks(group_name)))


def _f_all_gather(lo: Lowerer, x, group_size: int, group_name) -> int:
    return gathered(lo, lo.tensor(x), lo.group_ranks(group_name))


def _f_reduce_scatter(lo: Lowerer, x, op: str, group_size: int, group_name) -> int:
    op = {"avg": "mean"}.get(op, op)
    return lo.emit("reduce_scatter", (lo.tensor(x),), (0, op, lo.group_ranks(group_name)))


def _all_to_all_base(lo: Lowerer, output, x, group, output_splits, input_splits, *args) -> int:
    """`dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes)` writes what it
    receives into the output buffer (no split list: equal pieces)."""
    return exchanged(lo, lo.tensor(x), lo.shape(lo.tensor(output)), output_splits, input_splits, lo.group_ranks(group))


def _f_all_to_all(lo: Lowerer, x, output_splits, input_splits, group_name) -> int:
    value = lo.tensor(x)
    rows = sum(output_splits) if output_splits else lo.shape(value)[0]
    return exchanged(lo, value, (rows, *lo.shape(value)[1:]), output_splits, input_splits, lo.group_ranks(group_name))


def exchanged(lo: Lowerer, value: int, out_shape: tuple[int, ...], output_splits, input_splits, ranks: tuple[int, ...]) -> int:
    """An all_to_all of `value`'s rows (ir/all_to_all.py) into `out_shape`, split lists made explicit."""
    shape = lo.shape(value)
    output_splits = tuple(output_splits) if output_splits else even_splits(out_shape[0] if out_shape else 0, len(ranks))
    input_splits = tuple(input_splits) if input_splits else even_splits(shape[0] if shape else 0, len(ranks))
    if not all(type(n) is int for n in output_splits + input_splits):
        raise UnsupportedOp("all_to_all_single with split sizes that are no Python ints", 
                            _at(lo.location(lo.current)))
    if not shape or tuple(out_shape[1:]) != shape[1:]:
        raise UnsupportedOp(f"all_to_all_single from a tensor of shape {list(shape)} into one of shape {list(out_shape)} "
                            "(rows of other sizes)", _at(lo.location(lo.current)))
    return lo.emit("all_to_all", (value,), (output_splits, input_splits, ranks), tuple(out_shape), lo.dtype(value))


def _send(lo: Lowerer, tensors, group, peer: int, tag: int) -> None:
    """`dist.send`/`isend` (and their P2POps in `batch_isend_irecv`): one message per tensor to the
    group's rank `peer`, named by its global rank (relations/messages.py pairs it with its recv)."""
    for tensor in tensors:
        value = lo.tensor(tensor)
        lo.emit("send", (value,), _channel(lo, group, peer, tag), lo.shape(value), lo.dtype(value))


def _recv(lo: Lowerer, tensors, group, peer: int, tag: int) -> tuple:
    """`dist.recv`/`irecv` write the message from the group's rank `peer` into each tensor."""
    values = [lo.tensor(t) for t in tensors]
    attrs = _channel(lo, group, peer, tag)
    return ([lo.emit("recv", (), attrs, lo.shape(v), lo.dtype(v)) for v in values], None)


def _channel(lo: Lowerer, group: Any, peer: int, tag: int) -> tuple[Any, int, tuple[int, ...]]:
    """(global rank of the group's rank `peer`, tag, the group's global ranks); a peer the group does not
    have (a stage after the last) is ("no rank", peer): relations/messages.py reports the message."""
    ranks = lo.group_ranks(group)
    if not isinstance(peer, int):
        raise UnsupportedOp(f"a message to or from rank {peer!r}", _at(lo.location(lo.current)))
    return (ranks[peer] if 0 <= peer < len(ranks) else ("no rank", peer), tag, ranks)


def _recv_any_source(lo: Lowerer, *args) -> None:
    raise UnsupportedOp("recv from any source (the sender decides at run time; name the source rank)",
                        _at(lo.location(lo.current)))


_UNARY = ["neg", "exp", "log", "sqrt", "rsqrt", "reciprocal", "relu", "silu", "sigmoid", "tanh", "erf", "sin", "cos", "abs"]
_COMPARE = ["lt", "le", "gt", "ge", "eq", "ne"]

_LOWER: dict[str, Callable[..., Value]] = {
    **{f"aten.{name}": _passthrough
       for name in ["clone", "_lazy_clone", "contiguous", "alias", "detach", "lift_fresh", "lift_fresh_copy", "dropout"]},
    **{f"aten.{name}": _view for name in ["view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "flatten", "view_copy"]},
    "aten.conj_physical": _conjugate,
    "aten.t": lambda lo, x: _transpose(lo, x, 0, 1),
    "aten.transpose": _transpose,
    "aten.permute": _permute,
    "aten.slice": _slice,
    "aten.narrow": _narrow,
    "aten.slice_scatter": _slice_scatter,
    "aten.slice_backward": _slice_backward,
    "aten.select_backward": _select_backward,
    "aten.select_scatter": _select_scatter,
    "aten.select": _select,
    "aten.split": _split,
    "aten.split_with_sizes": _split_sizes,
    "aten.as_strided": _as_strided,
    "aten.split_with_sizes_copy": _split_sizes,  # values, not views: the IR has no aliasing
    "aten.chunk": _chunk,
    "aten.unbind": _unbind,
    "aten.cat": _cat,
    "aten.constant_pad_nd": _constant_pad,
    "aten.stack": _stack,
    "aten.expand": _expand,
    "aten._to_copy": _convert,
    "aten.to": _convert,
    "aten.type_as": _convert,
    **{f"aten.{name}": _unary(name) for name in _UNARY},
    "aten.gelu": lambda lo, x, approximate="none": lo.emit("gelu", (lo.tensor(x),), (approximate,)),
    "aten.pow": _pow,
    "aten.add": _add,
    "aten.sub": _sub,
    "aten.rsub": _rsub,
    "aten.mul": _elementwise("mul"),
    "aten.div": _div,
    "aten.maximum": _elementwise("maximum"),
    "aten.minimum": _elementwise("minimum"),
    **{f"aten.{name}": _elementwise(name) for name in _COMPARE},
    "aten.bitwise_or": _elementwise("logical_or"),
    "aten.logical_or": _elementwise("logical_or"),
    "aten.bitwise_and": _elementwise("logical_and"),
    "aten.logical_and": _elementwise("logical_and"),
    "aten.bitwise_not": _unary("logical_not"),
    "aten.logical_not": _unary("logical_not"),
    "aten.where": _where,
    "aten.masked_fill": _masked_fill,
    "aten.index_put": _index_put,
    "aten._unsafe_index_put": _index_put,
    "aten._unsafe_masked_index_put_accumulate": _masked_put_accumulate,
    "aten.embedding_dense_backward": _embedding_backward,
    "aten.sum": _reduce("sum"),
    "aten.amax": _reduce("amax"),
    "aten.max": _max,
    "aten.argmax": _argmax,
    "aten.mean": _mean,
    "aten.native_layer_norm": _layer_norm,
    "aten._softmax": _softmax("softmax"),
    "aten.softmax": _softmax("softmax"),
    "aten._log_softmax": _softmax("log_softmax"),
    "aten.log_softmax": _softmax("log_softmax"),
    "aten.mm": _mm,
    "aten.bmm": _mm,
    "aten.matmul": _mm,
    "aten.addmm": _addmm,
    "aten.embedding": _embedding,
    "aten.gather": _gather,
    "aten.index": _index,
    "aten.index_select": _index_select,
    "aten.clamp": _clamp,
    "aten.clamp_min": lambda lo, x, min: _clamp(lo, x, min=min),
    "aten.clamp_max": lambda lo, x, max: _clamp(lo, x, max=max),
    "aten.scatter": _scatter("scatter"),
    "aten.scatter_add": _scatter("scatter_add"),
    "aten.full": _full,
    "aten.full_like": lambda lo, x, fill_value, **kw: lo.emit("const", (), (("full", fill_value),)),
    "aten.new_full": lambda lo, x, size, fill_value, **kw: lo.emit("const", (), (("full", fill_value),)),
    "aten.zeros": _filled(0),
    "aten.zeros_like": _filled(0),
    "aten.new_zeros": _filled(0),
    "aten.ones": _filled(1),
    "aten.ones_like": _filled(1),
    "aten.new_ones": _filled(1),
    "aten.scalar_tensor": lambda lo, value, **kw: lo.emit("const", (), (("full", value),)),
    "aten.empty": _empty,
    "aten.empty_like": _empty,
    "aten.new_empty": _empty,
    "aten.empty_strided": _empty,
    "aten.arange": _arange,
    "aten.triu": _mask("triu"),
    "aten.tril": _mask("tril"),
    "aten.copy": _copy,
    "aten._foreach_copy": lambda lo, dsts, srcs, *args: [_copy(lo, dst, src) for dst, src in zip(dsts, srcs)],
    "aten.fill": _fill,
    "aten.zero": _filled(0),
    # the optimizer's profiling scopes: no value
    "profiler._record_function_enter_new": lambda lo, *args, **kwargs: None,
    "profiler._record_function_exit": lambda lo, *args, **kwargs: None,
    "c10d.allreduce_": _all_reduce_inplace,
    "c10d.allgather_": _all_gather_list,
    "c10d._allgather_base_": _all_gather_base,
    "c10d.allgather_into_tensor_coalesced_": None,
    "c10d._reduce_scatter_base_": _reduce_scatter_base,
    "c10d.alltoall_base_": _all_to_all_base,
    "c10d.send": _send,
    "c10d.recv_": _recv,
    "c10d.recv_any_source_": _recv_any_source,
    "_c10d_functional.all_reduce": _f_all_reduce,
    "_c10d_functional.all_gather_into_tensor": _f_all_gather,
    "_c10d_functional.reduce_scatter_tensor": _f_reduce_scatter,
    "_c10d_functional.all_to_all_single": _f_all_to_all,
    "_c10d_functional.wait_tensor": _passthrough,
    "_c10d_functional._wrap_tensor_autograd": _passthrough,  # funcol's autograd wrapper: the identity on values
}
_LOWER = {k: v for k, v in _LOWER.items() if v is not None}


def register_lowering(key: str, lower: Callable[..., Value]) -> None:
    """Lower FX calls of `key` (an op of another package, e.g. shardproof.partition's) with `lower`."""
    _LOWER[key] = lower
