"""Shards: whether a rank holds its own chunk of a reference value, and the checkpoint loader's
slice that cut the wrong one. A part of `Diagnoser`.
"""

from __future__ import annotations

import collections

from shardproof.ir.graph import Graph, Node

_MOVING = {"slice", "view", "permute", "expand", "convert"}  # ops that keep a region of their input


class RankChunks:
    """Which chunk of a value a rank holds, and which line cut it."""

    def _own_chunk(self, rank: int, dist_term: int, ref_term: int) -> bool:
        """A region of the reference value that is this rank's natural chunk of it."""
        if not self._consistent(dist_term, ref_term):
            return False
        if self.r.u[dist_term].op == "cat" and self.r.u[ref_term].op != "cat":
            return False  # scattered pieces where the reference has one block
        d_root, d_box = self.r.as_region(dist_term)
        r_root, r_box = self.r.as_region(ref_term)
        if d_root != r_root:
            return True
        return all(_is_rank_chunk(rank, part, whole) for part, whole in zip(d_box, r_box))

    def _misaligned(self, rank: int, pairs: list[tuple[int, int]]) -> list[int]:
        """Operands that are each a region of the right value, but not the same region: the one
        that is not this rank's natural chunk is the wrong one."""
        regions = []
        for d, r in pairs:
            d_root, d_box = self.r.as_region(self.run.ranks[rank][d])
            r_root, r_box = self.r.as_region(self.run.reference[r])
            if d_root != r_root or len(d_box) != len(r_box):
                return []
            regions.append(list(zip(d_box, r_box)))
        relative = {tuple((lo - rl, hi - rl) for (lo, hi), (rl, _) in region) for region in regions}
        if len(relative) < 2:
            return []
        return [p for p, region in enumerate(regions) if not all(_is_rank_chunk(rank, *dims) for dims in region)]

    def _blocks_in_own_chunks(self, rank: int, t: int) -> bool:
        """A cat whose every part is this rank's own chunk of one of the blocks the reference
        splits their common tensor into (its q, k and v, say): the shard holds the right data."""
        term = self.r.u[t]
        if term.op != "cat":
            return False
        regions = [self.r.as_region(p) for p in term.args]
        roots = {root for root, _ in regions}
        if len(roots) != 1:
            return False
        root = roots.pop()
        blocks = self.r.reference_boxes.get(root, ()) or self._implied_blocks(rank, root, [b for _, b in regions])
        for _, box in regions:
            owners = [b for b in blocks if all(bl <= lo and hi <= bh for (lo, hi), (bl, bh) in zip(box, b))]
            if not any(
                _is_rank_chunk(rank, part, whole) for b in owners for part, whole in zip(box, b) if part != whole
            ):
                return False
        return True

    def _implied_blocks(self, rank: int, root: int, boxes: list) -> list:
        """Blocks a tensor-parallel loader would have cut: each part as chunk `rank` of a block n
        times its size; returned only if those blocks tile the tensor exactly."""
        n, shape = len(self.ranks), self.r.shape(root)
        blocks = []
        for box in boxes:
            block = []
            for (lo, hi), size in zip(box, shape):
                width = hi - lo
                start = lo - rank * width if (lo, hi) != (0, size) else 0
                block.append((start, start + n * width) if (lo, hi) != (0, size) else (0, size))
            blocks.append(tuple(block))
        cut = [d for d in range(len(shape)) if any(b[d] != (0, shape[d]) for b in blocks)]
        if len(cut) != 1:
            return []
        spans = sorted(b[cut[0]] for b in blocks)
        tiles = spans[0][0] == 0 and spans[-1][1] == shape[cut[0]] and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        return blocks if tiles else []

    def _loader_instead(self, rank: int, culprit: Node) -> Node | None:
        """A runtime split that is right for a correctly loaded shard is not the bug when the
        shard itself is wrong: its parts cover fewer of the reference's blocks (its q, k, v, or
        gate and up) than the runtime splits it into, or straddle them. Then blame the loader."""
        graph = self.ranks[rank]
        source = culprit.inputs[0]
        dim = culprit.attrs[0]
        siblings = sum(1 for n in graph.nodes if n.op == "slice" and n.inputs[0] == source and n.attrs[0] == dim)
        term = self.r.u[self.run.ranks[rank][source]]
        parts = term.args if term.op == "cat" else (self.run.ranks[rank][source],)
        covered = set()
        for root, box in (self.r.as_region(p) for p in parts):
            blocks = {b[dim] for b in self.r.reference_boxes.get(root, ()) if len(b) > dim} or {(0, self.r.shape(root)[dim])}
            inside = [b for b in blocks if b[0] <= box[dim][0] and box[dim][1] <= b[1]]
            if not inside:
                return self._loader_cut(rank, graph[source])
            covered.add((root, inside[0]))
        return self._loader_cut(rank, graph[source]) if len(covered) < siblings else None

    def _wrong_cut(self, rank: int, node: Node, summed: bool = False, here: bool = True,
                   blocks: bool = True) -> tuple[int, Node] | None:
        """(rank, slice): the loader's cut of another chunk than its own that `node` depends on, on
        this rank (unless not `here`) or, at the same op, on another (collectives carry one rank's
        wrong shard to all; there only a rank's final chunk counts, not its split into blocks, and
        here too without `blocks`).
        With `summed`, only a cut of the range over which that rank's value at `node` holds a share
        of a sum, where that range is not the rank's own chunk of the summed axis."""
        for other in sorted(range(len(self.ranks)), key=lambda r: r != rank):
            mine = self.counterpart(other, node) if other != rank or here else None
            if mine is None:
                continue
            ranges = None
            if summed:
                pieces = self.unreduced(self.run.ranks[other][mine.id])
                ranges = {(lo, hi) for op, (_, lo, hi, size) in pieces if op == "piece"
                          and not _is_chunk_of_rank(other, len(self.ranks), (lo, hi), (0, size))}
            cut = self._loader_slice(other, mine, unnatural=True, ranges=ranges, blocks=blocks and other == rank)
            if cut is not None:
                return other, cut
        return None

    def _loader_cut(self, rank: int, node: Node) -> Node | None:
        """The loader's op to blame for `node`: its slice of another chunk than the rank's own,
        else its first slice or join."""
        return self._loader_slice(rank, node, unnatural=True) or self._loader_slice(rank, node)

    def _loader_slice(self, rank: int, node: Node, unnatural: bool = False, ranges: set | None = None,
                      blocks: bool = True) -> Node | None:
        """The first op of the checkpoint loader (state-only slicing or joining) that `node`
        depends on; with `unnatural`, the first slice, of the state or of an input (`shard_input`
        cuts those), that does not take this rank's own chunk: the first that is the one part used of
        its tensor and that the loader does not cut further, if there is one (a split into blocks,
        [gate; up] or micro-batches, is rank 1's chunk of nothing, yet only the chunk a rank then
        takes can be wrong), else (with `blocks`) a split into the wrong blocks; with `ranges`, only
        a cut of one of those (lo, hi)."""
        graph = self.ranks[rank]
        state_only: dict[int, bool] = {}
        input_region: dict[int, bool] = {}  # an input moved and cut only (shard_input's work)
        cuts, ancestors = [], graph.ancestors(node)
        for ancestor in ancestors:
            if ancestor.op == "leaf":
                state_only[ancestor.id] = str(ancestor.attrs[0]).startswith("state:")
                input_region[ancestor.id] = unnatural and str(ancestor.attrs[0]).startswith("input:")
            else:
                state_only[ancestor.id] = bool(ancestor.inputs) and all(state_only.get(i, False) for i in ancestor.inputs)
                input_region[ancestor.id] = ancestor.op in _MOVING and input_region.get(ancestor.inputs[0], False)
            if state_only[ancestor.id] and ancestor.op == "cat" and not unnatural:
                return ancestor
            if (state_only[ancestor.id] or input_region[ancestor.id]) and ancestor.op == "slice":
                if not unnatural:
                    return ancestor
                cuts.append(ancestor)
        recut = self._cut_further(ancestors, cuts, {i for i, v in {**state_only, **input_region}.items() if v})
        split = collections.Counter((n.inputs[0], n.attrs[0]) for n in cuts)  # parts used of one tensor
        implied = self._implied_by_cuts(rank, [n for n in cuts if n.id not in recut])
        wrong = [n for n in cuts if (ranges is None or tuple(n.attrs[1:]) in ranges)
                 and not self._natural_cut(rank, n, implied if n.id not in recut else None)]
        final = [n for n in wrong if n.id not in recut and split[n.inputs[0], n.attrs[0]] == 1]
        return final[0] if final else wrong[0] if wrong and blocks else None

    @staticmethod
    def _cut_further(ancestors: list[Node], cuts: list[Node], loader: set[int]) -> set[int]:
        """The loader's ops whose values the loader cuts again, through its own ops (a block split
        before its chunk is taken; chunks joined into a layout that is then cut)."""
        consumers: dict[int, list[int]] = collections.defaultdict(list)
        for n in ancestors:
            for i in n.inputs:
                consumers[i].append(n.id)
        cut_ids, reaches = {n.id for n in cuts}, set()
        for n in reversed(ancestors):
            if n.id in loader and any(c in cut_ids or c in reaches for c in consumers[n.id] if c in loader):
                reaches.add(n.id)
        return reaches

    def _implied_by_cuts(self, rank: int, cuts: list[Node]) -> dict[int, list]:
        """Per reference tensor, the blocks the loader's final cuts of it are this rank's chunks of,
        if they tile it (a fused weight whose q, k and v the reference never splits)."""
        boxes: dict[int, list] = collections.defaultdict(list)
        for cut in cuts:
            root, box = self.r.as_region(self.run.ranks[rank][cut.id])
            if root != self.run.ranks[rank][cut.id]:
                boxes[root].append(box)
        return {root: self._implied_blocks(rank, root, found) for root, found in boxes.items()}

    def _natural_cut(self, rank: int, slice_node: Node, implied: dict[int, list] | None = None) -> bool:
        """The loader's slice takes this rank's own chunk: of its input's dim, or, read as a region
        of a reference tensor, of the block of it the reference uses on its own (a fused weight's
        q, k or v), or that the loader's cuts imply (`implied`), or of the whole. A block smaller than the world is replicated: rank r may take
        chunk r modulo the chunks, or ranks may share chunks in runs (GQA's kv heads)."""
        if own_chunk(slice_node, rank):
            return True
        root, box = self.r.as_region(self.run.ranks[rank][slice_node.id])
        if root == self.run.ranks[rank][slice_node.id]:
            return False
        known = self.r.reference_boxes.get(root, ()) or (implied or {}).get(root, ())
        blocks = sorted(known, key=lambda b: [hi - lo for lo, hi in b])
        shape = self.r.shape(root)
        for d, part in enumerate(box):
            inside = [b[d] for b in blocks if len(b) == len(box) and b[d][0] <= part[0] and part[1] <= b[d][1]]
            whole = inside[0] if inside else (0, shape[d])
            if part != whole and not _is_chunk_of_rank(rank, len(self.ranks), part, whole):
                return False
        return True


