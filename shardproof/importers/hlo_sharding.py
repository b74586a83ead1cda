"""Read the shardings an XLA module states: which tile of a global array each device holds.

Two notations reach us. GSPMD's `sharding={devices=[2,1,2]<=[4] last_tile_dim_replicate}` lays
the devices out in a grid with one axis per array dim (plus trailing replication axes); a device's
position along a dim's axis is the index of its tile there. Shardy's
`#sdy.sharding_per_value<[<@mesh, [{}, {"tp"}]>]>` names, per dim, the mesh axes (major first)
that split it, over `#sdy.mesh<["dp"=2, "tp"=2]>` whose devices are numbered row-major.

Both become a `Tiling`: per array dim, this device's tile index and the tile count, and the
devices holding the other tiles of that dim (in tile order), which is what the lowering needs to
cut a rank's part from a global array and to gather a global array back from the parts.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from shardproof.importers.hlo_text import iota_devices, unravel


@dataclass(frozen=True)
class Tiling:
    """One device's place in a sharded array: per dim (tile index, tile count, the devices
    holding that dim's tiles in order, this device among them)."""

    dims: tuple[tuple[int, int, tuple[int, ...]], ...]

    @property
    def sharded(self) -> bool:
        return any(count > 1 for _, count, _ in self.dims)


def gspmd_tiling(text: str, rank: int, ndims: int) -> Tiling | None:
    """This rank's tiles under a GSPMD sharding string (`{devices=[1,2]<=[2]}`, `{replicated}`,
    `{manual}`); None for a form not understood (a tuple sharding, `maximal`)."""
    import numpy

    body = text.strip()
    if body.startswith("{") and body.endswith("}"):
        body = body[1:-1].strip()
    if body in ("replicated", "manual") or body.startswith(("replicated ", "manual ")):
        return Tiling(())
    match = re.match(r"devices=(\[[\d,]*\])\s*(.*)", body)
    if match is None:
        return None
    shape = tuple(int(d) for d in match[1].strip("[]").split(","))
    rest = match[2]
    listed = re.match(r"(<=\[[\d,]*\](?:T\([\d,]*\))?)", rest)
    if listed:
        devices = iota_devices(match[1] + listed[1])
    else:
        explicit = re.match(r"([\d,]+)", rest)
        if explicit is None:
            return None
        devices = numpy.array([int(d) for d in explicit[1].split(",")]).reshape(shape)
    if len(shape) < ndims:
        return None
    where = numpy.argwhere(devices == rank)
    if len(where) != 1:
        return None
    coords = tuple(int(c) for c in where[0])
    dims = []
    for dim in range(ndims):
        index = list(coords)
        index[dim] = slice(None)
        dims.append((coords[dim], shape[dim], tuple(int(d) for d in devices[tuple(index)])))
    return Tiling(tuple(dims))


def sdy_meshes(header: str) -> dict[str, list[tuple[str, int]]]:
    """`xla.sdy.meshes={mesh = #sdy.mesh<["tp"=2]>}` on the module line -> {"mesh": [("tp", 2)]}."""
    found = {}
    for name, axes in re.findall(r'(\w+)\s*=\s*#sdy\.mesh<\[([^\]]*)\]', header.replace('\\"', '"')):
        found[name] = [(axis, int(size)) for axis, size in re.findall(r'"([^"]+)"\s*=\s*(\d+)', axes)]
    return found


def sdy_tilings(text: str, meshes: dict[str, list[tuple[str, int]]], rank: int, ndims: list[int]) -> list[Tiling] | None:
    """This rank's tiles of each value of a `#sdy.sharding_per_value<[...]>`; None if a sharding
    names a mesh or axis not declared."""
    text = text.replace('\\"', '"')
    values = re.findall(r"<@(\w+),\s*\[((?:\{[^}]*\},?\s*)*)\]", text)
    if len(values) != len(ndims):
        return None
    out = []
    for (mesh_name, dims_text), n in zip(values, ndims):
        mesh = meshes.get(mesh_name)
        if mesh is None:
            return None
        names, sizes = [a for a, _ in mesh], [s for _, s in mesh]
        coords = unravel(rank, sizes)
        per_dim = [re.findall(r'"([^"]+)"', d) for d in re.findall(r"\{([^}]*)\}", dims_text)]
        if len(per_dim) != n or any(a not in names for axes in per_dim for a in axes):
            return None
        dims = []
        for axes in per_dim:
            positions = [names.index(a) for a in axes]
            count = math.prod(sizes[p] for p in positions)
            members = []
            for tile in range(count):
                other = list(coords)
                for p, c in zip(positions, unravel(tile, [sizes[p] for p in positions])):
                    other[p] = c
                members.append(_ravel(other, sizes))
            dims.append((members.index(rank), count, tuple(members)))
        out.append(Tiling(tuple(dims)))
    return out


def _ravel(coords: list[int], sizes: list[int]) -> int:
    index = 0
    for c, s in zip(coords, sizes):
        index = index * s + c
    return index
