"""The one graph form every frontend lowers into: typed nodes with shapes and source locations."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence


# Leaves of a rank graph named with this prefix and an index stand for that reference output
# (training mode binds the reference gradients into each rank's program).
BOUND_LEAF_PREFIX = "reference-output:"


@dataclass(frozen=True)
class Location:
    """Where the user wrote the operation: the innermost frame in user code."""

    file: str
    line: int
    code: str
    backward: bool = False  # an op of this line's backward formula
    # another line that chose the rank this op's offsets stand for (a remainder or quotient of the
    # rank: RankExpr.origin); a wrong rank is fixed there, not where its offset is used
    rank_chosen: Location | None = None
    # the user's frames that led to this line, outermost first (the step, the helper it calls); for
    # an op of a backward formula, those of the `backward()` call that ran it: where a gradient the
    # formula leaves unreduced is next in the user's hands. Not part of the site's identity.
    calls: tuple[Location, ...] = field(default=(), compare=False)

    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclass
class Node:
    """One operation. `op` is a name from `shardproof.ir.ops.OPS`; `attrs` are hashable values."""

    id: int
    op: str
    inputs: tuple[int, ...]
    attrs: tuple[Any, ...]
    shape: tuple[int, ...]
    dtype: str
    name: str
    loc: Location | None = None


@dataclass
class Graph:
    """A straight-line program: nodes in execution order, outputs by node id. Graphs with the same
    `structure` (ranks of one rank class, partition/rank_classes) have the same ops, inputs and
    shapes node for node; only the attrs of the nodes that depend on the rank differ."""

    nodes: Sequence[Node] = field(default_factory=list)
    outputs: list[int] = field(default_factory=list)
    rank: int | None = None
    structure: object | None = None

    def add(
        self,
        op: str,
        inputs: tuple[int, ...],
        attrs: tuple[Any, ...],
        shape: tuple[int, ...],
        dtype: str,
        name: str,
        loc: Location | None = None,
    ) -> int:
        node = Node(len(self.nodes), op, inputs, attrs, tuple(shape), dtype, name, loc)
        self.nodes.append(node)
        return node.id

    def __getitem__(self, node_id: int) -> Node:
        return self.nodes[node_id]

    def ancestors(self, node: Node) -> list[Node]:
        """`node` and everything it depends on, in execution order (earliest first)."""
        seen = {node.id}
        stack = [node.id]
        while stack:
            for i in self.nodes[stack.pop()].inputs:
                if i not in seen:
                    seen.add(i)
                    stack.append(i)
        return [self.nodes[i] for i in sorted(seen)]

    def op_count(self) -> int:
        """Operations that compute something (leaves and constants are not counted); a `call` of a
        repeated module's graph counts that graph's operations (once, at its first output)."""
        count = 0
        for n in self.nodes:
            if n.op == "call":
                count += n.attrs[0].op_count() if n.attrs[1] == 0 else 0
            elif n.op not in ("leaf", "const"):
                count += 1
        return count
