"""Execute IR graphs on real tensors: one graph, or all ranks of a program in lock-step.

This is the numeric meaning of an imported graph, with the ops' torch implementations from
`ir/ops.py`. Floats run in float64 and float-to-float casts are the identity (the proof's
equivalence is over the reals), so round-off never masks or fakes a difference. Collectives
have their exact meaning over each group, in rank order.
"""

from __future__ import annotations

import torch

from shardproof.ir.all_to_all import pieces
from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS, run_op

Values = dict[int, torch.Tensor]


def run_graph(graph: Graph, leaves: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The graph's outputs with leaf `name` bound to `leaves[name]` (no collectives allowed)."""
    return run_ranks([graph], leaves)[0]


def run_ranks(graphs: list[Graph], leaves: dict[str, torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every rank's outputs; rank r is `graphs[r]` and all ranks read the same leaves."""
    values: list[Values] = [{} for _ in graphs]
    cursors = [0] * len(graphs)
    while True:
        for r, graph in enumerate(graphs):
            cursors[r] = _run_until_collective(graph, values[r], leaves, cursors[r])
        waiting = [r for r, g in enumerate(graphs) if cursors[r] < len(g.nodes)]
        if not waiting:
            return [[values[r][o] for o in g.outputs] for r, g in enumerate(graphs)]
        group, members = _ready_group(graphs, cursors, waiting)
        inputs = [values[r][m.inputs[0]] for r, m in zip(group, members)]
        for position, (r, m) in enumerate(zip(group, members)):
            values[r][m.id] = _collective(m, members, inputs, position)
            cursors[r] += 1


def _ready_group(graphs: list[Graph], cursors: list[int], waiting: list[int]) -> tuple[tuple[int, ...], list[Node]]:
    """A group whose members all stand at the same collective (groups may resolve in any order)."""
    for r in waiting:
        node = graphs[r].nodes[cursors[r]]
        group = tuple(node.attrs[-1])
        members = [graphs[m].nodes[cursors[m]] if m < len(graphs) and cursors[m] < len(graphs[m].nodes) else None for m in group]
        if all(m is not None and m.op == node.op and tuple(m.attrs[-1]) == group for m in members):
            return group, members
    raise ValueError(f"ranks {waiting} wait on collectives their groups never complete")


def _run_until_collective(graph: Graph, values: Values, leaves: dict[str, torch.Tensor], start: int) -> int:
    for i in range(start, len(graph.nodes)):
        node = graph.nodes[i]
        if OPS[node.op].kind == "collective":
            return i
        values[node.id] = _one(node, [values[a] for a in node.inputs], leaves)
    return len(graph.nodes)


def _one(node: Node, args: list[torch.Tensor], leaves: dict[str, torch.Tensor]) -> torch.Tensor:
    if node.op == "leaf":
        return leaves[node.attrs[0]]
    if node.op == "const":
        return constant(node)
    if node.op == "convert" and _is_float(node.dtype) and args[0].is_floating_point():
        return args[0]
    return run_op(node.op, args, node.attrs)


def constant(node: Node) -> torch.Tensor:
    spec, dtype = node.attrs[0], numeric_dtype(node.dtype)
    if spec[0] == "full":
        return torch.full(node.shape, spec[1], dtype=dtype)
    if spec[0] == "values":
        return torch.tensor(spec[1], dtype=dtype).reshape(node.shape)
    if spec[0] == "arange":
        return torch.arange(*spec[1:], dtype=dtype).reshape(node.shape)
    return torch.zeros(node.shape, dtype=dtype)  # ("empty",): contents never read


def numeric_dtype(name: str) -> torch.dtype:
    """float64 for every float dtype; others as named."""
    return torch.float64 if _is_float(name) else getattr(torch, name)


def _is_float(name: str) -> bool:
    return name in ("float16", "bfloat16", "float32", "float64")


def _collective(node: Node, members: list[Node], inputs: list[torch.Tensor], position: int) -> torch.Tensor:
    if node.op == "all_to_all":
        found = pieces([m.attrs[1] for m in members], position)
        return torch.cat([inputs[j][start:end] for j, start, end in found])
    if node.op == "all_gather":
        return torch.cat(inputs, node.attrs[0])
    reduce_op = node.attrs[0] if node.op == "all_reduce" else node.attrs[1]
    stacked = torch.stack(inputs)
    total = {"sum": stacked.sum(0), "mean": stacked.mean(0), "max": stacked.amax(0), "min": stacked.amin(0)}[reduce_op]
    if node.op == "all_reduce":
        return total
    return total.chunk(len(inputs), node.attrs[0])[position]
