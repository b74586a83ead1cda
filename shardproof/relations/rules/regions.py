"""Regions: the constructors of slices, concatenations, broadcasts, repeats and permutes, and the
readings of a term as a region X[box] of a larger one. A part of `Rules`, apart from reshapes
(`views.py`) and sums (`linear.py`), whose constructors it reaches through `self`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from shardproof.ir.ops import OPS
from shardproof.relations.layout import Box, box_shape, compose, cut_to_one_index, full_box, source_box
from shardproof.relations.rules import aranges, masked_keys
from shardproof.relations.rules.values import PARTS

if TYPE_CHECKING:
    from shardproof.relations.rules.core import Rules


_ELEMENTWISE = ("unary", "binary", "compare", "where", "pointwise")
_MAX_ROWS = 64  # rows of a flat collective buffer read one by one: one per rank


class RegionRules:
    """Slices, concatenations, broadcasts, repeats, permutes and regions of `Rules`."""

    def slice(self, x: int, box: Box) -> int:
        term = self.u[x]
        if box == full_box(term.shape):
            return x
        shape = box_shape(box)
        if term.op == "slice":
            return self.slice(term.args[0], compose(term.attrs[0], box))
        if term.op in PARTS:
            return self._map_parts(x, lambda t: self.slice(t, box), shape)
        if term.op == "full":
            return self.literal("full", (), term.attrs, shape, term.dtype)
        if term.op == "const":
            positions = aranges.sliced(self, x, box)
            if positions is not None:
                return positions
        if term.op == "bcast":
            dims = term.attrs[0]
            inner = self.slice(term.args[0], tuple(box[d] for d in dims))
            return self.bcast(inner, shape, dims)
        if term.op == "cat":
            return self._slice_cat(x, box)
        if term.op == "repeat":
            moved = self._slice_repeat(x, box)
            if moved is not None:
                return moved
        if term.op == "view":
            moved = self._slice_view_of_cat(x, box)
            if moved is not None:
                return moved
        if term.op == "permute":
            moved = self._sliced_block(x, box)
            if moved is not None:
                return moved
        if self.reference_size is None:
            self.reference_boxes.setdefault(x, set()).add(box)
        return self.literal("slice", (x,), (box,), shape, term.dtype)

    def _sliced_block(self, x: int, box: Box) -> int | None:
        """permute(Y, p)[box] cutting dims to one index, each the block index of a split Y makes and
        moved behind another factor of it (`_block_moved_behind`): those one-index dims dropped, it
        is the block with its factors reordered (`_view_sliced_permute`), the dims put back by a
        broadcast. So a rank's block of rows, kept one row deep (its column of a gradient that an
        all_to_all returned), is the reference's range of rows as the reference holds a column."""
        sliced = self.literal("slice", (x,), (box,), box_shape(box), self.u[x].dtype)
        if not self._block_moved_behind(sliced):
            return None
        cut = cut_to_one_index(box, self.shape(x))
        dropped = self.view(sliced, tuple(n for d, n in enumerate(box_shape(box)) if d not in cut))
        return self.view(dropped, box_shape(box)) if self.op(dropped) != "view" else None

    def _slice_view_of_cat(self, x: int, box: Box) -> int | None:
        """view(cat(parts))[box], where one of the two is flat, and the box reads a box of one part:
        that part's box, viewed; or, row by row along its outermost range, such boxes joined. The ranks' rows of a flat
        collective buffer, each row the parts' chunks side by side (FSDP2's all-gather output and
        reduce-scatter input), sliced at one parameter's chunk of one row or of every row."""
        source = self.u[x].args[0]
        if self.u[source].op != "cat" or 1 not in (len(self.shape(source)), len(self.shape(x))):
            return None  # only flat buffers: a view of them, or they viewed flat
        inner = source_box(self.shape(source), self.shape(x), box)
        if inner is not None:
            lo, hi = inner[self.u[source].attrs[0]]
            if not any(a <= lo and hi <= b for a, b in cat_bounds(self, source)):
                return None
            return self.view(self.slice(source, inner), box_shape(box))
        ranged = next((d for d, (lo, hi) in enumerate(box) if hi - lo > 1), None)
        if ranged is None or box[ranged][1] - box[ranged][0] > _MAX_ROWS:
            return None
        rows = []
        for i in range(*box[ranged]):
            row = self._slice_view_of_cat(x, box[:ranged] + ((i, i + 1),) + box[ranged + 1 :])
            if row is None:
                return None
            rows.append(row)
        return self.cat(rows, ranged)

    def _slice_cat(self, x: int, box: Box) -> int:
        term = self.u[x]
        dim = term.attrs[0]
        lo, hi = box[dim]
        parts, offset = [], 0
        for part in term.args:
            size = self.shape(part)[dim]
            a, b = max(lo, offset), min(hi, offset + size)
            if a < b:
                part_box = tuple((a - offset, b - offset) if d == dim else r for d, r in enumerate(box))
                parts.append(self.slice(part, part_box))
            offset += size
        if not parts:  # an empty box: a rank's empty share
            return self.slice(term.args[0], tuple((0, 0) if d == dim else r for d, r in enumerate(box)))
        return self.cat(parts, dim)

    def cat(self, parts: list[int], dim: int) -> int:
        flat: list[int] = []
        for p in parts:
            term = self.u[p]
            if term.op == "cat" and term.attrs[0] == dim:
                flat.extend(term.args)
            elif term.shape[dim] > 0:
                flat.append(p)
        merged: list[int] = []
        for p in flat:
            if merged:
                joined = self._join(merged[-1], p, dim)
                if joined is not None:
                    merged[-1] = joined
                    continue
            merged.append(p)
        if not merged:  # every part is empty along `dim`: so is the result, as each of them
            return parts[0]
        if len(merged) == 1:
            return merged[0]
        shape = list(self.shape(merged[0]))
        shape[dim] = sum(self.shape(p)[dim] for p in merged)
        return self.literal("cat", tuple(merged), (dim,), tuple(shape), self.u[merged[0]].dtype)

    def piece_of_cat(self, t: int) -> int | None:
        """A cat of shares over one range (each maybe scaled) as that range of the wholes joined
        (`pieces_joined`): a TP rank's share of each routed gate's gradient, one column per expert.
        Not the normal form, where sums of cats meet part by part (`_lin_of_cats`): a linear op
        that maps through a piece asks for it (`lookups.gather`)."""
        term = self.u[t]
        if term.op != "cat":
            return None
        scaled = [self.common_factor(p) for p in term.args]
        return self.pieces_joined([self.u[p] for p, _ in scaled], lambda sums: self.cat(
            [self.scale(s, c) for s, (_, c) in zip(sums, scaled)], term.attrs[0]))

    def _join(self, a: int, b: int, dim: int) -> int | None:
        """Two adjacent regions of one tensor are one region (adjacent position ranges too)."""
        positions = aranges.joined(self, a, b)
        if positions is not None:
            return positions
        (ra, ba), (rb, bb) = masked_keys.on_masked_root(self, [a, b], [self.as_region(a), self.as_region(b)])
        if ra != rb:
            return None
        same_elsewhere = all(ba[d] == bb[d] for d in range(len(ba)) if d != dim)
        if not same_elsewhere or ba[dim][1] != bb[dim][0]:
            return None
        box = tuple((ba[dim][0], bb[dim][1]) if d == dim else ba[d] for d in range(len(ba)))
        return self.slice(ra, box)

    def as_region(self, t: int) -> tuple[int, Box]:
        """(X, box) with X[box] == t, looking through lin/piece/cat; (t, full box) if none shows."""
        term = self.u[t]
        if term.op == "cat":
            return self._cat_region(t)
        hint = self._region_hint(t)
        whole = None if hint is None else self.unslice(t, *hint)
        if whole is not None and (self.reference_size is None or self.in_reference(whole)):
            return whole, hint[0]
        for relative in self._hints_in_reference_boxes(t):
            inside = self.unslice(t, *relative)  # a region of what the reference built first
            if inside is not None and (whole is None or self.in_reference(inside)):
                return inside, relative[0]
        if whole is not None:
            return whole, hint[0]
        return t, full_box(self.shape(t))

    def _hints_in_reference_boxes(self, t: int) -> list[tuple[Box, tuple[int, ...]]]:
        """(box, shape) of t's first sliced term inside each region of its root the reference
        sliced out: a rank's rotate-half lin(X[h, :d], -X[h, d:]) is heads h of the reference's
        lin(X[:, :d], -X[:, d:]), though no one box of X holds both halves; a rank's rows of kv
        heads repeated for their query heads (GQA), rows of the reference's repeat of those heads."""
        term = self.u[t]
        parts = term.args if term.op == "lin" else (t,) if term.op == "repeat" else ()
        repeats = [self.u[a].attrs if self.op(a) == "repeat" else None for a in parts]
        unrepeated = [self.u[a].args[0] if how else a for a, how in zip(parts, repeats)]
        first = next((i for i, a in enumerate(unrepeated) if self.op(a) == "slice"), None)
        if first is None:
            return []
        root, region = self.u[unrepeated[first]].args[0], self.u[unrepeated[first]].attrs[0]
        hints = [
            (tuple((lo - rl, hi - rl) for (rl, _), (lo, hi) in zip(ref_box, region)), box_shape(ref_box))
            for ref_box in sorted(self.reference_boxes.get(root, ()))
            if ref_box != region and all(rl <= lo and hi <= rh for (rl, rh), (lo, hi) in zip(ref_box, region))
        ]
        return hints if repeats[first] is None else [_repeated(hint, *repeats[first]) for hint in hints]

    def _region_hint(self, t: int) -> tuple[Box, tuple[int, ...]] | None:
        """(box, global shape) of the first slice at the top of `t`, through lin, piece, bcast."""
        term = self.u[t]
        if term.op == "slice":
            return term.attrs[0], self.shape(term.args[0])
        if term.op in ("lin", "piece"):
            for a in term.args:
                hint = self._region_hint(a)
                if hint is not None:
                    return hint
        if term.op == "bcast":
            hint = self._region_hint(term.args[0])
            if hint is not None:
                box, global_shape = list(full_box(term.shape)), list(term.shape)
                for i, d in enumerate(term.attrs[0]):
                    box[d], global_shape[d] = hint[0][i], hint[1][i]
                return tuple(box), tuple(global_shape)
        return None

    def _cat_region(self, t: int) -> tuple[int, Box]:
        """cat(X1[box], X2[box]) = cat(X1, X2)[box] when the box leaves the cat dim whole; a constant
        part (the zeros a slice's gradient is padded with) fits any box."""
        term = self.u[t]
        dim = term.attrs[0]
        template = next((p for p in term.args if self.u[p].op != "full"), term.args[0])
        first_root, first_box = self.as_region(template)
        box = tuple((0, term.shape[dim]) if d == dim else r for d, r in enumerate(first_box))
        global_shape = tuple(term.shape[dim] if d == dim else s for d, s in enumerate(self.shape(first_root)))
        if len(global_shape) != len(term.shape):
            return t, full_box(term.shape)
        whole = self.unslice(t, box, global_shape)
        return (whole, box) if whole is not None else (t, full_box(term.shape))

    def root_of(self, t: int) -> int:
        term = self.u[t]
        if term.op == "slice":
            return term.args[0]
        if term.op in ("lin", "piece", "cat", "repeat", "bcast") and term.args:
            return self.root_of(term.args[0])
        return t

    def regions(self, t: int) -> list[tuple[int, Box]]:
        """Ways to see `t` as X[box]: over the largest root first, then over each region of
        that root the reference itself sliced out (its q of a fused qkv, say)."""
        whole, box = self.as_region(t)
        if whole == t:
            return [(t, box)]
        found = [(whole, box)]
        root = self.root_of(t)
        known = self.reference_boxes.get(root, ()) if self.shape(root) == self.shape(whole) else ()
        for ref_box in sorted(known):
            inside = all(rl <= lo and hi <= rh for (rl, rh), (lo, hi) in zip(ref_box, box))
            if inside and ref_box != box:
                relative = tuple((lo - rl, hi - rl) for (rl, _), (lo, hi) in zip(ref_box, box))
                found.append((self.slice(whole, ref_box), relative))
        return found

    def region_like(self, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
        """A term X of `global_shape` with X[box] == t, also over regions the reference sliced."""
        whole = self.unslice(t, box, global_shape)
        if whole is not None:
            return whole
        for root, region in self.regions(t)[1:]:
            if region == box and self.shape(root) == tuple(global_shape):
                return root
        return None

    def unslice(self, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
        """A term X of `global_shape` with X[box] == t, if the normal form shows one. Once the
        reference is built (its boxes then fixed) the answer depends on the arguments alone, and
        is kept: ranks sharing a tensor (the ranks of one replicated kv head) ask for the same."""
        if self.reference_size is None:
            return self._unslice(t, box, tuple(global_shape))
        key = (t, box, tuple(global_shape), self.reference_size)
        if key not in self.unsliced:
            self.unsliced[key] = self._unslice(t, box, tuple(global_shape))
        return self.unsliced[key]

    def _unslice(self, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
        if box == full_box(global_shape):
            return t if self.shape(t) == tuple(global_shape) else None
        term = self.u[t]
        if term.op == "slice":
            return self._unslice_slice(t, box, tuple(global_shape))
        if term.op == "lin":
            parts = [self.unslice(a, box, global_shape) for a in term.args]
            return None if None in parts else self.lin(list(zip(parts, term.attrs[0])))
        if term.op == "piece":
            inner = self.unslice(term.args[0], box, global_shape)
            return None if inner is None else self.piece(inner, *term.attrs)
        if term.op == "full":
            return self.literal("full", (), term.attrs, tuple(global_shape), term.dtype)
        if term.op == "const":
            return aranges.widened(self, t, box, tuple(global_shape))
        if term.op == "bcast":
            return self._unslice_bcast(t, box, tuple(global_shape))
        if term.op in OPS and OPS[term.op].kind in _ELEMENTWISE and self.of_constants(t):
            # op(X)[box] is op(X[box]): a mask computed from positions alone is the rows of the
            # mask computed from the wider positions
            wider = [self.unslice(a, box, global_shape) for a in term.args]
            return None if None in wider else self.build(term.op, tuple(wider), term.attrs, tuple(global_shape), term.dtype)
        if term.op == "repeat":
            return self._unslice_repeat(t, box, tuple(global_shape))
        if term.op in ("triu", "tril"):
            # triu(X, k)[box] = triu(X[box], k - c0 + r0): a causal mask's block on the diagonal
            inner = self.unslice(term.args[0], box, global_shape)
            diagonal = term.attrs[0] + box[-1][0] - box[-2][0]
            return None if inner is None else self.build(term.op, (inner,), (diagonal,), tuple(global_shape), term.dtype)
        if term.op == "cat":
            dim = term.attrs[0]
            if box[dim] != (0, global_shape[dim]) or global_shape[dim] != term.shape[dim]:
                return None
            parts = []
            for p in term.args:
                size = self.shape(p)[dim]
                part_box = tuple((0, size) if d == dim else r for d, r in enumerate(box))
                part_shape = tuple(size if d == dim else s for d, s in enumerate(global_shape))
                parts.append(self.unslice(p, part_box, part_shape))
            return None if None in parts else self.cat(parts, dim)
        if all(size == 1 for (lo, hi), size, whole in zip(box, term.shape, global_shape) if (lo, hi) != (0, whole)):
            # a computed t's size-1 dims stand for any row of it broadcast along them: so the reference built it
            broadcast = self.expand(t, tuple(global_shape))
            if self.in_reference(broadcast):
                return broadcast
        return None

    def of_constants(self, t: int) -> bool:
        """`t` is computed from constants alone (no leaf, nothing a rank reads)."""
        known = self.constant_terms.get(t)
        if known is None:
            term = self.u[t]
            known = term.op in ("full", "const") or (term.op != "leaf" and bool(term.args) and all(self.of_constants(a) for a in term.args))
            self.constant_terms[t] = known
        return known

    def _unslice_slice(self, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
        """P[b] seen inside a larger region: widen b on the dims the box restricts, keep the rest."""
        term = self.u[t]
        inner, region = term.args[0], term.attrs[0]
        for ref_box in self.reference_boxes.get(inner, ()):
            inside = all(rl <= lo and hi <= rh for (rl, rh), (lo, hi) in zip(ref_box, region))
            relative = tuple((lo - rl, hi - rl) for (rl, _), (lo, hi) in zip(ref_box, region))
            if inside and relative == box and box_shape(ref_box) == global_shape:
                return self.slice(inner, ref_box)
        inner_shape = self.shape(inner)
        widened = []
        for d, ((lo, hi), (r_lo, r_hi)) in enumerate(zip(box, region)):
            if (lo, hi) == (0, global_shape[d]) and hi == r_hi - r_lo:
                widened.append((r_lo, r_hi))
            elif (lo, hi) == (r_lo, r_hi) and global_shape[d] == inner_shape[d]:
                widened.append((0, inner_shape[d]))
            elif term.shape[d] == 1:
                return self._unslice_block(t, 1, box, global_shape, d)
            else:
                return None
        return self.slice(inner, tuple(widened))

    def _unslice_bcast(self, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
        term = self.u[t]
        dims, base = term.attrs[0], term.args[0]
        inner = self.unslice(base, tuple(box[d] for d in dims), tuple(global_shape[d] for d in dims))
        if inner is not None:
            return self.bcast(inner, global_shape, dims)
        # the base's size-1 dims where the box takes one row are also one row of a broadcast along
        # them (a rotary table unsqueezed for one local head): so, where the reference built that
        base_shape = self.shape(base)
        kept = [i for i, d in enumerate(dims) if base_shape[i] != 1 or global_shape[d] == 1]
        if len(kept) == len(dims):
            return None
        base, dims = self.view(base, tuple(base_shape[i] for i in kept)), tuple(dims[i] for i in kept)
        inner = self.unslice(base, tuple(box[d] for d in dims), tuple(global_shape[d] for d in dims))
        broadcast = None if inner is None else self.bcast(inner, global_shape, dims)
        return broadcast if broadcast is not None and self.in_reference(broadcast) else None

    def _unslice_repeat(self, t: int, box: Box, global_shape: tuple[int, ...]) -> int | None:
        term = self.u[t]
        dim, times = term.attrs
        row = term.args[0]
        if self.shape(row)[dim] == 1:
            return self._unslice_block(row, times, box, global_shape, dim)
        if box[dim][0] % times or box[dim][1] % times or global_shape[dim] % times:
            return None
        inner_box = tuple((lo // times, hi // times) if d == dim else (lo, hi) for d, (lo, hi) in enumerate(box))
        inner_shape = tuple(s // times if d == dim else s for d, s in enumerate(global_shape))
        inner = self.unslice(row, inner_box, inner_shape)
        return None if inner is None else self.repeat(inner, dim, times)

    def _unslice_block(self, row: int, count: int, box: Box, global_shape: tuple[int, ...], dim: int) -> int | None:
        """Row j of K repeated `count` times is a slice of K repeated: the GQA layout where
        several query heads (and ranks) share one kv head. How many rows K has is not visible
        locally; among the candidates take the one the reference already built."""
        source, row_box = self.as_region(row)
        j = row_box[dim][0]
        lo, hi = box[dim]
        for times in range(max(count, 2), global_shape[dim] + 1):
            if global_shape[dim] % times or lo // times != (hi - 1) // times:
                continue
            rows = global_shape[dim] // times
            start = j - lo // times
            if start < 0 or start + rows > self.shape(source)[dim]:
                continue
            keys = self.slice(source, tuple((start, start + rows) if d == dim else r for d, r in enumerate(row_box)))
            outer_box = tuple((0, rows) if d == dim else r for d, r in enumerate(box))
            outer_shape = tuple(rows if d == dim else s for d, s in enumerate(global_shape))
            inner = self.unslice(keys, outer_box, outer_shape)
            if inner is None:
                continue
            # one row repeated along the whole dim is also that row broadcast (the size-1 head dim
            # of a rotary table meeting 8 query heads)
            repeated = self.repeat(inner, dim, times)
            if self.in_reference(repeated):
                return repeated
            if rows == 1:  # built only when needed: a broadcast's view normalizes slowly (~1 ms)
                broadcast = self.expand(inner, global_shape)
                if self.in_reference(broadcast):
                    return broadcast
        return None

    def repeat(self, x: int, dim: int, times: int) -> int:
        """Each element along `dim` repeated `times` times in a row (repeat_interleave).

        Also the normal form of one row of a larger tensor broadcast along its own dim, so that
        a rank holding kv head j for its query heads matches the reference's repeat_kv."""
        term = self.u[x]
        if times == 1:
            return x
        shape = tuple(s * times if d == dim else s for d, s in enumerate(term.shape))
        if term.op in PARTS:
            return self._map_parts(x, lambda t: self.repeat(t, dim, times), shape)
        if term.op == "full":
            return self.literal("full", (), term.attrs, shape, term.dtype)
        if term.op == "bcast" and dim in term.attrs[0]:
            inner_dim = term.attrs[0].index(dim)
            return self.bcast(self.repeat(term.args[0], inner_dim, times), shape, term.attrs[0])
        if term.op == "cat" and term.attrs[0] != dim:
            return self.cat([self.repeat(p, dim, times) for p in term.args], term.attrs[0])
        return self.literal("repeat", (x,), (dim, times), shape, term.dtype)

    def _slice_repeat(self, x: int, box: Box) -> int | None:
        term = self.u[x]
        dim, times = term.attrs
        lo, hi = box[dim]
        inner = term.args[0]
        if lo % times == 0 and hi % times == 0:
            inner_box = tuple((lo // times, hi // times) if d == dim else r for d, r in enumerate(box))
            return self.repeat(self.slice(inner, inner_box), dim, times)
        if lo // times == (hi - 1) // times:
            one = tuple((lo // times, lo // times + 1) if d == dim else r for d, r in enumerate(box))
            return self.repeat(self.slice(inner, one), dim, hi - lo)
        return None

    def bcast(self, base: int, shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
        """`base` placed at `dims` of `shape` and repeated along the other dims."""
        term = self.u[base]
        shape = tuple(shape)
        if term.op == "bcast":
            inner_dims = tuple(dims[d] for d in term.attrs[0])
            return self.bcast(term.args[0], shape, inner_dims)
        if term.op in ("lin", "piece") and tuple(dims) != tuple(range(len(shape))):
            return self._map_linear(base, lambda t: self.bcast(t, shape, dims), shape)
        if term.op == "full":
            return self.literal("full", (), term.attrs, shape, term.dtype)
        if tuple(dims) == tuple(range(len(shape))):
            return base
        if term.op == "view" and self.shape(term.args[0]) == shape and all(shape[d] == 1 for d in range(len(shape)) if d not in dims):
            return term.args[0]  # size-1 dims put back where a reshape took them out: the tensor it reshaped
        return self.literal("bcast", (base,), (tuple(dims),), shape, term.dtype)

    def expand(self, x: int, shape: tuple[int, ...]) -> int:
        have = self.shape(x)
        if tuple(shape) == have:
            return x
        dims = tuple(d for d, s in enumerate(have) if s != 1 or shape[d] == 1)
        base = self.view(x, tuple(have[d] for d in dims)) if len(dims) != len(have) else x
        return self.bcast(base, shape, dims)

    def permute(self, x: int, perm: tuple[int, ...]) -> int:
        term = self.u[x]
        if perm == tuple(range(len(perm))):
            return x
        shape = tuple(term.shape[p] for p in perm)
        if term.op == "permute":
            return self.permute(term.args[0], tuple(term.attrs[0][p] for p in perm))
        n = len(perm)
        if term.op == "matmul" and n >= 2 and perm == tuple(range(n - 2)) + (n - 1, n - 2) and all(len(self.shape(a)) == n for a in term.args):
            # (A @ B)^T = B^T @ A^T: a product transposed (autograd's gradient of a right operand)
            # is the product of the transposes (flash attention's dK = dS^T @ Q; einsum's weight
            # gradient, a bmm of the transposed rows transposed back)
            a, b = (self.permute(x, perm) for x in term.args)
            return self.build("matmul", (b, a), (), shape, term.dtype)
        if term.op in PARTS:
            return self._map_parts(x, lambda t: self.permute(t, perm), shape)
        if term.op in ("sum", "amax") and not term.attrs[1]:
            # a reduction's result permuted is the reduction of its operand with the kept dims
            # permuted alike (a weight gradient summed over the batch, then transposed)
            reduced = term.attrs[0]
            kept = [d for d in range(len(self.shape(term.args[0]))) if d not in reduced]
            moved = iter(kept[p] for p in perm)
            order = tuple(d if d in reduced else next(moved) for d in range(len(kept) + len(reduced)))
            return self.build(term.op, (self.permute(term.args[0], order),), term.attrs, shape, term.dtype)
        if term.op == "full":
            return self.literal("full", (), term.attrs, shape, term.dtype)
        if term.op == "slice":
            box = term.attrs[0]
            return self.slice(self.permute(term.args[0], perm), tuple(box[p] for p in perm))
        if term.op == "cat":
            return self.cat([self.permute(a, perm) for a in term.args], perm.index(term.attrs[0]))
        if term.op == "repeat":
            return self.repeat(self.permute(term.args[0], perm), perm.index(term.attrs[0]), term.attrs[1])
        if term.op == "logsumexp" and term.attrs[0] == n:
            # a log-sum-exp over the last dim, its rows permuted: that of the scores' rows permuted
            # alike (flash attention's (heads, seq) lse kept as (seq, heads) beside the output)
            scores = term.args[0]
            return self.build("logsumexp", (self.permute(scores, perm + (n,)),), (n,), shape, term.dtype)
        if term.op == "bcast":
            dims = term.attrs[0]
            new_pos = [perm.index(d) for d in dims]
            order = sorted(range(len(dims)), key=lambda i: new_pos[i])
            base = self.permute(term.args[0], tuple(order))
            return self.bcast(base, shape, tuple(sorted(new_pos)))
        moved = [p for p in perm if term.shape[p] != 1]
        if moved == sorted(moved):  # only size-1 dims move: the elements keep their order, a reshape
            return self.view(x, shape)
        return self.literal("permute", (x,), (tuple(perm),), shape, term.dtype)


def _repeated(hint: tuple[Box, tuple[int, ...]], dim: int, times: int) -> tuple[Box, tuple[int, ...]]:
    """A region hint (box, global shape) of x as one of x repeated `times` times along `dim`."""
    box, shape = hint
    return (tuple((lo * times, hi * times) if d == dim else (lo, hi) for d, (lo, hi) in enumerate(box)),
            tuple(n * times if d == dim else n for d, n in enumerate(shape)))


def cat_bounds(r: Rules, t: int) -> list[tuple[int, int]]:
    term = r.u[t]
    dim, out, offset = term.attrs[0], [], 0
    for part in term.args:
        size = r.shape(part)[dim]
        out.append((offset, offset + size))
        offset += size
    return out
