"""How one rank's input is cut from a reference input, and the IR that cuts it.

A layout is `replicate` or `shard`: along one dim, the reference tensor is split into blocks
(one block = a plain chunk; several = a fused weight such as QKV with GQA, or gate+up), and
each block is chunked over the ranks, rank r keeping chunk r of every block, concatenated in
block order. Micro-batches (gradient accumulation) are more chunks: with m micro-batches per
rank, micro-batch i of rank r is chunk r*m + i. A block may be cut into fewer chunks than
that, a number dividing it: each chunk is then held by as many consecutive ranks (the kv heads
of a fused QKV weight when there are fewer kv heads than ranks, replicated over their ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardproof.ir.build import GraphBuilder


@dataclass(frozen=True)
class Layout:
    kind: str  # "replicate", "shard" or "value"
    dim: int = 0
    blocks: tuple[int, ...] = ()  # block boundaries in the reference dim, from 0 to its size
    micro: tuple[int, int] = (0, 1)  # (index, count) of micro-batches per rank
    parts: tuple[int, ...] = ()  # chunks each block is cut into (empty: one per rank and micro-batch)
    value: float | None = None  # kind "value": the number taken for a constant
    why: str = ""  # kind "value": how the number was chosen

    def describe(self) -> str:
        if self.kind == "replicate":
            return "as Replicate()"
        if self.kind == "value":
            return f"= {self.value} ({self.why})"
        what = f"as Shard({self.dim})"
        if len(self.blocks) > 2:
            what += f" in blocks {list(self.blocks)} (each block split over ranks)"
        if self.parts:
            what += f", cut in {list(self.parts)} chunks (a block of fewer chunks than ranks is replicated over consecutive ranks)"
        if self.micro[1] > 1:
            what += f", micro-batch {self.micro[0]} of {self.micro[1]}"
        return what

    def regions(self, rank: int, world_size: int) -> list[tuple[int, int]]:
        """The [start, end) ranges of the reference dim that this rank's tensor holds, in order."""
        index, count = self.micro
        total = world_size * count
        out = []
        for (lo, hi), parts in zip(zip(self.blocks, self.blocks[1:]), self.block_parts(total)):
            size = (hi - lo) // parts
            start = lo + (rank * count + index) * parts // total * size
            out.append((start, start + size))
        return out

    def block_parts(self, total: int) -> tuple[int, ...]:
        """The chunks each block is cut into, `total` (ranks times micro-batches) by default."""
        return self.parts or (total,) * (len(self.blocks) - 1)

    def fits(self, full: tuple[int, ...], local: tuple[int, ...], world_size: int) -> bool:
        if self.kind != "shard":
            return full == local
        total = world_size * self.micro[1]
        if len(full) != len(local) or self.blocks[0] != 0 or self.blocks[-1] != full[self.dim]:
            return False
        blocks = list(zip(self.blocks, self.blocks[1:]))
        parts = self.block_parts(total)
        if len(parts) != len(blocks):
            return False
        blocks_fit = all((hi - lo) % p == 0 and hi > lo and total % p == 0 for (lo, hi), p in zip(blocks, parts))
        others = all(f == l for d, (f, l) in enumerate(zip(full, local)) if d != self.dim)
        return blocks_fit and others and local[self.dim] == sum((hi - lo) // p for (lo, hi), p in zip(blocks, parts))


def plain_layout(full: tuple[int, ...], local: tuple[int, ...], world_size: int, micro: tuple[int, int] = (0, 1)) -> Layout | None:
    """What the shapes alone say: replicated when equal, else a plain chunk of the one dim whose
    size is world_size (times the micro-batches) times smaller; None when neither fits. `shardproof
    verify`'s default loader cuts by this rule; the importers rank fused blocks on top of it."""
    if full == local and micro[1] == 1:
        return Layout("replicate")
    dims = [d for d, (f, l) in enumerate(zip(full, local)) if f != l]
    if len(dims) != 1 or len(full) != len(local):
        return None
    layout = Layout("shard", dims[0], (0, full[dims[0]]), micro)
    return layout if layout.fits(full, local, world_size) else None


def cut(b: GraphBuilder, value: int, layout: Layout, rank: int, world_size: int) -> int:
    """Emit the ops that take this rank's part of `value`."""
    if layout.kind != "shard":  # a value replaces the reference's leaf itself (`relate.with_values`)
        return value
    pieces = [b.slice(value, layout.dim, lo, hi) for lo, hi in layout.regions(rank, world_size)]
    return b.cat(pieces, layout.dim)


def take(tensor: torch.Tensor, layout: Layout, rank: int, world_size: int) -> torch.Tensor:
    """The rank's part of a real (or fake) tensor, as `cut` spells it in the IR."""
    if layout.kind != "shard":
        return tensor
    pieces = [tensor.narrow(layout.dim, lo, hi - lo) for lo, hi in layout.regions(rank, world_size)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, layout.dim)