def own_chunk(slice_node: Node, rank: int) -> bool:
    """The slice takes chunk `rank` of its dim (chunks of its own width)."""
    _, lo, hi = slice_node.attrs
    return lo == rank * (hi - lo)


def _is_chunk_of_rank(rank: int, world_size: int, part: tuple[int, int], whole: tuple[int, int]) -> bool:
    """`part` is rank's chunk of `whole`, the chunks dealt round or, fewer chunks than ranks, in runs."""
    width = part[1] - part[0]
    chunks = (whole[1] - whole[0]) // width if width > 0 else 0
    runs = chunks and world_size % chunks == 0 and part[0] - whole[0] == rank // (world_size // chunks) * width
    return _is_rank_chunk(rank, part, whole) or bool(runs)


def _is_rank_chunk(rank: int, part: tuple[int, int], whole: tuple[int, int]) -> bool:
    """`part` is chunk `rank` (modulo the number of chunks) of `whole` cut into equal chunks."""
    (lo, hi), (w_lo, w_hi) = part, whole
    width = hi - lo
    if part == whole or width == 0:  # an empty part (a rank left with no heads) is no rank's chunk
        return part == whole
    return (lo - w_lo) == (rank % ((w_hi - w_lo) // width)) * width


def cutting(graph: Graph, slice_node: Node, rank: int) -> str:
    """What the slice cuts, naming the state tensor or input when it is the loader's (which names
    the layer)."""
    dim, lo, hi = slice_node.attrs
    source = graph[slice_node.inputs[0]]
    kind, _, name = str(source.attrs[0]).partition(":") if source.op == "leaf" else ("", "", "")
    what = {"state": f"its shard of `{name}`", "input": f"its shard of `inputs()[{name}]`"}.get(kind, "it")
    return f"rank {rank} cuts {what} at [{lo}:{hi}) along dim {dim}, not at its own chunk [{rank * (hi - lo)}:{(rank + 1) * (hi - lo)})"
