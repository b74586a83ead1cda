"""Which graph values share memory, and how each is read out of the one it views.

make_fx (and the light tracer) route later reads of a written tensor through the op that wrote
it, but the other values of that memory (its base, other views of it) are still read through
their own, older nodes. The lowering makes such writes functional, as torch's functionalization
does, from the alias structure recorded here: a value is either a root (memory of its own) or
reads its source's memory through one step, a view op (`slice`, `view`, `permute`, a part of a
`split`, ...) or an identity (an in-place op returns the tensor it wrote; `alias`, `detach`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

IDENTITY, VIEW, PART = "identity", "view", "part"


@dataclass(frozen=True)
class Step:
    """How `node` reads the memory of `source`: as it is, through its own view op, or as part
    `index` of a list-returning view op (`split`, `unbind`) applied to `source`."""

    source: fx.Node
    how: str
    index: int | None = None


class Views:
    """The alias structure of one FX graph, read from the ops' schemas."""

    def __init__(self, graph: fx.Graph):
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.steps: dict[fx.Node, Step] = {}
        self.children: dict[fx.Node, list[fx.Node]] = {}
        for node in graph.nodes:
            step = _step(node)
            if step is not None:
                self.steps[node] = step
                self.children.setdefault(step.source, []).append(node)

    def chain(self, node: fx.Node) -> list[fx.Node]:
        """`node`, the value it views, and so on up to the root that owns the memory."""
        chain = [node]
        while chain[-1] in self.steps:
            chain.append(self.steps[chain[-1]].source)
        return chain

    def family(self, root: fx.Node) -> list[fx.Node]:
        """Every value reading `root`'s memory, `root` first, the others in graph order."""
        found, stack = [], [root]
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(self.children.get(node, []))
        return sorted(found, key=self.order.__getitem__)


def _step(node: fx.Node) -> Step | None:
    if node.op != "call_function":
        return None
    if node.target is operator.getitem:
        return _item_step(node)
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or not schema.arguments or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    returned, first = schema.returns[0].alias_info, schema.arguments[0].alias_info
    if returned is None or first is None:
        return None
    if returned.is_write or schema.name in _AS_IS:
        return Step(node.args[0], IDENTITY)  # an in-place op returns what it wrote
    return Step(node.args[0], VIEW)


_AS_IS = {"aten::alias", "aten::detach", "aten::lift_fresh"}  # views that read their input as it is


def _item_step(node: fx.Node) -> Step | None:
    """A part of a split (`split(x)[i]` views x), or a tensor an in-place collective wrote
    (`all_reduce_(tensors)[0][i]` is tensors[i])."""
    container, index = node.args
    if not isinstance(container, fx.Node) or not isinstance(index, int):
        return None
    step = _step(container)
    if step is not None and step.how == VIEW and str(container.target._schema.returns[0].type).startswith("List"):
        return Step(step.source, PART, index)
    if container.target is operator.getitem and container.args[1] == 0:
        written = written_by_collective(container.args[0])
        if written is not None and index < len(written) and isinstance(written[index], fx.Node):
            return Step(written[index], IDENTITY)
    return None


def written_by_collective(node: Any) -> list | None:
    """The tensors an in-place c10d collective writes (its first argument), if `node` is one."""
    schema = getattr(getattr(node, "target", None), "_schema", None)
    if schema is None or not (schema.name.startswith("c10d::") and schema.name.endswith("_")):
        return None
    tensors = node.args[0]
    return list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
