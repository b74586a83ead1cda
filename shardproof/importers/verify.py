"""`shardproof.verify_graphs`: the graph-dump front end. Imports two programs' dumps and relates
their inputs; the driver proves and reports.

The input layouts are inferred (`relate.py`); the proof decides among the candidates: the most
plausible assignment is proven first, and if it fails, each input's other candidates are tried
one at a time. The report states the layouts it assumed, because an imported graph does not
contain the checkpoint loader: equivalence holds for inputs cut that way.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from shardproof.driver import Candidate, verify_candidates
from shardproof.errors import CaseError
from shardproof.importers.graph_inputs import ImportedGraph
from shardproof.importers.numeric import run_graphs
from shardproof.importers.relate import Pairing, implied_world_size, pair_inputs, pin, rank_graph, with_values
from shardproof.importers.sources import Program, load_program
from shardproof.ir.graph import Graph
from shardproof.layouts import Layout
from shardproof.programs import Captured, Check, Output
from shardproof.report.model import Report

Split = tuple[tuple[int, int], ...]  # an output's tile: (dim, index of the mesh axis splitting it in ImportedGraph.axes)
MAX_ATTEMPTS = 12  # proofs tried over candidate layouts before reporting the most plausible one


@dataclass
class ImportedPair:
    """Both programs imported, their inputs paired with candidate layouts, outputs chosen."""

    reference: Program
    distributed: Program
    pairs: list[Pairing]
    compared: list[int]  # indices of the reference outputs compared
    checks: list[Check]  # one per compared output, over the restricted outputs
    seconds: float
    splits: dict[int, list[Split]] = field(default_factory=dict)  # output -> how it may be split, where the dump does not say

    def captured(self, layouts: list[Layout], splits: dict[int, Split] | None = None) -> Captured:
        """Reference and rank graphs over the same leaves, with these input layouts, each rank's
        outputs gathered over the mesh axes `splits` reads them as split over (default: the first
        reading of each)."""
        n = self.distributed.world_size
        splits = self.first_splits() if splits is None else splits
        values = {p.ref.name: layout.value for p, layout in zip(self.pairs, layouts) if layout.kind == "value"}
        ranks = [_gathered(rank_graph(g, self.pairs, layouts, r, n), g, splits) for r, g in enumerate(self.distributed.graphs)]
        ranks = [_restricted(with_values(g, values), self.compared) for g in ranks]
        reference = with_values(self.reference.graphs[0].graph, values)
        return Captured(_restricted(reference, self.compared), ranks, self.checks, self.seconds)

    def first_splits(self) -> dict[int, Split]:
        return {i: found[0] for i, found in self.splits.items()}

    def readings(self) -> Iterator[dict[int, Split]]:
        """The first reading of every split output, then each other reading of one at a time."""
        first = self.first_splits()
        yield first
        for i, found in self.splits.items():
            for other in found[1:]:
                yield {**first, i: other}

    def candidate(self, layouts: list[Layout], splits: dict[int, Split] | None = None) -> Candidate:
        """These input layouts as a reading for the driver, stating what it takes as given: input
        layouts, process groups, the outputs compared; and the constants the dumps do not show,
        which it leaves as unknown inputs (a discrepancy may then hold only for some of their values)."""
        splits = self.first_splits() if splits is None else splits
        captured = self.captured(layouts, splits)
        reference = self.reference.graphs[0]
        inputs = [p.describe(layout, reference) for p, layout in zip(self.pairs, layouts)]
        inputs += [self._describe_split(i, split) for i, split in sorted(splits.items())]
        inputs += [f"process group `{g}`: ranks {list(ranks)}" for g, ranks in sorted(self.distributed.groups.items())]
        inputs += [f"{side} {link}" for side, program in (("reference", self.reference), ("distributed", self.distributed)) for link in program.links]
        elided = _unrecorded(self.pairs, layouts)
        return Candidate(
            captured,
            self.distributed.world_size,
            lambda: run_graphs(captured.reference, captured.ranks, self.checks),
            _elements(captured.reference),
            unconfirmable="it may hold only for some values of the constants" if elided else "",
            inputs=inputs,
            outputs_compared=f"{len(self.compared)} of {len(reference.graph.outputs)}",
            caveat=(
                f"the dumps do not show the values of constants {', '.join(elided)} (taken as unknown inputs); "
                f"if the programs need them, pin them with --relations, e.g. {{\"{elided[0]}\": {{\"value\": 0}}}}"
            ) if elided else "",
        )

    def _describe_split(self, output: int, split: Split) -> str:
        """`output 0 = the reference's, Shard(0) over ranks [[0, 2], [1, 3]]`, saying it was inferred."""
        ranks = self.distributed.graphs
        parts = [f"Shard({dim}) over ranks {sorted(list(m) for m in {g.axes[axis][1] for g in ranks})}" for dim, axis in split]
        return (f"output {output} = the reference's, {' and '.join(parts)} (the dump does not state its sharding; "
                "inferred from the mesh axes it splits inputs over)")


def import_pair(
    reference: str | Path, distributed: str | Path, format: str | None = None, relations: str | Path | None = None
) -> ImportedPair:
    start = time.perf_counter()
    ref = load_program(reference, format, "reference")
    dist = load_program(distributed, format or ref.format, "distributed")
    if ref.world_size != 1:
        raise CaseError(f"{reference}: the reference must run on one device, but its graph spans {ref.world_size} ranks")
    _same_inputs_on_every_rank(dist)
    _as_many_outputs_on_every_rank(dist)
    implied = implied_world_size(ref.graphs[0], dist.graphs[0])
    if dist.world_size == 1 and implied > 1:
        dist.on_ranks(implied)
    pairs = pair_inputs(ref.graphs[0], dist.graphs[0], dist.world_size)
    if relations is not None:
        pin(pairs, ref.graphs[0], relations)
    compared, checks, splits = _outputs(ref.graphs[0], dist.graphs[0], dist.world_size)
    return ImportedPair(ref, dist, pairs, compared, checks, time.perf_counter() - start, splits)


def _as_many_outputs_on_every_rank(program: Program) -> None:
    """The ranks' dumps of one program return as many outputs (their shapes may differ: uneven
    shards). A rank that returns fewer or more is a damaged or mismatched dump, refused by name."""
    first = program.graphs[0]
    for graph in program.graphs[1:]:
        if len(graph.graph.outputs) != len(first.graph.outputs):
            raise CaseError(
                f"{graph.path}: returns {len(graph.graph.outputs)} outputs here but {len(first.graph.outputs)} in "
                f"{first.path}; the ranks of one program return as many"
            )


def _same_inputs_on_every_rank(program: Program) -> None:
    """The ranks' dumps of one program take the same inputs (names, shapes, dtypes, which are
    constants): the layouts inferred from rank 0's are every rank's. A rank that differs is a
    damaged or mismatched dump, refused by name."""
    first = program.graphs[0]
    expected = {i.name: i for i in first.inputs}
    for graph in program.graphs[1:]:
        found = {i.name: i for i in graph.inputs}
        for name in sorted(expected.keys() | found.keys()):
            a, b = expected.get(name), found.get(name)
            if a is None or b is None or (a.shape, a.dtype, a.constant) != (b.shape, b.dtype, b.constant):
                raise CaseError(
                    f"{graph.path}: input `{name}` is {_input_text(b)} here but {_input_text(a)} in {first.path}; "
                    "the ranks of one program take the same inputs"
                )


def _input_text(graph_input) -> str:  # noqa: ANN001 - a GraphInput or None
    if graph_input is None:
        return "absent"
    kind = "a constant the dump does not show" if graph_input.constant else "an input"
    return f"{kind} {graph_input.dtype}{list(graph_input.shape)}"


def verify_graphs(
    reference: str | Path,
    distributed: str | Path,
    *,
    format: str | None = None,
    relations: str | Path | None = None,
    progress: Callable[[str], None] = lambda _: None,
) -> Report:
    """Prove the distributed graphs compute what the reference graph does, or say where not."""

    def front_end() -> Iterator[Candidate]:
        progress("importing")
        pair = import_pair(reference, distributed, format, relations)
        for splits in pair.readings():
            for layouts in _assignments(pair.pairs):
                yield pair.candidate(layouts, splits)

    return verify_candidates(front_end, progress=progress)


def _unrecorded(pairs: list[Pairing], layouts: list[Layout]) -> list[str]:
    """The constants the dumps do not show that this assignment leaves as unknown inputs."""
    return [p.dist.name for p, layout in zip(pairs, layouts) if p.dist.constant and layout.kind != "value"]


def _assignments(pairs: list[Pairing]) -> Iterator[list[Layout]]:
    """The first-ranked layout for every input, then each alternative of one input at a time."""
    first = [p.candidates[0] for p in pairs]
    yield first
    tried = 1
    for i, pair in enumerate(pairs):
        for alternative in pair.candidates[1:]:
            if tried >= MAX_ATTEMPTS:
                return
            tried += 1
            yield first[:i] + [alternative] + first[i + 1 :]


def _outputs(ref: ImportedGraph, dist: ImportedGraph, n: int) -> tuple[list[int], list[Check], dict[int, list[Split]]]:
    """Which outputs to compare and how: all, position by position, when both return as many;
    else the leading outputs both name alike (an AOTAutograd forward returns the user's outputs
    first, then the tensors it saves for backward, which differ between the programs). An output
    that is neither a replica nor one of n shards may be split over mesh axes the dump states
    for its inputs (a 2-D mesh's data-parallel axis): each such reading is gathered and compared whole."""
    ref_out, dist_out = ref.graph.outputs, dist.graph.outputs
    if len(ref_out) == len(dist_out):
        indices = list(range(len(ref_out)))
    else:
        indices = []
        for i, (a, b) in enumerate(zip(ref.output_names, dist.output_names)):
            if a != b:
                break
            indices.append(i)
    if not indices:
        raise CaseError(f"{dist.path}: no outputs to compare with the reference's ({len(ref_out)} vs {len(dist_out)})")
    checks, splits = [], {}
    for position, i in enumerate(indices):
        full, local = ref.graph[ref_out[i]].shape, dist.graph[dist_out[i]].shape
        dims = [d for d, (f, l) in enumerate(zip(full, local)) if f != l]
        layout: Output = ("replicate",)
        if full != local:
            found = _mesh_splits(dist, full, local) if len(full) == len(local) else []
            if len(full) == len(local) and len(dims) == 1 and full[dims[0]] == local[dims[0]] * n:
                layout = ("shard", dims[0])
            elif found:
                splits[i] = found
            else:
                raise CaseError(f"{dist.path}: output {i} {list(local)} is no replica or shard of the reference's {list(full)}")
        checks.append(Check(_output_label(ref, i), position, position, layout))
    return indices, checks, splits


def _mesh_splits(dist: ImportedGraph, full: tuple[int, ...], local: tuple[int, ...]) -> list[Split]:
    """The ways `local` may be a tile of `full` split over the mesh axes the dump states its
    inputs are split over, one axis per split dim: first the axes that split an input of the
    same shape along the same dim (a residual stream keeps its batch's layout)."""
    options = []
    for dim, (f, l) in enumerate(zip(full, local)):
        if f == l:
            continue
        fitting = [k for k, (_, members) in enumerate(dist.axes) if l * len(members) == f]
        alike = {dist.split[i.name][dim] for i in dist.inputs if i.shape == full and dim in dist.split.get(i.name, {})}
        options.append([(dim, k) for k in sorted(fitting, key=lambda k: k not in alike)])
    return [split for split in itertools.product(*options) if len({k for _, k in split}) == len(split)]


def _gathered(graph: Graph, dist: ImportedGraph, splits: dict[int, Split]) -> Graph:
    """The rank's graph with each split output all-gathered over its axes: the whole output."""
    for i, split in splits.items():
        out = graph[graph.outputs[i]]
        for dim, axis in split:
            members = dist.axes[axis][1]
            shape = tuple(s * len(members) if d == dim else s for d, s in enumerate(out.shape))
            out = graph[graph.add("all_gather", (out.id,), (dim, members), shape, out.dtype, f"{out.name}_gathered", out.loc)]
        graph.outputs[i] = out.id
    return graph


def _restricted(graph: Graph, outputs: list[int]) -> Graph:
    return Graph(graph.nodes, [graph.outputs[i] for i in outputs], graph.rank)


def _elements(graph: Graph) -> int:
    return sum(math.prod(n.shape) for n in graph.nodes)


def _output_label(graph: ImportedGraph, i: int) -> str:
    """`output 3 (add_24)`, or what it is when the dump says: `gradient of `ln.weight` (output 3, add_24)`."""
    name = graph.output_names[i] if i < len(graph.output_names) else ""
    if i in graph.gradient_of:
        return f"gradient of `{graph.label(graph.gradient_of[i])}` (output {i}" + (f", {name})" if name else ")")
    return f"output {i}" + (f" ({name})" if name else "")
