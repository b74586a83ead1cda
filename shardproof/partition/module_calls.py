"""Trace each kind of repeated module call once: its copies become `call` nodes of the IR.

During one make_fx trace, the forward of every module that has a structural twin in the model is
wrapped. The first call of each kind (see `fingerprint.call_key`) is traced as usual, between two
marker ops that name its inputs and outputs. A later call with the same key is not traced at all:
it records one `shardproof.call` op whose outputs have the first call's metadata. After the trace,
the ops between the markers become the kind's `Template` graph and are replaced by a call of it
too, and each `shardproof.call` lowers to IR `call` nodes of that template. A 126-layer model is
thus traced as one layer plus 125 ops, and proven as 126 calls (partition/execute).

Checks that keep this sound: a first call that changes its module's state, writes into its inputs,
returns tensors sharing memory with its inputs or mutable non-tensor values is never reused; one whose
ops read a traced value that is not among its inputs (a tensor held outside the module) makes the
trace start over without reuse for that kind.

A call that gradients flow through (training) is not traced inline even the first time: every call
of its kind runs as a `_DifferentiatedCall` autograd Function recording one `call` op forward and one
backward, over the kind's forward and VJP templates (see `vjp`); autograd then routes the
gradients through the copies as through the module.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from shardproof.capture.dispatch_trace import Decompositions, Traced
from shardproof.capture.locations import locate
from shardproof.ir import from_fx
from shardproof.ir.graph import Graph
from shardproof.partition.fingerprint import PLAIN_DATA, WRAPPED, call_key, module_key, tensor_key
from shardproof.partition.templates import Template, argument_names
from shardproof.partition.vjp import Apart, record_apart, shares_memory

Lower = Callable[[Traced | fx.GraphModule, list[str], list[str]], Graph]  # (graph, leaf names, reduce ops) -> IR

_LIB = torch.library.Library("shardproof", "DEF")
_LIB.define("region_enter(Tensor[] inputs, int region) -> ()")
_LIB.define("region_exit(Tensor[] outputs, int region) -> ()")
_LIB.define("call(Tensor[] inputs, int region, int site) -> Tensor[]")
_OUTPUTS: dict[int, list[tuple]] = {}  # region id -> (shape, stride, dtype, device) per tensor output
_TEMPLATES: dict[int, Template] = {}  # region id -> its template, while a graph with calls is lowered
_SITES: dict[int, str] = {}  # call site id -> qualified name of the module called there
_ids = itertools.count()
_TENSOR = object()  # placeholder for tensor leaves among a call's recorded non-tensor outputs


def _marker(tensors: list[torch.Tensor], region: int) -> None:
    return None


def _call(inputs: list[torch.Tensor], region: int, site: int, meta: bool = False) -> list[torch.Tensor]:
    """Fresh tensors shaped like the first call's outputs (fake tensor mode runs the Meta kernel)."""
    return [
        torch.empty_strided(shape, stride, dtype=dtype, device="meta" if meta else device)
        for shape, stride, dtype, device in _OUTPUTS[region]
    ]


for _key in ("CompositeExplicitAutograd", "Meta"):
    _LIB.impl("region_enter", _marker, _key)
    _LIB.impl("region_exit", _marker, _key)
_LIB.impl("call", _call, "CompositeExplicitAutograd")
_LIB.impl("call", lambda inputs, region, site: _call(inputs, region, site, meta=True), "Meta")


class Impure(Exception):
    """A first call's ops read a traced value that is not one of its inputs: trace again without reuse."""

    def __init__(self, key: Hashable):
        super().__init__("a repeated module reads a value from outside its inputs")
        self.key = key


@dataclass
class Region:
    """The first call of one kind, traced inline between markers."""

    id: int
    key: Hashable
    module: str
    spec: TreeSpec
    leaves: list[Any]  # the output's pytree leaves, _TENSOR where a tensor goes
    reduce_ops: list[str]  # ReduceOps of the in-place collectives it issued, in order
    reusable: bool
    copies: int = 0  # later calls answered from it


@dataclass
class Differentiated:
    """A kind of call gradients flow through: its graphs recorded apart, the region ids of its
    forward and VJP templates, and the module that made its first call."""

    apart: Apart
    module: str
    forward: int = field(default_factory=lambda: next(_ids))
    backward: int = field(default_factory=lambda: next(_ids))


