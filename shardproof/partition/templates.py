"""A repeated module's traced graph (a template), and the expansion of its calls into plain ops.

Capture leaves `call` nodes in the IR where a module call was answered from an earlier,
interchangeable one (see `fingerprint`): one IR node per output, attrs (template, output index,
qualified name of the module called), inputs the call's flat tensors. A template's graph has leaves `arg:0..n-1` bound to those inputs
in order, and may itself contain calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from shardproof.ir.graph import Graph, Location, Node


@dataclass(eq=False)
class Template:
    """The graph of the first call of one kind of module call (or its vector-Jacobian product);
    `module` names that first module, `site` is where it was called. An op located at `site` has
    no user line of its own inside the module (nn.Linear's matmul, say): in a copy, it is located
    where the copy is called (marked as a backward op still, if it is one)."""

    module: str
    graph: Graph
    site: Location | None = None
    gradient_of: tuple[int, ...] | None = None  # a VJP's: the argument each output is the gradient of
    _expanded: Graph | None = field(default=None, repr=False)

    def op_count(self) -> int:
        return self.graph.op_count()

    def expanded(self) -> Graph:
        """The graph with nested calls expanded (computed once)."""
        if self._expanded is None:
            self._expanded = expand(self.graph)
        return self._expanded


def has_calls(graph: Graph) -> bool:
    return any(node.op == "call" for node in graph.nodes)


def expand(graph: Graph, keep: Callable[[Node], bool] = lambda node: False) -> Graph:
    """The same program with every call (but those `keep` accepts) replaced by its template's ops,
    as a trace without reuse would have recorded it (locations are the first call's: the same lines)."""
    if not any(node.op == "call" and not keep(node) for node in graph.nodes):
        return graph
    out = Graph(rank=graph.rank)
    new_id: list[int] = []
    expansions: dict[tuple, list[int]] = {}  # (template, inputs) -> new ids of its outputs
    for node in graph.nodes:
        inputs = tuple(new_id[i] for i in node.inputs)
        if node.op == "call" and not keep(node):
            template, index, _ = node.attrs
            key = (template, inputs)
            if key not in expansions:
                expansions[key] = _inline(out, template, inputs, node.loc)
            new_id.append(expansions[key][index])
        else:
            new_id.append(out.add(node.op, inputs, node.attrs, node.shape, node.dtype, node.name, node.loc))
    out.outputs = [new_id[i] for i in graph.outputs]
    return out


def _inline(out: Graph, template: Template, inputs: tuple[int, ...], site: Location | None) -> list[int]:
    """Append the template's ops to `out`, its leaves `arg:i` bound to `inputs`, for a copy called
    at `site`; the ids of its outputs."""
    body = template.expanded()
    new_id: list[int] = []
    for node in body.nodes:
        if node.op == "leaf":
            new_id.append(inputs[argument_index(node.attrs[0])])
        else:
            args = tuple(new_id[i] for i in node.inputs)
            loc = node.loc
            if site is not None and _same_line(loc, template.site):
                loc = replace(site, backward=loc.backward)
            if site is not None and site.backward and loc is not None and loc.backward:
                loc = replace(loc, calls=site.calls)  # run by the `backward()` that ran the call (Location.calls)
            new_id.append(out.add(node.op, args, node.attrs, node.shape, node.dtype, node.name, loc))
    return [new_id[i] for i in body.outputs]


def _same_line(a: Location | None, b: Location | None) -> bool:
    return a is not None and b is not None and (a.file, a.line) == (b.file, b.line)


def argument_index(leaf_name: str) -> int:
    """`arg:3` -> 3: a template leaf is the call's flat input at that position."""
    prefix, _, index = leaf_name.partition(":")
    if prefix != "arg":
        raise ValueError(f"template leaf `{leaf_name}` is not a call argument")
    return int(index)


def argument_names(count: int) -> list[str]:
    return [f"arg:{i}" for i in range(count)]
