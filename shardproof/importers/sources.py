"""Find the graph files of one side (reference or distributed) and import them, one graph per rank.

A side is a file or a directory. HLO: one module (an SPMD program run by every rank, its world
size read from its replica groups) or one file per rank. FX readable dumps: one file per rank and
graph, named like `fw.g0.r1.py` (graph kind, graph id, rank); the graphs of a rank are chained in
graph-id order (`fx_chain.py`); when a directory holds several kinds, the joint forward+backward
graph (`both`) is the one that covers the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from shardproof.errors import CaseError
from shardproof.importers.graph_inputs import ImportedGraph

FORMATS = ("hlo", "fx")
_RANK = re.compile(r"^(?P<group>.*?)[._-]?r(?:ank)?(?P<rank>\d+)(\.hlo)?(\.txt|\.py)?$")
_GRAPH = re.compile(r"^(?P<kind>.*?)\.g(?P<id>\d+)$")  # `fw.g1`: kind and graph id


@dataclass
class Program:
    """One side of the comparison: its graphs, one per rank."""

    path: str
    format: str
    graphs: list[ImportedGraph]
    spmd: Callable[[int], list[ImportedGraph]] | None = None  # an SPMD module lowered for n ranks
    groups: dict[str, tuple[int, ...]] = field(default_factory=dict)  # process group name -> its ranks
    links: list[str] = field(default_factory=list)  # how graphs broken apart were chained, stated as assumed

    @property
    def world_size(self) -> int:
        return len(self.graphs)

    def on_ranks(self, world_size: int) -> None:
        """Run an SPMD module without collectives (whose rank count it cannot tell) on n ranks."""
        if self.spmd is None:
            raise CaseError(f"{self.path}: {self.world_size} rank file(s), but the shapes say {world_size} ranks")
        self.graphs = self.spmd(world_size)


def load_program(path: str | Path, format: str | None, side: str) -> Program:
    ranks = graph_files(Path(path), side)
    format = format or detect_format(ranks[0][0])
    if format not in FORMATS:
        raise CaseError(f"unknown graph format `{format}`: use one of {', '.join(FORMATS)}")
    if format == "hlo":
        if len(ranks[0]) > 1:
            raise CaseError(f"{path}: several HLO modules per rank ({', '.join(f.name for f in ranks[0])}); pass one")
        files = [graphs[0] for graphs in ranks]
        from shardproof.importers.hlo import load_hlo, lower_hlo, world_size_of

        modules = [load_hlo(str(f)) for f in files]
        if len(modules) == 1:
            module = modules[0]

            def spmd(size: int) -> list[ImportedGraph]:
                return [lower_hlo(module, r, size) for r in range(size)]

            return Program(str(path), format, spmd(world_size_of(module) or 1), spmd)
        return Program(str(path), format, [lower_hlo(m, r, len(modules)) for r, m in enumerate(modules)])
    from shardproof.importers.fx_dump import load_fx_ranks

    graphs, groups, links = load_fx_ranks([[str(f) for f in graphs] for graphs in ranks])
    return Program(str(path), format, graphs, groups=groups, links=links)


def graph_files(path: Path, side: str) -> list[list[Path]]:
    """The graph files of a side: per rank in rank order, its graphs in graph-id order (several
    when torch.compile broke the program into graphs: `fw.g0.r0.py`, `fw.g1.r0.py`)."""
    if path.is_file():
        return [[path]]
    if not path.is_dir():
        raise CaseError(f"{side} graph not found: {path}")
    files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".hlo", ".txt", ".py", ".pbtxt"))
    if not files:
        raise CaseError(f"{path}: no graph files (*.hlo, *.txt, *.py) in the {side} directory")
    kinds: dict[str, dict[int, list[tuple[int, Path]]]] = {}  # graph kind -> graph id -> (rank, file)
    for f in files:
        match = _RANK.match(f.name)
        group, rank = (match["group"], int(match["rank"])) if match else (f.stem, 0)
        graph = _GRAPH.match(group)
        kind, gid = (graph["kind"], int(graph["id"])) if graph else (group, 0)
        kinds.setdefault(kind, {}).setdefault(gid, []).append((rank, f))
    if len(kinds) > 1:
        joint = [k for k in kinds if k.split(".")[0] == "both"]
        if len(joint) != 1:
            raise CaseError(
                f"{path}: several kinds of graph ({', '.join(sorted(kinds))}); pass the {side} as one file, "
                "or a directory holding one kind (one file per rank and graph)"
            )
        kinds = {joint[0]: kinds[joint[0]]}
    graphs = next(iter(kinds.values()))
    ranked = [sorted(graphs[gid]) for gid in sorted(graphs)]
    for files_of_graph in ranked:
        if [r for r, _ in files_of_graph] != list(range(len(ranked[0]))):
            raise CaseError(f"{path}: rank files {[f.name for _, f in files_of_graph]} are not ranks 0..{len(ranked[0]) - 1}")
    return [[files_of_graph[r][1] for files_of_graph in ranked] for r in range(len(ranked[0]))]


def detect_format(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as handle:
        head = handle.read(4096)
    if re.search(r"^\s*HloModule\b", head, re.MULTILINE):
        return "hlo"
    if re.search(r"def forward\(|torch\.ops\.", head) or path.suffix == ".py":
        return "fx"
    raise CaseError(f"{path}: not an HLO text dump nor an FX readable dump; say which with --format hlo|fx")