class _DifferentiatedCall(torch.autograd.Function):
    """A copy of a call gradients flow through: one `call` op forward, one over the VJP backward."""

    @staticmethod
    def forward(ctx: Any, kind: Differentiated, sites: tuple[int, int], *flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.kind, ctx.site = kind, sites[1]
        ctx.save_for_backward(*flat)
        return tuple(torch.ops.shardproof.call(list(flat), kind.forward, sites[0]))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        inputs = [*ctx.saved_tensors, *(g.contiguous() for g in grads)]  # the VJP was recorded on contiguous ones
        found = iter(torch.ops.shardproof.call(inputs, ctx.kind.backward, ctx.site))
        return (None, None, *(next(found) if graded else None for graded in ctx.kind.apart.graded))


@dataclass
class CallMemo:
    """Wraps the forwards of a model's repeated modules for one trace (use as a context manager)."""

    root: nn.Module
    reduce_ops: list[str]  # the trace's record of in-place collective ReduceOps (appended by capture)
    gradients: bool  # the trace differentiates: calls reading grad-requiring tensors are differentiated
    decompositions: Decompositions  # composite ops broken up as in the trace (in graphs recorded apart)
    excluded: set[Hashable] = field(default_factory=set)  # modules' structure keys (call keys' first part)
    regions: dict[Hashable, Region] = field(default_factory=dict)
    differentiated: dict[Hashable, Differentiated | None] = field(default_factory=dict)  # None: traced inline
    sites: list[int] = field(default_factory=list)  # ids of the calls answered from a region
    _wrapped: list[tuple[nn.Module, Any]] = field(default_factory=list)
    _apart: int = 0  # graphs being recorded apart: calls inside them not differentiated are traced inline

    def __enter__(self) -> CallMemo:
        for name, module in repeated_modules(self.root):
            self._wrapped.append((module, module.__dict__.get("forward")))
            module.forward = self._wrap(name, module, module.forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        for module, previous in self._wrapped:
            if previous is None:
                del module.forward
            else:
                module.forward = previous
        self._wrapped.clear()

    def _wrap(self, name: str, module: nn.Module, original: Callable) -> Callable:
        # not named `forward`: make_fx keeps `forward` frames in stack traces, and a source
        # location is the innermost kept frame outside torch: the user's, not this one
        def reused_or_traced(*args: Any, **kwargs: Any) -> Any:
            found = call_key(module, args, kwargs, distributed=not self.gradients)
            if found is None or found[0][0] in self.excluded:
                return original(*args, **kwargs)
            key, flat = found
            if self.gradients and torch.is_grad_enabled() and any(t.requires_grad for t in flat):
                return self._differentiated(key, name, module, flat, original, args, kwargs)
            if self._apart:  # a region's markers there would be lowered with no template
                return original(*args, **kwargs)
            region = self.regions.get(key)
            if region is None:
                return self._first(key, name, module, flat, original, args, kwargs)
            if not region.reusable:
                return original(*args, **kwargs)
            region.copies += 1
            outputs = iter(torch.ops.shardproof.call(flat, region.id, self._site(name)))
            return tree_unflatten([next(outputs) if leaf is _TENSOR else leaf for leaf in region.leaves], region.spec)

        setattr(reused_or_traced, WRAPPED, original)
        return reused_or_traced

    def _first(
        self, key: Hashable, name: str, module: nn.Module, flat: list[torch.Tensor], original: Callable, args: tuple, kwargs: dict
    ) -> Any:
        region_id = next(_ids)
        state_before = module_key(module)
        versions = [t._version for t in flat]
        issued = len(self.reduce_ops)
        torch.ops.shardproof.region_enter(flat, region_id)
        out = original(*args, **kwargs)
        leaves, spec = tree_flatten(out)
        tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
        torch.ops.shardproof.region_exit(tensors, region_id)
        reusable = (
            module_key(module) == state_before
            and versions == [t._version for t in flat]
            and all(tensor_key(t) is not None for t in tensors)
            and not shares_memory(tensors, flat)
            and all(isinstance(leaf, (torch.Tensor, *PLAIN_DATA)) for leaf in leaves)
        )
        if reusable:
            _OUTPUTS[region_id] = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in tensors]
        marked = [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        self.regions[key] = Region(region_id, key, name, spec, marked, list(self.reduce_ops[issued:]), reusable)
        return out

    def _differentiated(
        self, key: Hashable, name: str, module: nn.Module, flat: list[torch.Tensor], original: Callable, args: tuple, kwargs: dict
    ) -> Any:
        if key not in self.differentiated:
            self.differentiated[key] = self._recorded_apart(name, module, flat, original, args, kwargs)
        kind = self.differentiated[key]
        if kind is None:
            return original(*args, **kwargs)
        sites = (self._site(name), self._site(f"{name} (backward)"))
        outputs = iter(_DifferentiatedCall.apply(kind, sites, *flat))
        leaves = [next(outputs) if isinstance(leaf, torch.Tensor) else leaf for leaf in kind.apart.leaves]
        return tree_unflatten(leaves, kind.apart.spec)

    def _recorded_apart(
        self, name: str, module: nn.Module, flat: list[torch.Tensor], original: Callable, args: tuple, kwargs: dict
    ) -> Differentiated | None:
        self._apart += 1
        try:
            apart = record_apart(module, original, args, kwargs, flat, self.reduce_ops, self.decompositions)
        finally:
            self._apart -= 1
        if apart is None:
            return None
        kind = Differentiated(apart, name)
        for region, recorded in ((kind.forward, apart.forward), (kind.backward, apart.backward)):
            _OUTPUTS[region] = [(tuple(t.shape), tuple(t.stride()), t.dtype, t.device) for t in recorded.outputs]
        return kind

    def _site(self, module: str) -> int:
        site = next(_ids)
        self.sites.append(site)
        _SITES[site] = module
        return site

    def lower(self, gm: Traced | fx.GraphModule, leaf_names: list[str], lower: Lower) -> Graph:
        """IR of the traced graph: templates of the reused regions first, then the graph with calls."""
        by_id = {r.id: r for r in self.regions.values() if r.copies}
        try:
            self._lower_differentiated(gm, lower)
            while by_id:  # innermost first: an outer template then calls the inner ones
                region_id, (enter, body, outputs, exit_marker) = next(iter(_regions(gm.graph, set(by_id)).items()))
                region, inputs = by_id.pop(region_id), list(enter.args[0])
                sub = _subgraph(gm, inputs, body, outputs, region.key)
                graph = lower(sub, argument_names(len(inputs)), region.reduce_ops)
                _TEMPLATES[region_id] = Template(region.module, graph, locate(enter))
                _as_call(gm.graph, (enter, exit_marker), body, outputs, self._site(region.module))
            return lower(gm, leaf_names, self.reduce_ops)
        finally:
            self.forget()

    def _lower_differentiated(self, gm: Traced | fx.GraphModule, lower: Lower) -> None:
        """The templates of the differentiated kinds, each located where its first copy was called
        (kinds called inside another's templates come first: they were recorded first)."""
        kinds = [kind for kind in self.differentiated.values() if kind is not None]
        first_site = {}
        for graph in [gm.graph, *(recorded.graph.graph for k in kinds for recorded in (k.apart.forward, k.apart.backward))]:
            for node in graph.nodes:
                if node.target is torch.ops.shardproof.call.default:
                    first_site.setdefault(node.args[1], node)
        for kind in kinds:
            if kind.forward not in first_site:  # recorded in a run that failed and was recorded again
                continue
            site, apart = locate(first_site[kind.forward]), kind.apart
            arguments = len(apart.graded)
            forward = lower(apart.forward.graph, argument_names(arguments), apart.forward.reduce_ops)
            _TEMPLATES[kind.forward] = Template(kind.module, forward, site)
            backward = lower(apart.backward.graph, argument_names(arguments + len(forward.outputs)), apart.backward.reduce_ops)
            graded = tuple(i for i, has_gradient in enumerate(apart.graded) if has_gradient)
            _TEMPLATES[kind.backward] = Template(kind.module, backward, site, graded)

    def forget(self) -> None:
        """Drop every call recorded so far (the trace starts over, or is done)."""
        for region in self.regions.values():
            _TEMPLATES.pop(region.id, None)
            _OUTPUTS.pop(region.id, None)
        for kind in filter(None, self.differentiated.values()):
            for region in (kind.forward, kind.backward):
                _TEMPLATES.pop(region, None)
                _OUTPUTS.pop(region, None)
        self.differentiated.clear()
        for site in self.sites:
            _SITES.pop(site, None)
        self.regions.clear()
        self.sites.clear()


Tracer = Callable[[Callable[[], None]], Traced | fx.GraphModule]  # given a restart hook, the traced graph


def trace_with_memo(
    root: nn.Module | None,
    reduce_ops: list[str],
    trace: Tracer,
    leaf_names: list[str],
    lower: Lower,
    gradients: bool,
    decompositions: Decompositions,
) -> Graph:
    """Trace with repeated module calls of `root` reused (None: plain trace), then lower to IR.

    `trace` calls its argument before it runs the function again in the same trace (a tracer that
    gave up halfway): that forgets the calls and collectives recorded so far. `gradients`: the
    traced function differentiates (then calls that gradients flow through are differentiated,
    their graphs recorded apart with `decompositions`). A kind whose first call turns out to read
    outside values is excluded (every call of its module's structure) and the trace redone."""
    recorded_before = len(reduce_ops)

    def forget_collectives() -> None:
        del reduce_ops[recorded_before:]

    if root is None:
        return lower(trace(forget_collectives), leaf_names, reduce_ops)
    excluded: set[Hashable] = set()
    while True:
        forget_collectives()
        with CallMemo(root, reduce_ops, gradients, decompositions, excluded) as memo:

            def restart() -> None:
                forget_collectives()
                memo.forget()

            gm = trace(restart)
        try:
            return memo.lower(gm, leaf_names, lower)
        except Impure as impure:
            # every call of that module structure: the call key may name objects a trace makes
            # anew (an attention-mask object, by identity), which the next trace's key would not
            excluded.add(impure.key[0])


def repeated_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Submodules (not the root) with at least one structural twin: candidates for reuse."""
    keys: dict[int, Hashable] = {}  # id(module) -> its key, each subtree keyed once
    keyed = [(name, module, module_key(module, keys)) for name, module in root.named_modules() if module is not root]
    counts: dict[Hashable, int] = {}
    for _, _, key in keyed:
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    return [(name, module) for name, module, key in keyed if key is not None and counts[key] > 1]


def _regions(graph: fx.Graph, wanted: set[int]) -> dict[int, tuple[fx.Node, list[fx.Node], list[fx.Node], fx.Node]]:
    """(enter marker, body, outputs, exit marker) of each wanted region, ordered by where it ends
    (inner ones first)."""
    enter: dict[int, fx.Node] = {}
    bodies: dict[int, list[fx.Node]] = {}
    found = {}
    for node in graph.nodes:
        if node.target is torch.ops.shardproof.region_exit.default and node.args[1] in enter:
            region_id = node.args[1]
            found[region_id] = (enter.pop(region_id), bodies.pop(region_id), list(node.args[0]), node)
        for body in bodies.values():
            body.append(node)
        if node.target is torch.ops.shardproof.region_enter.default and node.args[1] in wanted:
            enter[node.args[1]] = node
            bodies[node.args[1]] = []
    return found


def _subgraph(gm: Traced | fx.GraphModule, inputs: list[fx.Node], body: list[fx.Node], outputs: list[fx.Node], key: Hashable) -> Traced:
    """The region's ops as a graph of its own, inputs as placeholders; Impure if it reads anything else."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, node in enumerate(inputs):
        placeholder = graph.placeholder(f"arg_{i}")
        placeholder.meta = dict(node.meta)
        env.setdefault(node, placeholder)
    inside = set(body)

    def mapped(node: fx.Node) -> fx.Node:
        if node in env:
            return env[node]
        if node.op == "get_attr":
            env[node] = graph.node_copy(node)
            return env[node]
        raise Impure(key)

    for node in body:
        for used in node.all_input_nodes:
            if used not in inside and used not in env:
                mapped(used)
        env[node] = graph.node_copy(node, mapped)
    graph.output([mapped(node) for node in outputs])
    return Traced(graph, gm)


def _as_call(graph: fx.Graph, markers: tuple[fx.Node, fx.Node], body: list[fx.Node], outputs: list[fx.Node], site: int) -> None:
    """The first call's ops replaced by a call of its template, as its copies are: every rank then
    proves it with them, instead of building its ops rank by rank. Left inline where a later op
    reads one of its values other than its outputs."""
    enter, exit_marker = markers
    inside = {*body, exit_marker}
    if any(user not in inside for node in body if node not in outputs for user in node.users):
        return
    with graph.inserting_after(exit_marker):
        call = graph.call_function(torch.ops.shardproof.call.default, (list(enter.args[0]), enter.args[1], site))
    call.meta = {key: value for key, value in enter.meta.items() if key == "stack_trace"}
    call.meta["val"] = [node.meta["val"] for node in outputs]
    anchor = call
    for i, output in enumerate(outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, i))
        anchor.meta["val"] = output.meta["val"]
        output.replace_all_uses_with(anchor, delete_user_cb=lambda user: user not in inside)
    for node in reversed([enter, *body, exit_marker]):
        graph.erase_node(node)


def _lower_call(lo: from_fx.Lowerer, inputs: list, region: int, site: int) -> tuple[int, ...]:
    template, module = _TEMPLATES[region], _SITES[site]
    args = tuple(lo.tensor(x) for x in inputs)
    body = template.graph
    return tuple(
        lo.emit("call", args, (template, index, module), body[out].shape, body[out].dtype)
        for index, out in enumerate(body.outputs)
    )


def _no_value(lo: from_fx.Lowerer, *args: Any, **kwargs: Any) -> tuple:
    return ()


from_fx.register_lowering("shardproof.region_enter", _no_value)
from_fx.register_lowering("shardproof.region_exit", _no_value)
from_fx.register_lowering("shardproof.call", _lower_call)
