"""Chain the graphs torch.compile broke one rank's program into (`fw.g0`, `fw.g1`, ... or the joint
`both.g0`, `both.g1`, ...) into the one graph of the whole program.

At a graph break Python runs the code dynamo could not trace (a print, a branch on data) and
resumes in the next graph, which takes the tensors it needs as its inputs. The dumps do not record
which: an input of a later graph is taken to be the earlier graph's output of its shape and dtype
when exactly one has it, and an input of the program when none has; anything else is refused.
The links are stated in the report (`Chain.links`), since they are assumptions about code the dumps
do not show: that it passes tensors on unchanged.

Joint graphs run their backward in reverse: the tangent of an output a later graph takes is the sum
of the gradients that graph returns for the inputs it was passed to. A joint graph's tangents
belong to its floating-point outputs in order (AOTAutograd makes one per differentiable output).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from shardproof.errors import CaseError

Link = tuple[int, str, int, int]  # (graph, input name) is (graph, forward output) of an earlier graph


@dataclass
class Part:
    """One parsed graph: its inputs, forward outputs, and (joint graphs) gradients and tangents."""

    graph: fx.Graph
    path: str
    names: list[str]  # output names, as the parser gives them
    primals: list[fx.Node] = field(default_factory=list)
    tangents: list[fx.Node] = field(default_factory=list)
    forward: list[fx.Node] = field(default_factory=list)
    gradients: dict[str, fx.Node] = field(default_factory=dict)  # primal name -> its gradient
    tangent_of: dict[int, fx.Node] = field(default_factory=dict)  # forward output -> its tangent

    @classmethod
    def of(cls, graph: fx.Graph, names: list[str], path: str) -> Part:
        part = cls(graph, path, names)
        for node in graph.nodes:
            if node.op == "placeholder":
                (part.tangents if node.meta["dump_name"].startswith("tangents") else part.primals).append(node)
        output = next(n for n in graph.nodes if n.op == "output")
        gradient_of = output.meta.get("gradient_of", {})
        values = output.args[0]
        part.forward = [v for k, v in enumerate(values) if k not in gradient_of]
        part.gradients = {name: values[k] for k, name in gradient_of.items()}
        return part

    def match_tangents(self) -> dict[int, fx.Node]:
        if not self.tangents:
            return {}
        floating = [k for k, v in enumerate(self.forward) if _value(v).is_floating_point()]
        fits = len(floating) == len(self.tangents) and all(
            _same_type(self.forward[k], t) for k, t in zip(floating, self.tangents)
        )
        if not fits:
            raise CaseError(
                f"{self.path}: {len(self.tangents)} tangents for {len(floating)} floating-point outputs, so which output "
                "each tangent belongs to is not recorded; to verify a program with graph breaks, dump its graphs with "
                "one tangent per differentiable output, or compile it as one graph (fullgraph=True)"
            )
        return dict(zip(floating, self.tangents))


@dataclass
class Chain:
    graph: fx.Graph
    names: list[str]
    links: list[Link]


def chain(parts: list[Part]) -> Chain:
    """The graphs of one rank as one graph; a single graph is returned as it is."""
    if len(parts) == 1:
        return Chain(parts[0].graph, parts[0].names, [])
    for part in parts:
        part.tangent_of = part.match_tangents()
    links = _links(parts)
    return _Merger(parts, links).merge()


def describe(link: Link, parts: list[Part]) -> str:
    graph, name, source, output = link
    return (
        f"graph {graph} input `{name}` = graph {source} output {output} (`{parts[source].forward[output].name}`) "
        "(the dumps do not record what runs between graphs; taken as passed on unchanged, the one earlier output "
        "of its shape and dtype)"
    )


def _links(parts: list[Part]) -> list[Link]:
    links = []
    for k, part in enumerate(parts[1:], start=1):
        taken: dict[tuple[int, int], str] = {}
        for p in part.primals:
            found = [(j, i) for j in range(k) for i, o in enumerate(parts[j].forward) if _same_type(o, p)]
            name = p.meta["dump_name"]
            if len(found) > 1:
                where = ", ".join(f"output {i} of graph {j}" for j, i in found)
                raise CaseError(
                    f"{part.path}: input `{name}` ({_type(p)}) may be {where}: the dumps do not record which; "
                    "move the graph break (torch._dynamo.explain lists them) or compile the program as one graph"
                )
            if found and found[0] in taken:
                j, i = found[0]
                raise CaseError(
                    f"{part.path}: inputs `{taken[found[0]]}` and `{name}` both have the shape of graph {j}'s output {i}, "
                    "and a graph takes one tensor once, so one of them is an input of the program: the dumps do not "
                    "record which; move the graph break or compile the program as one graph"
                )
            if found:
                taken[found[0]] = name
                links.append((k, name, *found[0]))
    return links


class _Merger:
    """Copies the parts' nodes into one graph: every forward part in graph order, then the parts
    that need a tangent computed from later graphs, in reverse graph order."""

    def __init__(self, parts: list[Part], links: list[Link]):
        self.parts, self.links = parts, links
        self.graph = fx.Graph()
        self.env: list[dict[fx.Node, fx.Node]] = [{} for _ in parts]
        self.linked = {(g, name): (j, i) for g, name, j, i in links}
        self.consumed = {(j, i) for _, _, j, i in links}

    def merge(self) -> Chain:
        parts = self.parts
        for k, part in enumerate(parts):
            for p in part.primals:
                if (k, p.meta["dump_name"]) not in self.linked:
                    self.env[k][p] = self.placeholder(k, p)
            for i, t in part.tangent_of.items():
                if (k, i) not in self.consumed:
                    self.env[k][t] = self.placeholder(k, t)
        late = [self.late_nodes(k) for k in range(len(parts))]
        for k, part in enumerate(parts):
            for p in part.primals:
                if (k, p.meta["dump_name"]) in self.linked:
                    j, i = self.linked[k, p.meta["dump_name"]]
                    self.env[k][p] = self.env[j][parts[j].forward[i]]
            self.copy(k, [n for n in part.graph.nodes if n.op not in ("placeholder", "output") and n not in late[k]])
        for k in reversed(range(len(parts))):
            for i, t in parts[k].tangent_of.items():
                if (k, i) in self.consumed:
                    self.env[k][t] = self.tangent(k, i, t)
            self.copy(k, [n for n in parts[k].graph.nodes if n in late[k] and n.op != "placeholder"])
        return self.outputs()

    def placeholder(self, k: int, node: fx.Node) -> fx.Node:
        name = f"g{k}.{node.meta['dump_name']}"
        new = self.graph.placeholder(f"g{k}_{node.name}")
        new.meta.update(val=node.meta["val"], dump_name=name)
        return new

    def late_nodes(self, k: int) -> set[fx.Node]:
        """The nodes of part k that need a tangent the later graphs compute."""
        part = self.parts[k]
        late = {t for i, t in part.tangent_of.items() if (k, i) in self.consumed}
        for node in part.graph.nodes:
            if node.op != "output" and any(a in late for a in node.all_input_nodes):
                late.add(node)
        return late

    def copy(self, k: int, nodes: list[fx.Node]) -> None:
        env = self.env[k]
        for node in nodes:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            new = self.graph.create_node(node.op, node.target, args, kwargs, name=f"g{k}_{node.name}")
            new.meta.update(node.meta, dump_path=self.parts[k].path)
            env[node] = new

    def tangent(self, k: int, output: int, like: fx.Node) -> fx.Node:
        """The tangent of part k's forward output: the sum of the gradients of the inputs it was passed to."""
        gradients = [
            self.env[g][self.parts[g].gradients[name]]
            for g, name, j, i in self.links
            if (j, i) == (k, output) and self.parts[g].gradients.get(name) is not None
        ]
        value = like.meta["val"]
        if not gradients:  # no later graph differentiates it
            source = self.env[k][self.parts[k].forward[output]]
            return self.node(torch.ops.aten.zeros_like.default, (source,), value, f"g{k}_{like.name}")
        total = gradients[0]
        for g in gradients[1:]:
            total = self.node(torch.ops.aten.add.Tensor, (total, g), value, f"g{k}_{like.name}")
        return total

    def node(self, target, args: tuple, value: torch.Tensor, name: str) -> fx.Node:
        new = self.graph.create_node("call_function", target, args, {}, name=name)
        new.meta.update(val=value, dump_name=name)
        return new

    def outputs(self) -> Chain:
        """The forward outputs no later graph takes, then the gradients of the program's inputs."""
        values, names, gradient_of = [], [], {}
        for k, part in enumerate(self.parts):
            for i, value in enumerate(part.forward):
                if (k, i) not in self.consumed:
                    values.append(self.env[k][value])
                    names.append(f"g{k}.{value.name}")
        for k, part in enumerate(self.parts):
            for p in part.primals:
                name = p.meta["dump_name"]
                if (k, name) not in self.linked and part.gradients.get(name) is not None:
                    gradient_of[len(values)] = f"g{k}.{name}"
                    values.append(self.env[k][part.gradients[name]])
                    names.append(f"g{k}.{part.gradients[name].name}")
        self.graph.output(values).meta["gradient_of"] = gradient_of
        return Chain(self.graph, names, self.links)


def _value(node: fx.Node) -> torch.Tensor:
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor):
        raise CaseError(f"graph value `{node.name}` has no tensor type, so graphs cannot be chained by it")
    return value


def _same_type(a: fx.Node, b: fx.Node) -> bool:
    x, y = _value(a), _value(b)
    return (x.shape, x.dtype) == (y.shape, y.dtype)


def _type(node: fx.Node) -> str:
    value = _value(node)
    return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"

