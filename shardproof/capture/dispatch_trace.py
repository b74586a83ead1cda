"""A light tracer for plain-tensor code (the checkpoint loader, forward programs, training steps): aten ops into an FX graph.

make_fx spends ~0.5 ms per op on proxies and stack traces; a loader slicing 126 layers issues
~1,200 ops per rank, so tracing it dominated capture. Here a dispatch mode records each aten op
(below autograd, as make_fx does) with the user's line, at ~1/10 of the cost, into a graph of the
same form make_fx produces (`meta["val"]`, `meta["stack_trace"]`, getitem nodes for list outputs,
get_attr nodes for constants, later reads of an in-place-written tensor through the writing node),
so the same lowering applies. Tensor subclasses (DTensor) raise NotPlain: trace those with make_fx.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import operator
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode_temporarily,
    autograd_would_have_decomposed,
)
from torch.utils._pytree import tree_flatten

from shardproof.capture.hops import is_higher_order, through_dense
from shardproof.capture.locations import is_user_code, tag_autograd_origin
from shardproof.errors import ShardproofError



@dataclass
class Traced:
    """An FX graph and the module holding its constants: all that lowering reads of a
    GraphModule, without generating its Python code (costly for a graph this long)."""

    graph: fx.Graph
    root: torch.nn.Module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.root, name)


class NotPlain(Exception):
    """The code handled a tensor subclass; only make_fx traces those faithfully."""


Decompositions = dict[Any, Callable[..., Any]]  # aten op -> python function of smaller ops
_PLAIN = (torch.Tensor, FakeTensor, torch.nn.Parameter)


class Recorder(TorchDispatchMode):
    def __init__(
        self, graph: fx.Graph, root: torch.nn.Module, entry: FrameType | None, decompositions: Decompositions,
        on_meta: bool = False,
    ) -> None:
        super().__init__()
        self.decompositions = decompositions
        self.on_meta = on_meta  # the traced values are meta tensors: no op may turn them into real ones
        self.graph = graph
        self.root = root
        self.entry = entry  # frames from here outwards are not the traced code's (None: all are)
        self.nodes: dict[int, tuple[torch.Tensor, fx.Node]] = {}  # id -> (tensor kept alive, its node)
        self.constants = 0
        self.created: list[fx.Node] = []  # op nodes in the order recorded (see capture/symbolic_rank)

    def bind(self, tensor: torch.Tensor, node: fx.Node) -> None:
        self.nodes[id(tensor)] = (tensor, node)

    def node_of(self, value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if type(value) not in _PLAIN:
            raise NotPlain(type(value).__name__)
        found = self.nodes.get(id(value))
        if found is not None and found[0] is value:
            return found[1]
        return self.constant(value)

    def nodes_in(self, value: Any) -> Any:
        """`value` (args, kwargs) with tensors replaced by their nodes."""
        if isinstance(value, (tuple, list)):
            return type(value)(self.nodes_in(v) for v in value)
        if isinstance(value, dict):
            return {k: self.nodes_in(v) for k, v in value.items()}
        return self.node_of(value)

    def constant(self, tensor: torch.Tensor) -> fx.Node:
        """A tensor made outside the recorded ops (torch.tensor([...]) in the loader, say)."""
        name = f"_loader_constant{self.constants}"
        self.constants += 1
        setattr(self.root, name, tensor)
        node = self.graph.get_attr(name)
        node.meta["val"] = tensor
        self.bind(tensor, node)
        return node

    supports_higher_order_operators = True  # recorded through their dense implementation (capture/hops)

    def __torch_dispatch__(self, func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if any(t not in _PLAIN for t in types):  # a subclass (DTensor) runs its ops on the tensors it holds
            return NotImplemented
        if is_higher_order(func):
            return through_dense(self, func, args, kwargs)
        decomposed = self.decompositions.get(func)
        if decomposed is not None:
            with self:  # the mode is off inside its own handler: record the smaller ops
                return decomposed(*args, **kwargs)
        if _composite(func) and autograd_would_have_decomposed(func, tree_flatten((args, kwargs))[0]):
            with self:  # as make_fx: an op autograd would have broken up, called below it (a backward formula's view_as)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not _computes(func):
            return func(*args, **kwargs)
        node = self.graph.call_function(func, self.nodes_in(args), self.nodes_in(kwargs))
        self.created.append(node)
        out = func(*args, **_kept_on_meta(func, args, kwargs))
        if self.on_meta:
            _refuse_real_from_meta(func, args, out)
        node.meta["val"] = out
        where = self.where()
        if where:
            node.meta["stack_trace"] = where
        tag_autograd_origin(node, sys._getframe(1))  # a backward formula is located at its forward op
        self.bind_all(out, node)
        return out

    def bind_all(self, value: Any, node: fx.Node) -> None:
        """Bind the tensors of an op's output, nested lists through getitem nodes as make_fx
        does (an in-place collective returns the tensors it wrote: later reads see the write)."""
        if isinstance(value, torch.Tensor):
            self.bind(value, node)
        elif isinstance(value, (tuple, list)):
            for i, item in enumerate(value):
                if isinstance(item, (torch.Tensor, tuple, list)):
                    item_node = self.graph.call_function(operator.getitem, (node, i))
                    item_node.meta["val"] = item
                    self.bind_all(item, item_node)

    def where(self) -> str:
        """The frames of the traced code outside torch and shardproof, outermost first, as make_fx
        writes them (`locations.locate` takes the innermost but a wrapper's; the outer ones are
        the calls that led there)."""
        frame, found = sys._getframe(2), []
        while frame is not None and frame is not self.entry:
            file = frame.f_code.co_filename
            if is_user_code(file):
                found.append(_frame_text(file, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        return "".join(reversed(found))


@functools.lru_cache(maxsize=8192)
def _frame_text(file: str, line: int, function: str) -> str:
    return f'  File "{file}", line {line}, in {function}\n    {linecache.getline(file, line).strip()}\n'


def _kept_on_meta(func: Any, args: tuple, kwargs: dict) -> dict:
    """A copy of a meta tensor to another device (a loader's `.to(device)`) made on meta: its
    value is all the recording needs, and meta tensors have no data to copy (the op is recorded
    as called)."""
    device = kwargs.get("device")
    if func is not _TO_COPY or device is None or not args or args[0].device.type != "meta":
        return kwargs
    return {**kwargs, "device": torch.device("meta")}


_TO_COPY = torch.ops.aten._to_copy.default


def _refuse_real_from_meta(func: Any, args: tuple, out: Any) -> None:
    """A real tensor computed from meta ones (a cpu `torch.zeros(n)` made in the traced code, then
    `scatter_add` of meta values into it) holds uninitialised memory, and reading it (`.tolist()`)
    would steer the trace by garbage: the run is retried on fake tensors, where reading a value
    computed from the data stops the trace at its line."""
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(first, torch.Tensor) or first.device.type == "meta":
        return
    if any(isinstance(a, torch.Tensor) and a.device.type == "meta" for a in tree_flatten(args)[0]):
        raise RuntimeError(f"{func} computed a real tensor from meta tensors")


@functools.lru_cache(maxsize=None)
def _composite(func: Any) -> bool:
    """An op with a CompositeImplicitAutograd kernel (not a metadata query, as make_fx leaves those;
    nor a TorchScript prim, which the dispatcher does not know)."""
    try:
        return func not in _METADATA and torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")
    except RuntimeError:
        return False


_METADATA = (torch.ops.aten.size.default, torch.ops.aten.stride.default, torch.ops.aten.storage_offset.default)


@functools.lru_cache(maxsize=None)
def _computes(func: Any) -> bool:
    """Ops returning tensors, writing into their arguments or returning nothing (called for their
    effect: markers, asserts), and messages to other ranks (`send`, and `recv_` and `alltoall_base_`,
    whose schemas do not say they write); not metadata queries (prim.device)."""
    schema = func._schema
    writes = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    return writes or not schema.returns or any("Tensor" in str(r.type) for r in schema.returns) or schema.name in _MESSAGES


_MESSAGES = {"c10d::send", "c10d::recv_", "c10d::recv_any_source_", "c10d::alltoall_base_"}


def record(
    fn: Callable[..., list[torch.Tensor]],
    inputs: list[torch.Tensor],
    before_retry: Callable[[], None] = lambda: None,
    decompositions: Decompositions | None = None,
    part: bool = False,
    on_meta: bool = True,
) -> tuple[Traced, list[torch.Tensor]]:
    """Run `fn(*inputs)` (`inputs` fake), recording its ops (`decompositions` broken into smaller
    ones, as make_fx's table does): (graph, its outputs as fake tensors). A `part` of a larger
    program (a module call) is located by the frames of its caller too. Backward formulas (`fn`
    may differentiate) are tagged as make_fx's under `autograd_origins` are.

    It runs on meta tensors, outside fake mode, several times faster (unless not `on_meta`: code
    that must see that it is traced, as functional collectives must to return plain tensors);
    code that meta tensors cannot run (a constant made on the cpu, say) runs again under fake
    mode, after `before_retry` (which undoes what the failed run left behind)."""
    if not on_meta:  # on twins still: autograd must not reach the inputs (nor fire their hooks)
        return _record(fn, _twins(inputs, None), decompositions or {}, part)
    try:
        with unset_fake_temporarily():
            twins = _twins(inputs, "meta")
            gm, outputs = _record(fn, twins, decompositions or {}, part, on_meta=True)
        device = inputs[0].device if inputs else "cpu"
        return gm, _twins(outputs, device)
    except (ShardproofError, NotPlain):
        raise
    except Exception:  # noqa: BLE001 - not meta-friendly code: record it on fake tensors
        before_retry()
        return _record(fn, inputs, decompositions or {}, part)


def _twins(tensors: list[torch.Tensor], device: str | None) -> list[torch.Tensor]:
    """Twins of the tensors (on `device`, None: each on its own), one per tensor: a tensor given
    twice (a tied embedding and head in a state dict) stays one tensor, as make_fx sees it."""
    made: dict[int, torch.Tensor] = {}
    return [made.setdefault(id(t), _twin(t, device or t.device)) for t in tensors]


def _twin(tensor: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A tensor with `tensor`'s metadata on `device` (a fake one when fake mode is on); even
    requires_grad, which changes how aten decomposes some ops (matmul folding)."""
    twin = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return twin.requires_grad_(tensor.requires_grad)


def _record(
    fn: Callable[..., list[torch.Tensor]], inputs: list[torch.Tensor], decompositions: Decompositions, part: bool,
    on_meta: bool = False,
) -> tuple[Traced, list[torch.Tensor]]:
    graph, root = fx.Graph(), torch.nn.Module()
    recorder = Recorder(graph, root, None if part else sys._getframe(), decompositions, on_meta)
    for i, tensor in enumerate(inputs):
        placeholder = graph.placeholder(f"arg{i}")
        placeholder.meta["val"] = tensor
        recorder.bind(tensor, placeholder)
    with recorder, _metadata_unrecorded():
        outputs = fn(*inputs)
        flat, _ = tree_flatten(outputs)
        graph.output([recorder.node_of(t) for t in flat])
    return Traced(graph, root), flat


@contextlib.contextmanager
def unrecorded() -> Iterator[None]:
    """Code run here is not part of the light tracer's recording under way, if any: a module
    call's graphs recorded apart while the program calling it is recorded (see partition/vjp)."""
    if not isinstance(_get_current_dispatch_mode(), Recorder):
        yield
        return
    with _pop_mode_temporarily():
        yield


@contextlib.contextmanager
def _metadata_unrecorded() -> Iterator[None]:
    """DTensor works out an op's global output metadata by running it on empty tensors of the
    global shapes: no part of the program (make_fx is kept out of it by torch itself)."""
    original = ShardingPropagator._propagate_tensor_meta_non_cached

    def propagate(self: ShardingPropagator, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(_get_current_dispatch_mode(), Recorder):
            return original(self, *args, **kwargs)
        with _pop_mode_temporarily():
            return original(self, *args, **kwargs)

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original


def chain(first: Traced, then: fx.GraphModule) -> Traced:
    """One graph: `first`, then `then` with its placeholders bound to `first`'s outputs in order."""
    graph = fx.Graph()
    values: dict[fx.Node, Any] = {}
    outputs = graph.graph_copy(first.graph, values, return_output_node=False)
    for placeholder, value in zip((n for n in then.graph.nodes if n.op == "placeholder"), outputs):
        values[placeholder] = value
    graph.output(graph.graph_copy(then.graph, values))
    root = torch.nn.Module()
    for module in (first, then):
        for node in module.graph.nodes:
            if node.op == "get_attr":
                setattr(root, node.target, getattr(module, node.target))
    return Traced(graph, root)
