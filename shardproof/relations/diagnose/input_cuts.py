"""Input cuts: each rank's share of an input as the loader (`shard_input`) cuts it, against the
share the output claim gives the rank. A cut of another share makes values that are regions of
the reference's, so they agree until an op pairs them with values of the rank's own share (a
mask built from its positions, a rope table) or joins them over ranks: however late the values
part, the fault is at the cut. A part of `Diagnoser`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.ir.graph import Graph, Node
from shardproof.programs import Output, zigzag_chunks
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.overlap import Span
from shardproof.relations.layout import box_along
from shardproof.report.terms import line_of

if TYPE_CHECKING:
    from shardproof.relations.rules import Rules

_CUTTING = {"slice", "view", "permute", "expand", "convert", "cat"}  # ops that cut and join regions of an input
Cut = tuple[int, list[Span]]  # the one dim an input is cut along, and the spans of it a rank holds, in order
Held = tuple[Node, Cut, tuple[int, ...]]  # the op whose value the rank reads, its cut, the input's shape
Claimed = tuple[Output, tuple[int, ...]]  # a shard claim's layout, with the shape of the reference output it cuts


class InputCuts:
    """The loader's cuts of the inputs that take another share than the rank's."""

    def _input_cut_first(self, found: Finding, claim: Claimed | None) -> Finding:
        """`found` (a discrepancy) led by the loader's cut of an input where a rank's cut is not
        the share the output claim gives it; else, or when it already leads with that cut's line,
        `found` itself."""
        for name, by_rank in self._input_cuts().items():
            off = self._off_claim(name, by_rank, claim) if claim is not None else None
            if off is not None:
                rank, message = off
                node = by_rank[rank][0]
                if found.distributed and _same_line(found.distributed[0][1], node):
                    return found
                return Finding(
                    "discrepancy", "wrong layout",
                    f"wrong layout: {message}; the values part from the reference's later, at {_first_line(found)}",
                    [(rank, node), *found.distributed], found.reference, op=found.op,
                    fix=f"make rank {rank} take its own share of `inputs()[{name}]` at {line_of(node)}",
                )
        return found

    def _off_claim(self, name: str, by_rank: dict[int, Held], claim: Claimed) -> tuple[int, str] | None:
        """(rank, why) for the first rank whose cut of the input is not along a dim of the claimed
        dim's size at the spans the claim gives the rank, when the input has a dim of that size."""
        (kind, dim, *_), shape = claim
        if kind not in ("shard", "zigzag"):
            return None
        size = shape[dim % len(shape)]
        for rank, (_, (cut_dim, spans), full) in sorted(by_rank.items()):
            wanted = claimed_spans(kind, size, rank, len(self.ranks))
            if wanted is None or size not in full or _width(spans) * size != _width(wanted) * full[cut_dim]:
                return None  # no dim to cut like the claimed one, or a cut of another fraction: not a share
            if full[cut_dim] == size and _joined(spans) == _joined(wanted):
                continue
            claimed = "Shard" if kind == "shard" else "zigzag"
            return rank, (f"rank {rank} cuts its shard of `inputs()[{name}]` at {spans_text(spans)} along dim {cut_dim}, "
                          f"where the output is claimed as {claimed}({dim}): rank {rank}'s {spans_text(wanted)} of a dim "
                          f"of size {size}")
        return None

    def _input_cuts(self) -> dict[str, dict[int, Held]]:
        """Per input (its index), per rank that cuts it along one dim: the op whose value the
        rank's program reads (the loader's last), that cut, and the input's shape."""
        found: dict[str, dict[int, Held]] = {}
        for rank in range(len(self.ranks)):
            graph, terms = self.ranks[rank], self.run.ranks[rank]
            for leaf, within in self._loaded_inputs(rank).items():
                held = self._returned_cut(rank, leaf, within)
                if held is not None and held[0].loc is not None:
                    name = str(graph[leaf].attrs[0]).partition(":")[2]
                    found.setdefault(name, {})[rank] = (*held, self.r.shape(terms[leaf]))
        return found

    def _loaded_inputs(self, rank: int) -> dict[int, dict[int, bool]]:
        """Per input leaf, the loader's ops on it alone (cuts and joins of regions of it), each
        with whether an op of the program reads it."""
        graph = self.ranks[rank]
        leaf_of: dict[int, int] = {}
        for node in graph.nodes:
            if node.op == "leaf" and str(node.attrs[0]).startswith("input:"):
                leaf_of[node.id] = node.id
            elif node.op in _CUTTING and node.inputs and all(i in leaf_of for i in node.inputs) \
                    and len({leaf_of[i] for i in node.inputs}) == 1:
                leaf_of[node.id] = leaf_of[node.inputs[0]]
        read = {i for node in graph.nodes if node.id not in leaf_of for i in node.inputs} | set(graph.outputs)
        by_leaf: dict[int, dict[int, bool]] = {}
        for i, leaf in leaf_of.items():
            if i != leaf:
                by_leaf.setdefault(leaf, {})[i] = i in read
        return {leaf: within for leaf, within in by_leaf.items() if any(within.values())}

    def _returned_cut(self, rank: int, leaf: int, within: dict[int, bool]) -> tuple[Node, Cut] | None:
        """The last op every value the program reads of the input `leaf` passes through (what
        `shard_input` returned) that is a cut of it, with that cut. The program may itself cut
        and reorder regions of what it got (the rows an all-to-all sends, sorted by destination):
        such an op is no cut of a share, and the one before it is tried."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        reads = [i for i, read in within.items() if read]
        for op in sorted(within, reverse=True):
            if self._passes_through(graph, reads, op, leaf):
                cut = self._cut_of(terms[op], terms[leaf])
                if cut is not None:
                    return graph[op], cut
        return None

    @staticmethod
    def _passes_through(graph: Graph, reads: list[int], op: int, leaf: int) -> bool:
        """Whether every path from the values read back to `leaf` passes `op`."""
        seen, stack = {op}, [i for i in reads if i != op]
        while stack:
            i = stack.pop()
            if i == leaf:
                return False
            if i not in seen:
                seen.add(i)
                stack.extend(graph[i].inputs)
        return True

    def _cut_of(self, t: int, leaf: int) -> Cut | None:
        """The one dim along which the regions of the input `leaf` that `t` joins (or is) are
        proper parts of it, and their spans, in order and apart as a share is; None for anything else."""
        term = self.r.u[t]
        parts = term.args if term.op == "cat" else (t,)
        regions = [self.r.as_region(p) for p in parts]
        if any(root != leaf for root, _ in regions):
            return None
        shape = self.r.shape(leaf)
        dims = {d for _, box in regions for d, span in enumerate(box) if span != (0, shape[d])}
        if len(dims) != 1 or (term.op == "cat" and term.attrs[0] not in dims):
            return None
        dim = dims.pop()
        spans = [box[dim] for _, box in regions]
        ordered = all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
        return (dim, spans) if ordered else None  # repeated or reordered rows are the program's, not a share


def claimed_spans(kind: str, size: int, rank: int, world_size: int) -> list[Span] | None:
    """The spans of a dim of `size` that rank `rank` holds under the claim Shard (`shard`: chunk
    rank) or zigzag (chunks rank and 2 * world_size - 1 - rank of 2 * world_size); None where
    the size does not divide."""
    chunks = world_size if kind == "shard" else 2 * world_size
    if size % chunks:
        return None
    width = size // chunks
    if kind == "shard":
        return [(rank * width, (rank + 1) * width)]
    held = [chunk for chunk, (owner, _) in enumerate(zigzag_chunks(world_size)) if owner == rank]
    return [(chunk * width, (chunk + 1) * width) for chunk in held]


def claimed_share(rules: Rules, whole: int, kind: str, dim: int, rank: int, world_size: int) -> int | None:
    """The term of rank `rank`'s share of `whole` along `dim` under the claim (see `claimed_spans`)."""
    shape = rules.shape(whole)
    spans = claimed_spans(kind, shape[dim], rank, world_size)
    if spans is None:
        return None
    return rules.cat([rules.slice(whole, box_along(shape, dim, lo, hi)) for lo, hi in spans], dim)


def _joined(spans: list[Span]) -> list[Span]:
    """The spans with those that meet joined (a cat of chunks 1 and 2 is one region of chunks 1 to 2)."""
    out: list[Span] = []
    for lo, hi in spans:
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def _same_line(a: Node, b: Node) -> bool:
    return a.loc is not None and b.loc is not None and (a.loc.file, a.loc.line) == (b.loc.file, b.loc.line)


def _width(spans: list[Span]) -> int:
    return sum(hi - lo for lo, hi in spans)


def spans_text(spans: list[Span]) -> str:
    """Spans as a person writes them: `[0:4), [12:16)`."""
    return ", ".join(f"[{lo}:{hi})" for lo, hi in spans)


def _first_line(found: Finding) -> str:
    node = next((n for _, n in found.distributed if n.loc is not None), None)
    return f"`{node.op}`, {line_of(node)}" if node is not None else "an op after it"
