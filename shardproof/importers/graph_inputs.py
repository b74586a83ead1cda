"""An imported graph: the IR graph plus what the dump says about its inputs and outputs.

Importers record every graph input (parameters, and constants whose values the dump elides) in
order, with the names the dump gives them, so inputs can be matched between the reference and
the distributed program (`importers/relate.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardproof.ir.graph import Graph


@dataclass(frozen=True)
class GraphInput:
    name: str  # the dump's name: HLO parameter `p9.10`, FX placeholder `primals_4`
    node: int  # its leaf node in the graph
    shape: tuple[int, ...]
    dtype: str
    constant: bool = False  # a constant whose values the dump does not show


Axis = tuple[int, tuple[int, ...]]  # a mesh axis as one rank sees it: its tile index, the ranks holding the tiles in order


@dataclass
class ImportedGraph:
    graph: Graph
    path: str
    inputs: list[GraphInput] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)  # input name -> a parameter name the dump records
    gradient_of: dict[int, str] = field(default_factory=dict)  # output position -> the input it is the gradient of
    axes: list[Axis] = field(default_factory=list)  # the mesh axes the dump states inputs are split over
    split: dict[str, dict[int, int]] = field(default_factory=dict)  # input name -> {dim: index in `axes`}

    def split_along(self, name: str, dim: int, axis: Axis) -> None:
        """Record that the dump states input `name` is split along `dim` over `axis`: the mesh
        axes an output that the dump does not state the sharding of may be split over."""
        if axis not in self.axes:
            self.axes.append(axis)
        self.split.setdefault(name, {})[dim] = self.axes.index(axis)

    def add_input(self, name: str, shape: tuple[int, ...], dtype: str, constant: bool = False) -> int:
        node = self.graph.add("leaf", (), (name,), tuple(shape), dtype, name)
        self.inputs.append(GraphInput(name, node, tuple(shape), dtype, constant))
        return node

    def label(self, name: str) -> str:
        """How to call an input in a message: its parameter name when the dump records one."""
        return self.labels.get(name, name)
