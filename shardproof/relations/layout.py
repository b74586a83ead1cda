"""Layout algebra on boxes (per-dimension [lo, hi) ranges): how slices move through reshapes.

Pure functions on shapes and integers; the rules in `rules/` use them to pull a slice out of a
view, so that a rank's `view(slice(Q, heads r), ...)` and the reference's `view(Q, ...)` meet.
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, int], ...]


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, s) for s in shape)


def box_along(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> Box:
    """The box of `shape` that keeps [lo, hi) of `dim` and every other dim whole."""
    return tuple((lo, hi) if d == dim else (0, s) for d, s in enumerate(shape))


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(hi - lo for lo, hi in box)


def compose(outer: Box, inner: Box) -> Box:
    """Box `inner` taken inside the region `outer` (both over the same dims)."""
    return tuple((o_lo + i_lo, o_lo + i_hi) for (o_lo, _), (i_lo, i_hi) in zip(outer, inner))


def reshape_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Split a reshape into independent groups of source dims and destination dims of equal size."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        gi, gj, pa, pb = [], [], 1, 1
        while True:
            if (not gi or pa < pb) and i < len(src):
                pa *= src[i]
                gi.append(i)
                i += 1
            elif j < len(dst) and (not gj or pb < pa):
                pb *= dst[j]
                gj.append(j)
                j += 1
            else:
                break
            if pa == pb and gi and gj:
                break
        if pa != pb:
            return None
        groups.append((gi, gj))
    return groups


def source_box(src: tuple[int, ...], dst: tuple[int, ...], box: Box) -> Box | None:
    """The box S of a tensor X of shape `src` with view(X, dst)[box] == view(X[S], box's shape), if
    there is one: in every reshape group the box reads one run of the group's elements in row-major
    order, and that run is a box of the group's source dims (single indices, then a range, then
    whole dims). A range of a flattened buffer that lies inside one row is a slice of that row."""
    groups = reshape_groups(src, dst)
    if groups is None or 0 in src:
        return None
    out = [(0, n) for n in src]
    for gi, gj in groups:
        run = _run_of_box([dst[d] for d in gj], [box[d] for d in gj])
        inner = None if run is None else _box_of_run([src[d] for d in gi], *run)
        if inner is None:
            return None
        for d, r in zip(gi, inner):
            out[d] = r
    return tuple(out)


def _run_of_box(sizes: list[int], box: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The [lo, hi) of row-major positions a box of dims `sizes` covers, if they are one run:
    single indices, then a range, then whole dims."""
    ranged = next((d for d, (a, b) in enumerate(box) if b - a != 1), len(box))
    if any(box[d] != (0, sizes[d]) for d in range(ranged + 1, len(box))):
        return None
    lo = 0
    for n, (a, _) in zip(sizes, box):
        lo = lo * n + a
    return lo, lo + math.prod(b - a for a, b in box)


