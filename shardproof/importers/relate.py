"""Infer how the distributed program's inputs relate to the reference's, and build rank graphs.

Inputs are paired by position, then by name where the position does not fit; extra distributed
inputs are further micro-batches of the earlier ones with the same shape (gradient accumulation).
Each pair gets candidate layouts from the shapes alone (replicate when equal, a shard on the one
dim whose size ratio is the number of parts), ranked by evidence from both programs: a fused
weight whose output the reference slices at [0, q, q+k, q+2k] and each rank at the same
boundaries divided by the world size is interleaved in those blocks. A tensor constant the dumps
do not record gets candidate values (`constants.py`). The proof picks among the
candidates (`importers/verify.py`); nothing here claims a layout is right.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from shardproof.errors import CaseError
from shardproof.importers.constants import reduction_identities
from shardproof.importers.graph_inputs import GraphInput, ImportedGraph
from shardproof.ir.build import GraphBuilder
from shardproof.ir.graph import Graph, Location
from shardproof.layouts import Layout, cut, plain_layout


@dataclass
class Pairing:
    """One distributed input, the reference input it is cut from, and the layouts to try."""

    dist: GraphInput
    ref: GraphInput
    candidates: list[Layout]
    pinned: bool = False

    def describe(self, layout: Layout, labels: ImportedGraph) -> str:
        pinned = " (pinned)" if self.pinned else ""
        name = labels.label(self.ref.name)
        return f"{self.dist.name} = {self.ref.name}{f' ({name})' if name != self.ref.name else ''} {layout.describe()}{pinned}"


def pair_inputs(ref: ImportedGraph, dist: ImportedGraph, world_size: int) -> list[Pairing]:
    """Pair every distributed input with a reference input and list its candidate layouts."""
    bounds_ref, bounds_dist = _boundaries(ref.graph), _boundaries(dist.graph)
    pairs = []
    for kind in (False, True):  # parameters, then constants whose values the dump elides
        refs = [i for i in ref.inputs if i.constant == kind]
        dists = [i for i in dist.inputs if i.constant == kind]
        for d, r, micro in _match(refs, dists, dist.path):
            layouts = _candidates(r.shape, d.shape, world_size, micro, bounds_ref, bounds_dist)
            if kind:
                layouts = _values(dist.graph, d) or layouts
            if not layouts:
                raise CaseError(
                    f"{dist.path}: input {d.name} {list(d.shape)} cannot be cut from reference input {r.name} "
                    f"{list(r.shape)} over {world_size} rank(s); pin its relation with --relations FILE"
                )
            pairs.append(Pairing(d, r, layouts))
    return pairs


def implied_world_size(ref: ImportedGraph, dist: ImportedGraph) -> int:
    """The rank count the input shapes imply: the one size ratio of inputs paired by position
    (1 when none is smaller, or when there are extra micro-batch inputs instead)."""
    refs = [i for i in ref.inputs if not i.constant]
    dists = [i for i in dist.inputs if not i.constant]
    if len(refs) != len(dists):
        return 1
    ratios = {f // l for r, d in zip(refs, dists) if _compatible(r, d) for f, l in zip(r.shape, d.shape) if f != l}
    return ratios.pop() if len(ratios) == 1 else 1


def _match(refs: list[GraphInput], dists: list[GraphInput], path: str) -> list[tuple[GraphInput, GraphInput, tuple[int, int]]]:
    """(distributed, reference, micro-batch) triples: by position, by name, extras as micro-batches."""
    by_name = {r.name: r for r in refs}
    base = dists[: len(refs)]
    paired = []
    for i, d in enumerate(base):
        r = refs[i]
        if not _compatible(r, d) and d.name in by_name and _compatible(by_name[d.name], d):
            r = by_name[d.name]
        paired.append([d, r, (0, 1)])
    split = [p for p in paired if p[0].shape != p[1].shape]
    extras = dists[len(refs) :]
    if extras:
        if not split or len(extras) % len(split):
            raise CaseError(
                f"{path}: {len(extras)} more input(s) than the reference ({', '.join(e.name for e in extras)}) "
                "and no matching micro-batch inputs; pin their relations with --relations FILE"
            )
        count = 1 + len(extras) // len(split)
        for p in split:
            p[2] = (0, count)
        for i, d in enumerate(extras):
            first = split[i % len(split)]
            if (d.shape, d.dtype) != (first[0].shape, first[0].dtype):
                raise CaseError(f"{path}: extra input {d.name} does not match micro-batch input {first[0].name}")
            paired.append([d, first[1], (1 + i // len(split), count)])
    return [(d, r, tuple(m)) for d, r, m in paired]


def _compatible(ref: GraphInput, dist: GraphInput) -> bool:
    if ref.dtype != dist.dtype or len(ref.shape) != len(dist.shape):
        return False
    return all(f == l or (l and f % l == 0) for f, l in zip(ref.shape, dist.shape))


def _candidates(
    full: tuple[int, ...], local: tuple[int, ...], n: int, micro: tuple[int, int],
    bounds_ref: dict[int, set[int]], bounds_dist: dict[int, set[int]],
) -> list[Layout]:  # fmt: skip
    plain = plain_layout(full, local, n, micro)
    if plain is None:
        return _replicated_blocks(full, local, n, micro, bounds_ref, bounds_dist)
    if plain.kind == "replicate":
        return [plain]
    parts, dim = n * micro[1], plain.dim
    size = full[dim]
    seen_ref = tuple(sorted(bounds_ref.get(size, set()) | {0, size}))
    seen_dist = tuple(sorted({b * parts for b in bounds_dist.get(local[dim], set())} | {0, size}))
    ranked = []
    if seen_ref == seen_dist:
        ranked.append(seen_ref)
    ranked += [(0, size), seen_dist, seen_ref]
    layouts = []
    for blocks in ranked:
        layout = replace(plain, blocks=blocks)
        if layout not in layouts and layout.fits(full, local, n):
            layouts.append(layout)
    return layouts


def _replicated_blocks(
    full: tuple[int, ...], local: tuple[int, ...], n: int, micro: tuple[int, int],
    bounds_ref: dict[int, set[int]], bounds_dist: dict[int, set[int]],
) -> list[Layout]:  # fmt: skip
    """A fused weight whose blocks are cut into different numbers of chunks (QKV with fewer kv
    heads than ranks: q over every rank, each kv head on several), read off the blocks both
    programs cut its one smaller dim at, matched in order: each block's chunk count is the ratio
    of its sizes."""
    dims = [d for d, (f, l) in enumerate(zip(full, local)) if f != l]
    if len(dims) != 1 or len(full) != len(local):
        return []
    dim = dims[0]
    ref_cuts = sorted(bounds_ref.get(full[dim], set()) | {0, full[dim]})
    dist_cuts = sorted(bounds_dist.get(local[dim], set()) | {0, local[dim]})
    if len(ref_cuts) != len(dist_cuts) or len(ref_cuts) < 3:
        return []
    sizes = [(b - a, d - c) for a, b, c, d in zip(ref_cuts, ref_cuts[1:], dist_cuts, dist_cuts[1:])]
    if any(part == 0 or whole % part for whole, part in sizes):
        return []
    layout = Layout("shard", dim, tuple(ref_cuts), micro, parts=tuple(whole // part for whole, part in sizes))
    return [layout] if layout.fits(full, local, n) else []


def _values(graph: Graph, constant: GraphInput) -> list[Layout]:
    return [
        Layout("value", value=v, why=f"not recorded in the dumps; inferred: the identity of the `{op}` reduction over ranks it reaches")
        for v, op in reduction_identities(graph, constant.node)
    ]


def _boundaries(graph: Graph) -> dict[int, set[int]]:
    """Where each program cuts a dim: size of the dim -> offsets it slices or concatenates at."""
    found: dict[int, set[int]] = {}
    for node in graph.nodes:
        if node.op == "slice":
            dim, start, end = node.attrs
            found.setdefault(graph[node.inputs[0]].shape[dim], set()).update((start, end))
        elif node.op == "cat":
            dim, offset = node.attrs[0], 0
            cuts = found.setdefault(node.shape[dim], set())
            for part in node.inputs:
                offset += graph[part].shape[dim]
                cuts.add(offset)
    return found


def pin(pairs: list[Pairing], ref: ImportedGraph, path: str | Path) -> None:
    """Apply hand-written relations: {"dist input": {"reference": name, "layout": "replicate"|"shard",
    "dim": d, "blocks": [...], "micro": [i, m]}} or, for a constant the dumps elide, {"value": v}
    (on both sides); the inferred pairing stays for inputs not named."""
    try:
        pinned = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise CaseError(f"--relations {path}: {err}") from err
    refs = {i.name: i for i in ref.inputs}
    by_dist = {p.dist.name: p for p in pairs}
    for name, spec in pinned.items():
        if name not in by_dist:
            raise CaseError(f"--relations {path}: no distributed input named {name} (inputs: {', '.join(by_dist)})")
        pair = by_dist[name]
        if "reference" in spec:
            if spec["reference"] not in refs:
                raise CaseError(f"--relations {path}: no reference input named {spec['reference']}")
            pair.ref = refs[spec["reference"]]
        pair.pinned = True
        if "value" in spec:
            if not pair.dist.constant:
                raise CaseError(f"--relations {path}: {name} is a graph input, not a constant; only constants take a value")
            pair.candidates = [Layout("value", value=spec["value"], why="not recorded in the dumps")]
            continue
        dim = int(spec.get("dim", 0))
        if spec.get("layout", "replicate") == "shard" and not 0 <= dim < len(pair.ref.shape):
            raise CaseError(f"--relations {path}: {name}: dim {dim} is not a dim of {pair.ref.name} {list(pair.ref.shape)}")
        blocks = tuple(spec.get("blocks", (0, pair.ref.shape[dim] if pair.ref.shape else 1)))
        pair.candidates = [Layout(spec.get("layout", "replicate"), dim, blocks, tuple(spec.get("micro", (0, 1))))]


def with_values(graph: Graph, values: dict[str, float]) -> Graph:
    """The graph with the leaves named in `values` replaced by constants of those values."""
    nodes = [
        replace(n, op="const", attrs=(("full", values[n.attrs[0]]),)) if n.op == "leaf" and n.attrs[0] in values else n
        for n in graph.nodes
    ]
    return Graph(nodes, graph.outputs, graph.rank)


def rank_graph(dist: ImportedGraph, pairs: list[Pairing], layouts: list[Layout], rank: int, world_size: int) -> Graph:
    """The rank's program as a function of the reference inputs: each input leaf replaced by the
    ops that cut it from its reference input, then the rank's own nodes."""
    graph = Graph(rank=rank)
    b = GraphBuilder(graph)
    leaves: dict[str, int] = {}
    remap: dict[int, int] = {}
    node_of = {i.name: i.node for i in dist.inputs}
    for pair, layout in zip(pairs, layouts):
        ref = pair.ref
        b.at(pair.dist.name, Location(dist.path, 0, f"inferred: {pair.dist.name} = {ref.name} {layout.describe()}"))
        if ref.name not in leaves:
            leaves[ref.name] = graph.add("leaf", (), (ref.name,), ref.shape, ref.dtype, ref.name)
        remap[node_of[pair.dist.name]] = b.convert(cut(b, leaves[ref.name], layout, rank, world_size), pair.dist.dtype)
    for node in dist.graph.nodes:
        if node.id in remap:
            continue
        if node.op == "leaf":
            raise CaseError(f"{dist.path}: input {node.name} has no relation to the reference")
        inputs = tuple(remap[i] for i in node.inputs)
        remap[node.id] = graph.add(node.op, inputs, node.attrs, node.shape, node.dtype, node.name, node.loc)
    graph.outputs = [remap[o] for o in dist.graph.outputs]
    return graph