def _box_of_run(sizes: list[int], lo: int, hi: int) -> list[tuple[int, int]] | None:
    """The box of dims `sizes` whose row-major positions are exactly [lo, hi), if there is one."""
    for j in range(len(sizes)):
        inner = math.prod(sizes[j + 1 :])
        outer = inner * sizes[j]
        if lo % inner == 0 and hi % inner == 0 and lo // outer == (hi - 1) // outer:
            box, rest = [], lo
            for d in range(j):
                step = math.prod(sizes[d + 1 :])
                box.append((rest // step, rest // step + 1))
                rest %= step
            box.append(((lo // inner) % sizes[j], (hi - 1) // inner % sizes[j] + 1))
            return box + [(0, n) for n in sizes[j + 1 :]]
    return None


def view_of_box(
    global_src: tuple[int, ...], box: Box, local_dst: tuple[int, ...], ones_split: bool = False, ones_last: bool = False
) -> tuple[tuple[int, ...], Box] | None:
    """If `view(X[box], local_dst)` equals `view(X, G)[B]` for some G and B, return (G, B).

    Works when, in every reshape group, only the outermost source dim is restricted and the
    restriction is aligned to the sizes of the inner destination dims of that group. A restricted
    size-1 source dim (one selected row) moves to a size-1 destination dim, and a size-1
    destination dim right before a restricted group takes the restriction as the outer factor
    of a split when `ones_split` (so `(s, 4) -> (s, 1, 4)` of columns [36:40) is head 9 of
    `(s, 12, 4)`); both readings are true, the caller picks the one the reference uses. Size-1
    source dims pair with size-1 destination dims in order from the first of each run, or with
    `ones_last` from the last, where the leading dims (a batch of one) are the ones added or
    dropped: one head of a batch of one, `(1, 1, s, d) -> (1, s, d)`, is that head of
    `(heads, s, d)`, and back, `(1, s, d) -> (1, 1, s, d)`, of `(1, heads, s, d)`.
    """
    if 0 in local_dst or any(hi == lo for lo, hi in box):  # an empty region (a rank's empty shard) has no layout
        return None
    local_src = box_shape(box)
    groups = reshape_groups(local_src, local_dst)
    if groups is None:
        return None
    out_shape = list(local_dst)
    out_box = [(0, s) for s in local_dst]
    free_ones: list[int] = []  # size-1 destination dims not yet given a restriction
    pending: list[int] = []  # size-1 source dims waiting for a size-1 destination, in order
    ahead = dst_ones_ahead(groups)
    for g, (gi, gj) in enumerate(groups):
        restricted = [d for d in gi if box[d] != (0, global_src[d])]
        if not gi:
            if ones_last and len(pending) > ahead[g]:  # the first of the run are dropped
                dropped = pending[: len(pending) - ahead[g]]
                if any(box[d] != (0, global_src[d]) for d in dropped):
                    return None
                del pending[: len(dropped)]
            if pending and not (ones_last and len(pending) < ahead[g]):
                d = pending.pop(0)
                out_shape[gj[0]], out_box[gj[0]] = global_src[d], box[d]
            else:
                free_ones.append(gj[0])
            continue
        if not gj:
            pending.append(gi[0])
            continue
        pending_rows = [d for d in pending if box[d] != (0, global_src[d])]
        pending.clear()
        if pending_rows:
            if restricted or len(pending_rows) > 1:
                return None
            d = pending_rows.pop()  # a selected row merged with the dims after it: their outer factor
            inner_src = math.prod(local_src[k] for k in gi)
        elif not restricted:
            free_ones.clear()
            continue
        elif restricted != [gi[0]]:
            return None
        else:
            d = gi[0]
            inner_src = math.prod(local_src[k] for k in gi[1:])
        lo, hi, size = box[d][0] * inner_src, box[d][1] * inner_src, global_src[d] * inner_src
        block = math.prod(local_dst[k] for k in gj)
        if ones_split and free_ones and hi - lo == block and lo % block == 0 and size % block == 0:
            one = free_ones[-1]
            out_shape[one], out_box[one] = size // block, (lo // block, hi // block)
            free_ones.clear()
            continue
        free_ones.clear()
        inner_dst = math.prod(local_dst[k] for k in gj[1:])
        if lo % inner_dst or hi % inner_dst or size % inner_dst:
            return None
        out_shape[gj[0]] = size // inner_dst
        out_box[gj[0]] = (lo // inner_dst, hi // inner_dst)
    if any(box[d] != (0, global_src[d]) for d in pending):
        return None
    return tuple(out_shape), tuple(out_box)


def dst_ones_ahead(groups: list[tuple[list[int], list[int]]]) -> list[int]:
    """For each group, how many size-1 destination dims follow from it (itself included) before
    the next group of real dims."""
    ahead, count = [0] * len(groups), 0
    for g in range(len(groups) - 1, -1, -1):
        gi, gj = groups[g]
        count = count + 1 if not gi else 0 if gj else count
        ahead[g] = count
    return ahead


def cut_to_one_index(box: tuple[tuple[int, int], ...], shape: tuple[int, ...]) -> list[int]:
    """The dims of `shape` that `box` cuts from more than one index to one."""
    return [d for d, (lo, hi) in enumerate(box) if hi - lo == 1 and shape[d] > 1]
