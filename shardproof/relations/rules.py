"""Normalizing term constructors: the rewrite rules, applied bottom-up as terms are built.

Normal form, outermost first: `lin` (linear combinations: sums, scaling, subtraction), `piece`
(one part of a sum that was split over ranks: a contraction or reduction over a sharded axis,
or a masked vocab-parallel lookup) or `max_piece` (one part of a max split over ranks), `slice`
(a box of a larger tensor), `cat`, `bcast` (broadcasting), then compute ops. Rules pull slices,
concatenations and broadcasts out of ops (elementwise ops commute with them, matmul maps them
onto its free dims, a contraction over a sliced axis becomes a piece), so a rank's value is
expressed as a region of the very term the reference computes. Rule templates are per op kind
(see `shardproof.ir.ops.OPS`), not per op. Every rule is an equality over the reals; each has a
numeric test in tests/relations.
"""

from __future__ import annotations

import math
import itertools
from fractions import Fraction
from typing import Any, Callable

import torch

from shardproof.ir.ops import OPS, run_op
from shardproof.relations.assume import rebuild
from shardproof.relations.layout import Box, box_along, box_shape, compose, full_box, reshape_groups, view_of_box
from shardproof.relations.universe import Universe

FLOAT_DTYPES = {"float16", "bfloat16", "float32", "float64"}
PARTS = ("lin", "piece", "max_piece")  # terms that layout ops map into: they move elements, so they
# commute with summing ranks' values and with taking their max
REAL = "float64"  # the dtype of every float term


def real(dtype: str) -> str:
    """The dtype a term of IR dtype `dtype` has."""
    return REAL if dtype in FLOAT_DTYPES else dtype


class Rules:
    """Builds terms in normal form inside one Universe."""

    def __init__(self, universe: Universe | None = None) -> None:
        self.u = universe or Universe()
        self.reference_size: int | None = None  # terms below this id were built by the reference
        self.reference_boxes: dict[int, set[Box]] = {}  # root -> boxes the reference sliced it to
        self.reference_one_hots: dict[tuple[int, int], set[int]] = {}  # (dim, index) -> widths the reference wrote

    def in_reference(self, t: int) -> bool:
        """Where two normal forms are both true, rules prefer the one the reference built."""
        return self.reference_size is not None and t < self.reference_size

    # --- entry point for IR ops -------------------------------------------------------------------
    def build(self, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
        """The normal-form term of IR op `op` applied to terms `args`."""
        special = _BY_OP.get(op)
        if special is not None:
            return special(self, args, attrs, shape, dtype)
        kind = OPS[op].kind
        return _BY_KIND[kind](self, op, args, attrs, shape, dtype)

    def shape(self, t: int) -> tuple[int, ...]:
        return self.u[t].shape

    def op(self, t: int) -> str:
        return self.u[t].op

    def literal(self, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
        """Terms are values over the reals: every float dtype is one (a bf16 matmul of fp32 values
        cast down is the fp32 matmul); integer and bool dtypes stay apart."""
        return self.u.intern(op, args, attrs, shape, real(dtype))

    # --- leaves and constants ---------------------------------------------------------------------
    def leaf(self, name: str, shape: tuple[int, ...], dtype: str) -> int:
        return self.literal("leaf", (), (name,), shape, dtype)

    def const(self, spec: tuple, shape: tuple[int, ...], dtype: str) -> int:
        """A constant: one fill value (`full`, floats normalized) or explicit values / arange."""
        if spec[0] == "values" and len(set(spec[1])) == 1:
            spec = ("full", spec[1][0])
        if spec[0] != "full":
            return self.literal("const", (), spec, shape, dtype)
        value = intended(float(spec[1])) if dtype in FLOAT_DTYPES and not isinstance(spec[1], bool) else spec[1]
        return self.literal("full", (), (value,), shape, dtype)

    def full_value(self, t: int) -> Any | None:
        """The fill value if `t` is a constant filled with one value (possibly broadcast)."""
        term = self.u[t]
        if term.op == "full":
            return term.attrs[0]
        if term.op == "bcast":
            return self.full_value(term.args[0])
        return None

    # --- layout ---------------------------------------------------------------------------------
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
        if self.reference_size is None:
            self.reference_boxes.setdefault(x, set()).add(box)
        return self.literal("slice", (x,), (box,), shape, term.dtype)

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
        if len(merged) == 1:
            return merged[0]
        shape = list(self.shape(merged[0]))
        shape[dim] = sum(self.shape(p)[dim] for p in merged)
        return self.literal("cat", tuple(merged), (dim,), tuple(shape), self.u[merged[0]].dtype)

    def _join(self, a: int, b: int, dim: int) -> int | None:
        """Two adjacent regions of one tensor are one region."""
        ra, ba = self.as_region(a)
        rb, bb = self.as_region(b)
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
        if hint is not None:
            whole = self.unslice(t, *hint)
            if whole is not None:
                return whole, hint[0]
            for relative in self._hints_in_reference_boxes(t):
                whole = self.unslice(t, *relative)
                if whole is not None:
                    return whole, relative[0]
        return t, full_box(self.shape(t))

    def _hints_in_reference_boxes(self, t: int) -> list[tuple[Box, tuple[int, ...]]]:
        """(box, shape) of t's first sliced term inside each region of its root the reference
        sliced out: a rank's rotate-half lin(X[h, :d], -X[h, d:]) is heads h of the reference's
        lin(X[:, :d], -X[:, d:]), though no one box of X holds both halves."""
        term = self.u[t]
        first = next((a for a in term.args if self.op(a) == "slice"), None) if term.op == "lin" else None
        if first is None:
            return []
        root, region = self.u[first].args[0], self.u[first].attrs[0]
        return [
            (tuple((lo - rl, hi - rl) for (rl, _), (lo, hi) in zip(ref_box, region)), box_shape(ref_box))
            for ref_box in sorted(self.reference_boxes.get(root, ()))
            if ref_box != region and all(rl <= lo and hi <= rh for (rl, rh), (lo, hi) in zip(ref_box, region))
        ]

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
        """A term X of `global_shape` with X[box] == t, if the normal form shows one."""
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
        if term.op == "bcast":
            return self._unslice_bcast(t, box, tuple(global_shape))
        if term.op == "repeat":
            return self._unslice_repeat(t, box, tuple(global_shape))
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
        return None

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
        dims = term.attrs[0]
        inner = self.unslice(term.args[0], tuple(box[d] for d in dims), tuple(global_shape[d] for d in dims))
        return None if inner is None else self.bcast(inner, global_shape, dims)

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
            if inner is not None:
                candidate = self.repeat(inner, dim, times)
                if self.in_reference(candidate):
                    return candidate
        return None

    def view(self, x: int, shape: tuple[int, ...]) -> int:
        term = self.u[x]
        shape = tuple(shape)
        if term.shape == shape:
            return x
        if term.op == "view":
            return self.view(term.args[0], shape)
        if term.op in PARTS:
            return self._map_parts(x, lambda t: self.view(t, shape), shape)
        if term.op == "full":
            return self.literal("full", (), term.attrs, shape, term.dtype)
        if term.op == "bcast":
            moved = self._view_bcast(x, shape)
            if moved is not None:
                return moved
        if term.op == "slice":
            root, region = term.args[0], term.attrs[0]
        elif term.op == "cat":  # a cat may be a region too: a head range padded with zeros
            root, region = self._cat_region(x)
        else:
            root, region = x, None
        if root != x:
            found = self._view_region(root, region, shape)
            if found is None and term.op == "slice":
                found = self._view_inner_slice(root, region, shape)
            if found is not None:
                return found
        inserted = _inserted_ones(term.shape, shape)
        if inserted is not None:
            return self.bcast(x, shape, inserted)
        if term.op == "cat":
            moved = self._view_cat(x, shape)
            if moved is not None:
                return moved
        if term.op == "permute":
            moved = self._view_permute(x, shape)
            if moved is not None:
                return moved
        if term.op == "matmul" and len(term.shape) == 2 and len(self.shape(term.args[1])) == 2 and shape[-1] == term.shape[-1]:
            rows, inner = term.args
            lifted = self.view(rows, shape[:-1] + self.shape(rows)[-1:])
            return self.build("matmul", (lifted, inner), term.attrs, shape, term.dtype)
        if term.op == "matmul" and len(term.shape) > 2 and len(shape) > 2 and shape[-2:] == term.shape[-2:]:
            regrouped = self._view_matmul_batch(x, shape)
            if regrouped is not None:
                return regrouped
        return self.literal("view", (x,), (), shape, term.dtype)

    def _view_cat(self, x: int, shape: tuple[int, ...]) -> int | None:
        """A reshape that merges the cat dim of one-row-deep parts with the next dim reshapes
        their cat along that next dim. A reshape that merges or splits other dims and leaves the cat dim alone (its own group)
        reshapes each part the same way. Reshapes that only add or drop size-1 dims stay outside:
        broadcasts carry those."""
        term = self.u[x]
        dim = term.attrs[0]
        groups = reshape_groups(term.shape, shape) or []
        if any(dim in src and dim + 1 in src for src, _ in groups) and all(self.shape(p)[dim] == 1 for p in term.args):
            # parts one row deep stacked along `dim` lie in memory as the parts joined along the next dim
            # (a batch of one all-gathered on dim 0, then flattened with the sequence it shards)
            return self.view(self.cat(list(term.args), dim + 1), shape)
        alone = [dst for src, dst in groups if src == [dim] and len(dst) == 1]
        if not alone or all(len(src) <= 1 and len(dst) <= 1 for src, dst in groups):
            return None
        out_dim = alone[0][0]
        parts = []
        for p in term.args:
            part_shape = tuple(self.shape(p)[dim] if d == out_dim else s for d, s in enumerate(shape))
            parts.append(self.view(p, part_shape))
        return self.cat(parts, out_dim)

    def _view_matmul_batch(self, x: int, shape: tuple[int, ...]) -> int | None:
        """A reshape of only the batch dims of a batched matmul is that reshape of both operands'
        batch dims (each batch entry is its own product), so (b*heads, s, s) attention scores
        viewed as (b, heads, s, s) meet the reference's per-head products."""
        term = self.u[x]
        batch = term.shape[:-2]
        operands = []
        for a in term.args:
            a_shape = self.shape(a)
            if a_shape[:-2] != batch:
                return None  # an operand broadcast over the batch: not reshaped alike
            operands.append(self.view(a, shape[:-2] + a_shape[-2:]))
        return self.build("matmul", tuple(operands), term.attrs, shape, term.dtype)

    def _view_region(self, root: int, region: Box, shape: tuple[int, ...]) -> int | None:
        """view(root[region]) as a region of a view of root, if the normal form has one."""
        split = view_of_box(self.shape(root), region, shape, ones_split=True)
        plain = view_of_box(self.shape(root), region, shape)
        if split is not None and split != plain and self.reference_size is not None:
            whole = self.view(root, split[0])  # built in the reference run it would count as the reference's
            if self.in_reference(whole):
                return self.slice(whole, split[1])
        if plain is not None:
            return self.slice(self.view(root, plain[0]), plain[1])
        return None

    def _view_inner_slice(self, root: int, region: Box, shape: tuple[int, ...]) -> int | None:
        """view(X[box]) where the box restricts a dim that the reshape merges under an outer one
        (the v columns [64:96] of fused per-head qkv, merged with the heads): no box of a view of
        X is that, so X sliced on those inner dims alone stays a tensor of its own, Y, and the
        rest of the box (a rank's heads) is a box of view(Y). The reference slices the same Y."""
        root_shape = self.shape(root)
        groups = reshape_groups(box_shape(region), shape)
        if groups is None:
            return None
        inner = {d for gi, _ in groups if len(gi) > 1 for d in gi[1:] if region[d] != (0, root_shape[d])}
        if not inner:
            return None
        inner_box = tuple(region[d] if d in inner else (0, s) for d, s in enumerate(root_shape))
        held = self.literal("slice", (root,), (inner_box,), box_shape(inner_box), self.u[root].dtype)
        outer_box = tuple((0, hi - lo) if d in inner else (lo, hi) for d, (lo, hi) in enumerate(region))
        if outer_box == full_box(self.shape(held)):
            return self.literal("view", (held,), (), shape, self.u[root].dtype)
        found = view_of_box(self.shape(held), outer_box, shape)
        return None if found is None else self.slice(self.view(held, found[0]), found[1])

    def _view_permute(self, x: int, shape: tuple[int, ...]) -> int | None:
        """view(permute(Y, p)) as permute(view(permute(Y, r)), q): r makes each merged group of
        dims adjacent (groups in Y's order, the one holding Y's last dim kept last), so layouts
        that reach the same merge through different transposes, like (seq, batch, hidden) and
        (batch, seq, hidden) activations, meet in one normal form."""
        term = self.u[x]
        inner, perm = term.args[0], term.attrs[0]
        groups = reshape_groups(term.shape, shape)
        if groups is None or any(not gi or not gj for gi, gj in groups):
            return None
        last = len(perm) - 1
        mapped = [([perm[d] for d in gi], gj) for gi, gj in groups]
        ordered = sorted(mapped, key=lambda g: (last in g[0], min(g[0])))
        order = tuple(d for dims, _ in ordered for d in dims)
        middle_shape = tuple(shape[j] for _, gj in ordered for j in gj)
        if order == tuple(range(len(perm))):
            middle = self.view(inner, middle_shape)
        else:
            middle = self.literal("view", (self.permute(inner, order),), (), middle_shape, term.dtype)
        position = {j: i for i, j in enumerate(j for _, gj in ordered for j in gj)}
        return self.permute(middle, tuple(position[j] for j in range(len(shape))))

    def _view_bcast(self, x: int, shape: tuple[int, ...]) -> int | None:
        """Reshape a broadcast group by group. Groups of kept dims reshape the base (taking a
        size-1 dim just before them along); a kept dim merged with broadcast dims after it, or a
        kept size-1 dim followed by broadcast dims merged into one, is a repeat (GQA's repeat_kv);
        other size-1 dims pair up in order."""
        term = self.u[x]
        kept = set(term.attrs[0])
        groups = reshape_groups(term.shape, shape)
        if groups is None:
            return None
        rows = {}  # destination dim -> the kept size-1 source dim it repeats
        unpaired: list[int] = []  # size-1 source dims not yet paired with a size-1 destination
        for gi, gj in groups:
            if not gi:
                unpaired = unpaired[1:]
            elif not gj:
                unpaired.append(gi[0])
            else:
                if len(gj) == 1 and not kept & set(gi) and unpaired and unpaired[-1] in kept:
                    rows[gj[0]] = unpaired[-1]
                unpaired = []
        dims: list[int] = []
        base_shape: list[int] = []
        repeats: list[tuple[int, int]] = []
        free_ones: list[int] = []
        pending: list[int] = []  # size-1 source dims still to pair with size-1 destinations
        for gi, gj in groups:
            if not gi:
                if pending:
                    if pending.pop(0) in kept:
                        dims.append(gj[0])
                        base_shape.append(1)
                else:
                    free_ones.append(gj[0])
                continue
            if not gj:
                if gi[0] not in rows.values():
                    pending.append(gi[0])
                continue
            if kept & set(pending):
                return None
            pending.clear()
            mine = [d for d in gi if d in kept]
            if gj[0] in rows:
                dims.append(gj[0])
                base_shape.append(1)
                repeats.append((gj[0], shape[gj[0]]))
            elif not mine:
                pass
            elif mine == gi:
                dims.extend(free_ones + gj)
                base_shape.extend([1] * len(free_ones) + [shape[d] for d in gj])
            elif mine == gi[:1] and len(gj) == 1:
                dims.append(gj[0])
                base_shape.append(term.shape[mine[0]])
                repeats.append((gj[0], math.prod(term.shape[d] for d in gi[1:])))
            else:
                return None
            free_ones.clear()
        if kept & set(pending):
            return None
        base = self.view(term.args[0], tuple(base_shape))
        inner_shape = list(shape)
        for d, times in repeats:
            inner_shape[d] //= times
        out = self.bcast(base, tuple(inner_shape), tuple(dims))
        for d, times in repeats:
            out = self.repeat(out, d, times)
        return out

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
        if term.op in PARTS:
            return self._map_parts(x, lambda t: self.permute(t, perm), shape)
        if term.op == "full":
            return self.literal("full", (), term.attrs, shape, term.dtype)
        if term.op == "slice":
            box = term.attrs[0]
            return self.slice(self.permute(term.args[0], perm), tuple(box[p] for p in perm))
        if term.op == "cat":
            return self.cat([self.permute(a, perm) for a in term.args], perm.index(term.attrs[0]))
        if term.op == "repeat":
            return self.repeat(self.permute(term.args[0], perm), perm.index(term.attrs[0]), term.attrs[1])
        if term.op == "bcast":
            dims = term.attrs[0]
            new_pos = [perm.index(d) for d in dims]
            order = sorted(range(len(dims)), key=lambda i: new_pos[i])
            base = self.permute(term.args[0], tuple(order))
            return self.bcast(base, shape, tuple(sorted(new_pos)))
        return self.literal("permute", (x,), (tuple(perm),), shape, term.dtype)

    # --- linear structure --------------------------------------------------------------------------
    def lin(self, pairs: list[tuple[int, Fraction]]) -> int:
        coefs: dict[int, Fraction] = {}
        for t, c in pairs:
            term = self.u[t]
            inner_pairs = zip(term.args, term.attrs[0]) if term.op == "lin" else [(t, Fraction(1))]
            for inner, ic in inner_pairs:
                inner, ic = self._unit_constant(inner, ic)
                coefs[inner] = coefs.get(inner, Fraction(0)) + Fraction(c) * ic
        coefs = self._merge_pieces({t: c for t, c in coefs.items() if c != 0})
        items = sorted(coefs.items())
        if not items:
            first = pairs[0][0]
            return self.literal("full", (), (0.0,), self.shape(first), self.u[first].dtype)
        if len(items) == 1 and items[0][1] == 1:
            return items[0][0]
        only, c = items[0]
        if len(items) == 1 and self.full_value(only) == 1 and self.u[only].dtype in FLOAT_DTYPES:
            return self.literal("full", (), (c,), self.shape(only), self.u[only].dtype)  # a scaled constant is a constant
        by_parts = self._lin_of_cats(items)
        if by_parts is not None:
            return by_parts
        first = self.u[items[0][0]]
        return self.literal("lin", tuple(t for t, _ in items), (tuple(c for _, c in items),), first.shape, first.dtype)

    def _lin_of_cats(self, items: list[tuple[int, Fraction]]) -> int | None:
        """A sum of concatenations along one dim (and constants) is the concatenation of the sums of
        their parts, cut at every part boundary: flat gradient buffers summed over ranks become the
        per-parameter sums, where pieces of one contraction meet and merge."""
        cats = [self.u[t] for t, _ in items if self.u[t].op == "cat"]
        if not cats:
            return None
        dim = cats[0].attrs[0]
        if any(self.u[t].op != "full" and (self.u[t].op != "cat" or self.u[t].attrs[0] != dim) for t, _ in items):
            return None
        shape = cats[0].shape
        cuts = sorted({0, shape[dim]} | {end for t, _ in items if self.u[t].op == "cat" for _, end in _cat_bounds(self, t)})
        parts = []
        for lo, hi in zip(cuts, cuts[1:]):
            box = box_along(shape, dim, lo, hi)
            parts.append(self.lin([(self.slice(t, box), c) for t, c in items]))
        return self.cat(parts, dim)

    def _unit_constant(self, t: int, c: Fraction) -> tuple[int, Fraction]:
        """c * full(v) is (v*c) * full(1): constants of one shape merge into one term."""
        term = self.u[t]
        if term.op == "full" and _is_finite_number(term.attrs[0]) and term.attrs[0] != 1:
            one = self.literal("full", (), (1.0 if term.dtype in FLOAT_DTYPES else 1,), term.shape, term.dtype)
            return one, c * Fraction(term.attrs[0])
        return t, c

    def _merge_pieces(self, coefs: dict[int, Fraction]) -> dict[int, Fraction]:
        """Pieces of one sum whose ranges tile the whole axis add up to the sum itself."""
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for t, c in coefs.items():
            term = self.u[t]
            if term.op == "piece":
                axis, lo, hi, size = term.attrs
                groups.setdefault((term.args[0], axis, size, c), []).append((lo, hi, t))
        for (full, axis, size, c), ranges in groups.items():
            for run in _adjacent_runs(ranges):
                for _, _, t in run:
                    del coefs[t]
                merged = self.piece(full, axis, run[0][0], run[-1][1], size)
                coefs[merged] = coefs.get(merged, Fraction(0)) + c
        return coefs

    def piece(self, full: int, axis: Any, lo: int, hi: int, size: int) -> int:
        """The part of the sum `full` whose summation index along `axis` lies in [lo, hi)."""
        if (lo, hi) == (0, size):
            return full
        term = self.u[full]
        return self.literal("piece", (full,), (axis, lo, hi, size), term.shape, term.dtype)

    def max_piece(self, full: int, axis: Any, lo: int, hi: int, size: int) -> int:
        """The max `full` takes over the indices [lo, hi) of the reduced `axis` only (one rank's max
        over its shard). Max pieces combine by a max (see `maximum`), never by a sum."""
        if (lo, hi) == (0, size):
            return full
        term = self.u[full]
        return self.literal("max_piece", (full,), (axis, lo, hi, size), term.shape, term.dtype)

    def maximum(self, parts: list[int]) -> int:
        """The elementwise max of `parts` (a MAX all-reduce): equal terms collapse, and max pieces
        whose ranges tile their axis are the max over the whole axis."""
        operands = set(parts)
        groups: dict[tuple, list[tuple[int, int, int]]] = {}
        for t in operands:
            term = self.u[t]
            if term.op == "max_piece":
                axis, lo, hi, size = term.attrs
                groups.setdefault((term.args[0], axis, size), []).append((lo, hi, t))
        for (full, axis, size), ranges in groups.items():
            for run in _adjacent_runs(ranges):
                operands -= {t for _, _, t in run}
                operands.add(self.max_piece(full, axis, run[0][0], run[-1][1], size))
        result, *rest = sorted(operands)
        for t in rest:
            result = self.build("maximum", (result, t), (), self.shape(result), self.u[result].dtype)
        return result

    def _map_parts(self, x: int, f: Callable[[int], int], shape: tuple[int, ...]) -> int:
        """Apply a layout map (it moves elements) through lin, piece and max_piece."""
        term = self.u[x]
        if term.op == "max_piece":
            return self.max_piece(f(term.args[0]), *term.attrs)
        return self._map_linear(x, f, shape)

    def _map_linear(self, x: int, f: Callable[[int], int], shape: tuple[int, ...]) -> int:
        """Apply a linear map through `lin` and `piece`."""
        term = self.u[x]
        if term.op == "lin":
            return self.lin([(f(t), c) for t, c in zip(term.args, term.attrs[0])])
        axis, lo, hi, size = term.attrs
        return self.piece(f(term.args[0]), axis, lo, hi, size)

    def scale(self, x: int, factor: Any) -> int:
        return self.lin([(x, Fraction(factor))])


SIMPLE_DENOMINATOR = 10**6
ROUNDING_ULPS = 8  # how far Python's arithmetic on a few constants may have rounded them


def intended(value: float) -> float | Fraction:
    """The real number a float constant stands for: a fraction with a small denominator within a
    few units of rounding of it, if there is one. Python rounds `0.1 * V / (V - 1)` and `1.0 - s`
    step by step, so over the reals the coefficients of a label-smoothed loss no longer add up to 1,
    while the program meant 8/75 and 67/75. A float exact with a small denominator stays as it is."""
    if not math.isfinite(value):
        return value
    exact = Fraction(value)
    if exact.denominator <= SIMPLE_DENOMINATOR:
        return value
    simple = exact.limit_denominator(SIMPLE_DENOMINATOR)
    return simple if abs(simple - exact) <= ROUNDING_ULPS * Fraction(math.ulp(value)) else value


def _inserted_ones(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...] | None:
    """Where src's dims sit in dst if dst is src with size-1 dims inserted (first fit)."""
    dims, j = [], 0
    for size in src:
        while j < len(dst) and dst[j] != size:
            if dst[j] != 1:
                return None
            j += 1
        if j == len(dst):
            return None
        dims.append(j)
        j += 1
    return tuple(dims) if all(dst[k] == 1 for k in range(j, len(dst))) else None


def _adjacent_runs(ranges: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """The runs of two or more (lo, hi, term) whose ranges follow each other without gap or overlap."""
    ranges = sorted(ranges)
    runs: list[list[tuple[int, int, int]]] = [[ranges[0]]]
    for r in ranges[1:]:
        if r[0] == runs[-1][-1][1]:
            runs[-1].append(r)
        else:
            runs.append([r])
    return [run for run in runs if len(run) > 1]


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float, Fraction)) and not isinstance(value, bool) and math.isfinite(value)


# --- rule templates per op kind ---------------------------------------------------------------------
# Ops whose value on constants is exact in floating point: folding them changes no value.
_EXACT_ON_CONSTANTS = {"abs", "maximum", "minimum", "logical_not", "logical_and", "logical_or", "lt", "le", "gt", "ge",
                       "eq", "ne", "convert"}


def _elementwise(r: Rules, op: str, args: tuple[int, ...], attrs: tuple, shape: tuple[int, ...], dtype: str) -> int:
    """Elementwise ops commute with slices, concatenation and broadcasting of all their operands."""
    values = [r.full_value(a) for a in args]
    if op in _EXACT_ON_CONSTANTS and None not in values:  # e.g. lerp's `|weight| >= 0.5` on a constant weight
        exact = [torch.tensor(float(v) if isinstance(v, Fraction) else v) for v in values]
        return r.const(("full", run_op(op, exact, attrs).item()), shape, dtype)
    for a in args:
        for root, box in r.regions(a):
            if root == a:
                continue
            global_shape = r.shape(root)
            roots = [r.region_like(b, box, global_shape) for b in args]
            if None not in roots:
                return r.slice(r.build(op, tuple(roots), attrs, global_shape, dtype), box)
    for a in args:
        term = r.u[a]
        if term.op == "cat":
            dim, bounds = term.attrs[0], _cat_bounds(r, a)
            parts = []
            for lo, hi in bounds:
                box = box_along(shape, dim, lo, hi)
                sub = tuple(r.slice(b, box) for b in args)
                parts.append(r.build(op, sub, attrs, box_shape(box), dtype))
            return r.cat(parts, dim)
    bases = [r.u[a] for a in args]
    if bases and all(b.op == "bcast" for b in bases) and len({b.attrs[0] for b in bases}) == 1:
        dims = bases[0].attrs[0]
        inner = r.build(op, tuple(b.args[0] for b in bases), attrs, tuple(shape[d] for d in dims), dtype)
        return r.bcast(inner, shape, dims)
    for a in args:
        source = _viewed_from(r, a)
        inner = [_unview(r, b, source) for b in args] if source is not None else [None]
        if None not in inner:
            return r.view(r.build(op, tuple(inner), attrs, source, dtype), shape)
    if op in _COMMUTATIVE:
        args = tuple(sorted(args))  # a * b and b * a are one term
    return r.literal(op, args, attrs, shape, dtype)


_COMMUTATIVE = {"mul", "maximum", "minimum", "logical_and", "logical_or", "eq", "ne"}


def _viewed_from(r: Rules, t: int) -> tuple[int, ...] | None:
    """The shape `t` was reshaped from, if its normal form is a view (inside lin and piece)."""
    term = r.u[t]
    if term.op == "view":
        return r.shape(term.args[0])
    if term.op in ("lin", "piece"):
        return _viewed_from(r, term.args[0])
    return None


def _unview(r: Rules, t: int, shape: tuple[int, ...]) -> int | None:
    """A term X of `shape` with view(X) == t, if the normal form shows one."""
    term = r.u[t]
    if term.op == "view" and r.shape(term.args[0]) == shape:
        return term.args[0]
    if term.op == "full":
        return r.literal("full", (), term.attrs, shape, term.dtype)
    if term.op in ("lin", "piece"):
        inner = [_unview(r, a, shape) for a in term.args]
        if None in inner:
            return None
        if term.op == "lin":
            return r.lin(list(zip(inner, term.attrs[0])))
        return r.piece(inner[0], *term.attrs)
    return None


def _cat_bounds(r: Rules, t: int) -> list[tuple[int, int]]:
    term = r.u[t]
    dim, out, offset = term.attrs[0], [], 0
    for part in term.args:
        size = r.shape(part)[dim]
        out.append((offset, offset + size))
        offset += size
    return out


def _unary(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    if op == "neg":
        return r.scale(args[0], -1)
    return _elementwise(r, op, args, attrs, shape, dtype)


def _add(r: Rules, args, attrs, shape, dtype) -> int:
    return r.lin([(args[0], Fraction(1)), (args[1], Fraction(1))])


def _common_factor(r: Rules, t: int) -> tuple[int, Fraction]:
    """(u, c) with t = c * u, so that scales move out of products (a gradient averaged over a
    data-parallel group is (1/dp) times the sum over its batch shard). A scaled term gives its
    coefficient; a sum gives c > 0, the largest rational dividing every coefficient, which does
    not depend on the order of the terms, so every rank's slice of a sum factors like the sum."""
    term = r.u[t]
    if term.op != "lin" or term.dtype not in FLOAT_DTYPES:  # integer lin truncates: no factoring
        return t, Fraction(1)
    coefs = term.attrs[0]
    if len(coefs) == 1:
        return term.args[0], coefs[0]
    c = Fraction(math.gcd(*(k.numerator for k in coefs)), math.lcm(*(k.denominator for k in coefs)))
    if c == 1:
        return t, c
    return r.lin([(a, k / c) for a, k in zip(term.args, coefs)]), c


def _bilinear(r: Rules, op: str, args, attrs, shape, dtype) -> int | None:
    """c*x (op) d*y = c*d * (x (op) y) for ops linear in each real operand (mul, matmul); not for
    integers, where a fractional scale truncates."""
    (x, c), (y, d) = (_common_factor(r, a) for a in args)
    if c == 1 and d == 1:
        return None
    return r.scale(r.build(op, (x, y), attrs, shape, dtype), c * d)


def _mul(r: Rules, args, attrs, shape, dtype) -> int:
    masked = _times_mask(r, args, shape, dtype)
    if masked is not None:
        return masked
    for i, a in enumerate(args):
        value = r.full_value(a)
        if _is_finite_number(value) and dtype in FLOAT_DTYPES:
            return r.scale(args[1 - i], value)
    scaled = _bilinear(r, "mul", args, attrs, shape, dtype)
    if scaled is not None:
        return scaled
    for i, a in enumerate(args):
        other = args[1 - i]
        if r.op(a) == "piece" and r.op(other) != "piece":
            return r._map_linear(a, lambda t: r.build("mul", (t, other), attrs, shape, dtype), shape)
    for i, a in enumerate(args):
        flag = r.u[a]
        if flag.op == "convert" and r.u[flag.args[0]].dtype == "bool":  # x * float(m) = where(m, x, 0)
            zero = r.literal("full", (), (0.0,), shape, dtype)
            return r.build("where", (flag.args[0], args[1 - i], zero), (), shape, dtype)
    for i, a in enumerate(args):
        absorbed = _one_hot_times(r, a, args[1 - i], attrs, shape, dtype)
        if absorbed is not None:
            return absorbed
    return _elementwise(r, "mul", args, attrs, shape, dtype)


def _one_hot_times(r: Rules, a: int, factor: int, attrs, shape, dtype) -> int | None:
    """A one-hot (or a sum with one) times a factor that is constant along its dim: the factor
    moves into the written values, onto each term of the sum."""
    term = r.u[a]
    hots = [t for t in (term.args if term.op == "lin" else (a,)) if _is_one_hot(r, t)]
    if not hots or not all(_constant_along(r, factor, r.u[h].attrs[0]) for h in hots):
        return None
    if term.op == "lin":
        return r.lin([(r.build("mul", (t, factor), attrs, shape, dtype), c) for t, c in zip(term.args, term.attrs[0])])
    zeros, index, src = term.args
    row = r.slice(factor, tuple((0, n) for n in r.shape(index)))
    return r.build("scatter_add", (zeros, index, r.build("mul", (src, row), attrs, r.shape(src), dtype)), term.attrs, shape, dtype)


def _is_one_hot(r: Rules, t: int) -> bool:
    term = r.u[t]
    return term.op == "scatter_add" and r.full_value(term.args[0]) == 0


def _constant_along(r: Rules, t: int, dim: int) -> bool:
    term = r.u[t]
    return term.op == "full" or (term.op == "bcast" and dim not in term.attrs[0])


def _div(r: Rules, args, attrs, shape, dtype) -> int:
    value = r.full_value(args[1])
    if _is_finite_number(value) and value != 0 and dtype in FLOAT_DTYPES:
        return r.scale(args[0], Fraction(1) / Fraction(value))
    (x, c), (y, d) = (_common_factor(r, a) for a in args)
    if c != 1 or d != 1:
        return r.scale(r.build("div", (x, y), attrs, shape, dtype), c / d)
    return _elementwise(r, "div", args, attrs, shape, dtype)


def _layout(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    x = args[0]
    if op == "view":
        return r.view(x, tuple(attrs[0]))
    if op == "permute":
        return r.permute(x, tuple(attrs[0]))
    if op == "slice":
        dim, lo, hi = attrs
        return r.slice(x, box_along(r.shape(x), dim, lo, hi))
    if op == "cat":
        return r.cat(list(args), attrs[0])
    if op == "expand":
        return r.expand(x, tuple(attrs[0]))
    if op == "convert":
        if dtype in FLOAT_DTYPES and r.u[x].dtype in FLOAT_DTYPES:
            return x  # equivalence is over the reals: float casts are the identity
        return _elementwise(r, op, args, attrs, shape, dtype)
    raise AssertionError(op)


def _reduce(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    dims, keepdim = attrs
    x = args[0]
    root_shape = r.shape(r.as_region(x)[0])
    ones = [d for d in dims if root_shape[d] == 1]  # not a one-wide shard of a larger sum: that stays a piece
    if ones and not keepdim:  # reducing a size-1 dim only drops it, from the whole the region is cut from
        root, box = r.as_region(x)
        kept = [d for d in range(len(box)) if d not in ones]
        squeezed = r.slice(r.view(root, tuple(root_shape[d] for d in kept)), tuple(box[d] for d in kept))
        rest = tuple(d - sum(o < d for o in ones) for d in dims if d not in ones)
        return r.build(op, (squeezed,), (rest, False), shape, dtype) if rest else squeezed
    if keepdim:
        inner_shape = tuple(s for d, s in enumerate(r.shape(x)) if d not in dims)
        return r.view(r.build(op, (x,), (dims, False), inner_shape, dtype), shape)
    term = r.u[x]
    filled = r.full_value(x)
    if op in _SPLIT_REDUCTIONS and _is_finite_number(filled) and dtype in FLOAT_DTYPES:
        # a constant's sum is the value times the count (the sum of the smoothing term of a label-
        # smoothed loss's gradient over the vocab), its max the value
        constant = r.literal("full", (), (filled,), shape, dtype)
        return r.scale(constant, math.prod(term.shape[d] for d in dims)) if op == "sum" else constant
    if op == "sum" and _is_one_hot(r, x) and term.attrs[0] in dims:
        return r.build("sum", (term.args[2],), attrs, shape, dtype)  # one entry per row: the written values
    if op in ("sum", "amax") and term.op == "view":
        unviewed = _reduce_through_view(r, op, x, dims, shape, dtype)
        if unviewed is not None:
            return unviewed
    if op == "sum" and term.op in ("lin", "piece"):
        return r._map_linear(x, lambda t: r.build(op, (t,), attrs, shape, dtype), shape)
    if op in _SPLIT_REDUCTIONS and term.op == "bcast" and term.dtype == real(dtype):
        return _reduce_copies(r, op, x, dims, shape, dtype)
    if op == "sum" and term.op == "cat" and term.attrs[0] in dims:  # a sum over the joined dim adds the parts' sums
        return r.lin([(r.build(op, (p,), attrs, shape, dtype), Fraction(1)) for p in term.args])
    root, box = r.as_region(x)
    if root != x:
        reduced_restricted = [d for d in dims if box[d] != (0, r.shape(root)[d])]
        kept_box = tuple(b for d, b in enumerate(box) if d not in dims)
        global_out = tuple(s for d, s in enumerate(r.shape(root)) if d not in dims)
        if not reduced_restricted:
            return r.slice(r.build(op, (root,), attrs, global_out, dtype), kept_box)
        if op in _SPLIT_REDUCTIONS and len(reduced_restricted) == 1:
            d = reduced_restricted[0]
            size = r.shape(root)[d]
            whole_d = r.slice(root, tuple((0, size) if k == d else b for k, b in enumerate(box)))
            total = r.build(op, (whole_d,), attrs, shape, dtype)
            lo, hi = box[d]
            return _SPLIT_REDUCTIONS[op](r, total, (op, d, root), lo, hi, size)
    return r.literal(op, (x,), attrs, shape, dtype)


# A reduction over part of an axis is a part of the reduction over all of it: a piece of a sum,
# a max piece of a max.
_SPLIT_REDUCTIONS: dict[str, Callable[..., int]] = {"sum": Rules.piece, "amax": Rules.max_piece}


def _reduce_copies(r: Rules, op: str, x: int, dims: tuple[int, ...], shape, dtype) -> int:
    """Reducing a broadcast reduces its base over the reduced base dims (a bias summed over the
    hidden dim is one number for every token, however many tokens a rank holds) and copies of
    one value over the reduced broadcast dims: a sum over them is the value times their count,
    a max over them is the value."""
    term = r.u[x]
    base, placed = term.args[0], term.attrs[0]
    base_dims = tuple(i for i, d in enumerate(placed) if d in dims)
    kept = [(i, d) for i, d in enumerate(placed) if d not in dims]
    inner_shape = tuple(r.shape(base)[i] for i, _ in kept)
    inner = r.build(op, (base,), (base_dims, False), inner_shape, dtype) if base_dims else base
    out = r.bcast(inner, shape, tuple(d - sum(1 for c in dims if c < d) for _, d in kept))
    copies = math.prod(term.shape[d] for d in dims if d not in placed)
    return r.scale(out, copies) if op == "sum" else out


def _reduce_through_view(r: Rules, op: str, x: int, dims: tuple[int, ...], shape: tuple[int, ...], dtype: str) -> int | None:
    """Reducing whole groups of a reshape reduces its source over those groups' source dims:
    summing a flattened (b*s, h) over its rows sums (b, s, h) over b and s."""
    term = r.u[x]
    source = term.args[0]
    groups = reshape_groups(r.shape(source), term.shape)
    if groups is None:
        return None
    reduced, source_dims = set(dims), []
    for gi, gj in groups:
        if gj and set(gj) <= reduced:
            source_dims.extend(gi)
        elif reduced & set(gj):
            return None
    source_dims = [d for d in source_dims if r.shape(source)[d] != 1]
    if not source_dims:  # only size-1 dims reduced
        return r.view(source, shape)
    kept = tuple(n for d, n in enumerate(r.shape(source)) if d not in source_dims)
    return r.view(r.build(op, (source,), (tuple(sorted(source_dims)), False), kept, dtype), shape)


def _softmax(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    (dim,) = attrs
    x = args[0]
    root, box = r.as_region(x)
    if root != x and box[dim] == (0, r.shape(root)[dim]):
        return r.slice(r.build(op, (root,), attrs, r.shape(root), dtype), box)
    term = r.u[x]
    if term.op == "cat" and term.attrs[0] != dim:
        return r.cat([r.build(op, (p,), attrs, r.shape(p), dtype) for p in term.args], term.attrs[0])
    return r.literal(op, (x,), attrs, shape, dtype)


def _log_softmax(r: Rules, args, attrs, shape, dtype) -> int:
    """log_softmax(x) = (x - m) - log(sum(exp(x - m))), m = max(x) along the dim: the spelling a
    vocab-parallel cross entropy computes across ranks. The shift m cancels over the reals, but
    both sides compute it, so their terms meet op for op."""
    (dim,) = attrs
    x = args[0]
    row_shape = tuple(1 if d == dim else s for d, s in enumerate(shape))  # keepdim, then expand: as it is spelled
    over_dim = ((dim,), True)
    peak = r.expand(r.build("amax", (x,), over_dim, row_shape, dtype), shape)
    shifted = r.lin([(x, Fraction(1)), (peak, Fraction(-1))])
    total = r.build("sum", (r.build("exp", (shifted,), (), shape, dtype),), over_dim, row_shape, dtype)
    log_total = r.expand(r.build("log", (total,), (), row_shape, dtype), shape)
    return r.lin([(shifted, Fraction(1)), (log_total, Fraction(-1))])


def _log(r: Rules, args, attrs, shape, dtype) -> int:
    """log(exp(a)) = a, and log(exp(a) / b) = a - log(b) wherever the left side is defined: the log
    of softmax probabilities (as cross entropy with label smoothing takes it) is a log-softmax."""
    x = r.u[args[0]]
    if x.op == "exp":
        return x.args[0]
    if x.op == "div" and r.op(x.args[0]) == "exp":
        exponent, divisor = r.u[x.args[0]].args[0], x.args[1]
        return r.lin([(exponent, Fraction(1)), (r.build("log", (divisor,), attrs, shape, dtype), Fraction(-1))])
    return _elementwise(r, "log", args, attrs, shape, dtype)


def _matmul(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    a, b = args
    ta = r.u[a]
    if ta.op == "permute" and ta.attrs[0][-1] == len(ta.shape) - 1 and len(r.shape(b)) == 2:
        inner = ta.args[0]  # rows permuted, contraction dim in place: permute the product instead
        product = r.build(op, (inner, b), attrs, r.shape(inner)[:-1] + shape[-1:], dtype)
        return r.permute(product, ta.attrs[0])
    scaled = _bilinear(r, op, args, attrs, shape, dtype)
    if scaled is not None:
        return scaled
    for i, t in enumerate((a, b)):
        term = r.u[t]
        other = args[1 - i]
        if term.op == "piece" and r.op(other) != "piece":
            return r._map_linear(
                t, lambda x: r.build("matmul", (x, other) if i == 0 else (other, x), attrs, shape, dtype), shape
            )
    for i, t in enumerate((a, b)):
        term = r.u[t]
        free_dim = len(shape) - 2 + i
        if term.op == "cat" and term.attrs[0] == len(term.shape) - 2 + i:
            parts = []
            for p in term.args:
                pair = (p, b) if i == 0 else (a, p)
                out_shape = list(shape)
                out_shape[free_dim] = r.shape(p)[term.attrs[0]]
                parts.append(r.build("matmul", pair, attrs, tuple(out_shape), dtype))
            return r.cat(parts, free_dim)
    split = _split_contraction(r, a, b, attrs, shape, dtype)
    if split is not None:
        return split
    return _matmul_slices(r, a, b, attrs, shape, dtype)


def _split_contraction(r: Rules, a: int, b: int, attrs, shape, dtype) -> int | None:
    """A contraction over a concatenation is the sum of the contractions over its parts:
    cat(a1, a2) @ cat(b1, b2) = a1 @ b1 + a2 @ b2 (an operand that is not a cat is sliced at the
    other's boundaries). Backward of a fused projection: the gradient of cat(gate, up) times the
    fused weight."""
    a_dim, b_dim = len(r.shape(a)) - 1, len(r.shape(b)) - 2
    ta, tb = r.u[a], r.u[b]
    a_cat = ta.op == "cat" and ta.attrs[0] == a_dim
    b_cat = tb.op == "cat" and tb.attrs[0] == b_dim
    if not (a_cat or b_cat):
        return None
    cats = [t for t, is_cat in ((a, a_cat), (b, b_cat)) if is_cat]
    cuts = sorted({0, r.shape(a)[a_dim]} | {end for t in cats for _, end in _cat_bounds(r, t)})
    terms = []
    for lo, hi in zip(cuts, cuts[1:]):
        part_a = r.slice(a, box_along(r.shape(a), a_dim, lo, hi))
        part_b = r.slice(b, box_along(r.shape(b), b_dim, lo, hi))
        terms.append((r.build("matmul", (part_a, part_b), attrs, shape, dtype), Fraction(1)))
    return r.lin(terms)


def _matmul_slices(r: Rules, a: int, b: int, attrs, shape, dtype) -> int:
    """Slices on free dims move to the output; equal slices of the contracted dim make a piece."""
    ra, box_a = r.as_region(a)
    rb, box_b = r.as_region(b)
    if ra == a and rb == b:
        return r.literal("matmul", (a, b), attrs, shape, dtype)
    batch_differs = box_a[:-2] != box_b[:-2] or r.shape(ra)[:-2] != r.shape(rb)[:-2]
    if len(shape) > 2 and len(r.shape(b)) > 2 and batch_differs:
        ra, box_a, rb, box_b = _align_batch(r, a, ra, box_a, b, rb, box_b)
    candidates = ([(ra, box_a, rb, box_b)] if _aligned(r, ra, box_a, rb, box_b) else []) + _aligned_regions(r, a, b)
    if not candidates:
        return r.literal("matmul", (a, b), attrs, shape, dtype)
    ra, box_a, rb, box_b = candidates[0]
    core = r.build("matmul", (ra, rb), attrs, r.shape(ra)[:-1] + r.shape(rb)[-1:], dtype)
    for other in candidates[1:] if r.reference_size is not None and not r.in_reference(core) else ():
        product = r.build("matmul", (other[0], other[2]), attrs, r.shape(other[0])[:-1] + r.shape(other[2])[-1:], dtype)
        if r.in_reference(product):  # the product the reference computed, e.g. of its v, not of all of qkv
            (ra, box_a, rb, box_b), core = other, product
            break
    sa = r.shape(ra)
    out = r.slice(core, box_a[:-1] + box_b[-1:])
    lo, hi = box_a[-1]
    return r.piece(out, ("matmul", core), lo, hi, sa[-1])


def _aligned(r: Rules, ra: int, box_a: Box, rb: int, box_b: Box) -> bool:
    """Both regions share the batch and contract the same range of the same length."""
    sa, sb = r.shape(ra), r.shape(rb)
    if len(sb) > 2 and (len(sa) != len(sb) or sa[:-2] != sb[:-2] or box_a[:-2] != box_b[:-2]):
        return False
    return sa[-1] == sb[-2] and box_a[-1] == box_b[-2]


def _aligned_regions(r: Rules, a: int, b: int) -> list[tuple[int, Box, int, Box]]:
    """Regions of the operands that line up, also inside tensors the reference sliced out: a
    rank's heads of q and of k, each a region of the reference's q and k from one fused qkv."""
    return [
        (ra, box_a, rb, box_b)
        for ra, box_a in r.regions(a)
        for rb, box_b in r.regions(b)
        if (ra, rb) != (a, b) and _aligned(r, ra, box_a, rb, box_b)
    ]


def _align_batch(r: Rules, a: int, ra: int, box_a: Box, b: int, rb: int, box_b: Box) -> tuple[int, Box, int, Box]:
    """Express the operand without a batch slice as a region with the other operand's batch box."""
    for sliced, other in ((a, b), (b, a)):
        other_root, other_box = r.as_region(other)
        for root, box in r.regions(sliced):
            if root == sliced:
                continue
            target = box[:-2] + other_box[-2:]
            lifted = r.region_like(other, target, r.shape(root)[:-2] + r.shape(other_root)[-2:])
            if lifted is not None:
                return (root, box, lifted, target) if sliced == a else (lifted, target, root, box)
    return ra, box_a, rb, box_b


def _embedding(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    weight, ids = args
    root_w, box_w = r.as_region(weight)
    if root_w != weight and box_w[0] == (0, r.shape(root_w)[0]):
        global_shape = shape[:-1] + (r.shape(root_w)[1],)
        return r.slice(r.build(op, (root_w, ids), attrs, global_shape, dtype), tuple((0, s) for s in shape[:-1]) + (box_w[1],))
    root_i, box_i = r.as_region(ids)
    if root_i != ids:
        global_shape = r.shape(root_i) + shape[-1:]
        return r.slice(r.build(op, (weight, root_i), attrs, global_shape, dtype), box_i + ((0, shape[-1]),))
    return r.literal(op, args, attrs, shape, dtype)


def _where(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    cond, when_true, when_false = args
    known = r.full_value(cond)
    if isinstance(known, bool):
        return when_true if known else when_false
    when_true, when_false = _assuming(r, when_true, cond, True), _assuming(r, when_false, cond, False)
    if when_true == when_false:
        return when_true
    chosen = r.full_value(cond)
    if chosen is not None:
        return when_true if chosen else when_false
    masked = _masked_lookup(r, cond, when_true, when_false)
    if masked is None and r.full_value(when_false) == 0:
        negated = r.build("logical_not", (cond,), (), shape, r.u[cond].dtype)
        masked = _masked_lookup(r, negated, when_false, when_true)
    if masked is not None:
        return masked
    return _elementwise(r, op, (cond, when_true, when_false), attrs, shape, dtype)


def _gather(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """gather(x, dim, index) is linear in x, constant where x is broadcast along dim, and acts
    elementwise along the other dims (slices there, and any slice of the index, move out)."""
    x, index = args
    (dim,) = attrs
    if _local_lookup(r, x, index, dim):
        # one rank's lookup into its shard of the table: kept whole, so the mask that zeroes the
        # entries other ranks own can make it a piece (see _masked_lookup)
        return r.literal(op, args, attrs, shape, dtype)
    term = r.u[x]
    if term.op in ("lin", "piece"):
        return r._map_linear(x, lambda t: r.build(op, (t, index), attrs, shape, dtype), shape)
    if term.op == "full":
        return r.literal("full", (), term.attrs, shape, dtype)
    if term.op == "bcast" and dim not in term.attrs[0]:
        placed = term.attrs[0]
        return r.bcast(r.slice(term.args[0], tuple((0, shape[d]) for d in placed)), shape, placed)
    moved = _gather_regions(r, x, index, dim, attrs, dtype)
    return moved if moved is not None else r.literal(op, args, attrs, shape, dtype)


def _local_lookup(r: Rules, table: int, index: int, dim: int) -> bool:
    """A lookup into the [lo, hi) shard of a table along `dim` with ids - lo, masked to the shard
    (where) or clamped to it."""
    masked_index = r.u[_unshaped(r, index)]
    if masked_index.op == "where":
        return _share_lookup(r, table, index, dim, masked_index.args[0]) is not None
    root, box = r.as_region(table)
    lo, hi = box[dim]
    if root == table or (lo, hi) == (0, r.shape(root)[dim]):
        return False
    shifted = _unbroadcast(r, index)
    ids = _shifted_ids(r, shifted, lo)
    return ids is not None and r.shape(ids) == r.shape(shifted) and _is_shift_of(r, shifted, ids, lo, hi, {})


def _gather_regions(r: Rules, x: int, index: int, dim: int, attrs: tuple, dtype: str) -> int | None:
    """gather(X[b], dim, I[b']) = gather(X, dim, I)[b'] when b leaves dim whole and b, b' agree on
    the other dims (where x and index have one shape)."""
    x_shape, index_shape = r.shape(x), r.shape(index)
    if any(a != b for d, (a, b) in enumerate(zip(x_shape, index_shape)) if d != dim):
        return None
    for t, other_size in ((x, index_shape[dim]), (index, x_shape[dim])):
        for root, box in r.regions(t):
            if root == t or (t == x and box[dim] != (0, r.shape(root)[dim])):
                continue
            region = (box, r.shape(root))
            other = _whole_along(dim, other_size, *region)
            (x_box, x_global), (out_box, out_global) = (region, other) if t == x else (other, region)
            whole_x, whole_index = r.region_like(x, x_box, x_global), r.region_like(index, out_box, out_global)
            if whole_x is not None and whole_index is not None:
                return r.slice(r.build("gather", (whole_x, whole_index), attrs, out_global, dtype), out_box)
    return None


def _whole_along(dim: int, size: int, box: Box, shape: tuple[int, ...]) -> tuple[Box, tuple[int, ...]]:
    """The region `box` of `shape` with dim `dim` replaced by all of a dim of `size`."""
    return (
        tuple((0, size) if d == dim else b for d, b in enumerate(box)),
        tuple(size if d == dim else s for d, s in enumerate(shape)),
    )


# Lookups: ops that read entries of a table (operand 0) along an axis at the ids in operand 1.
_LOOKUP_AXIS: dict[str, Callable[[tuple], int]] = {"embedding": lambda attrs: 0, "gather": lambda attrs: attrs[0]}


def _masked_lookup(r: Rules, cond: int, when_true: int, when_false: int) -> int | None:
    """where(ids outside [lo,hi), 0, lookup(T[lo:hi], ids - lo)) is the [lo,hi) piece of lookup(T, ids).

    That is the vocab-parallel embedding, and the target-logit lookup of vocab-parallel cross
    entropy: each rank looks up the entries it owns along the lookup axis and zeroes the rest; the
    sum over ranks is the full lookup when the ranges tile the table (and the ids index it).
    """
    if r.full_value(when_true) != 0:
        return None
    lookup = r.u[when_false]
    if lookup.op == "view":  # where commutes with reshapes: mask the lookup before them
        inner = lookup.args[0]
        inner_shape = r.shape(inner)
        found = _masked_lookup(r, r.view(cond, inner_shape), r.view(when_true, inner_shape), inner)
        return None if found is None else r.view(found, lookup.shape)
    if lookup.op not in _LOOKUP_AXIS:
        return None
    table, index = lookup.args
    axis = _LOOKUP_AXIS[lookup.op](lookup.attrs)
    share = _share_lookup(r, table, index, axis, cond)
    if share is None:
        return None
    root, ids, lo, hi = share
    index_term = r.u[index]
    expanded = index_term.op == "bcast" and r.shape(index_term.args[0]) == r.shape(ids)
    whole_index = r.bcast(ids, index_term.shape, index_term.attrs[0]) if expanded else r.view(ids, index_term.shape)
    whole = r.build(lookup.op, (root, whole_index), lookup.attrs, lookup.shape, lookup.dtype)
    return r.piece(whole, ("lookup", axis, root, whole_index), lo, hi, r.shape(root)[axis])


def _share_lookup(r: Rules, table: int, index: int, axis: int, mask: int) -> tuple[int, int, int, int] | None:
    """(root, ids, lo, hi) when `table` is the [lo, hi) region of `root` along the lookup `axis`
    (whole elsewhere), `mask` is `ids outside [lo, hi)` and `index` is ids - lo wherever the mask is
    false: one rank's lookup into its shard of a vocab-parallel table."""
    root, box = r.as_region(table)
    if any(b != (0, s) for d, (b, s) in enumerate(zip(box, r.shape(root))) if d != axis):
        return None
    lo, hi = box[axis]
    outside_mask = _unshaped(r, mask)
    outside = _outside_range(r, outside_mask)
    if outside is None or outside[1:] != (lo, hi):
        return None
    ids, shifted = outside[0], _unshaped(r, index)
    assumed = {outside_mask: r.const(("full", False), r.shape(outside_mask), "bool")}
    if r.shape(ids) != r.shape(shifted) or not _is_shift_of(r, shifted, ids, lo, hi, assumed):
        return None
    return root, ids, lo, hi


def _unshaped(r: Rules, t: int) -> int:
    """`t` without the broadcasts and reshapes around it."""
    term = r.u[t]
    return _unshaped(r, term.args[0]) if term.op in ("bcast", "view") else t


def _unbroadcast(r: Rules, t: int) -> int:
    term = r.u[t]
    return term.args[0] if term.op == "bcast" else t


def _outside_range(r: Rules, mask: int) -> tuple[int, int, int] | None:
    """Recognize `ids < lo | ids >= hi` (in its usual spellings, perhaps reshaped) as (ids, lo, hi)."""
    term = r.u[mask]
    if term.op == "view":
        inner = _outside_range(r, term.args[0])
        return None if inner is None else (r.view(inner[0], term.shape), *inner[1:])
    if term.op == "logical_or" and len(term.args) == 2:
        bounds = [_compare_const(r, a) for a in term.args]
        if None in bounds:
            return None
        (x1, op1, v1), (x2, op2, v2) = bounds
        if x1 != x2:
            return None
        limits = {op1: v1, op2: v2}
        if "lt" in limits and "ge" in limits:
            return x1, int(limits["lt"]), int(limits["ge"])
    if term.op == "logical_not":
        inner = r.u[term.args[0]]
        if inner.op == "logical_and":
            bounds = [_compare_const(r, a) for a in inner.args]
            if None not in bounds and bounds[0][0] == bounds[1][0]:
                limits = {b[1]: b[2] for b in bounds}
                if "ge" in limits and "lt" in limits:
                    return bounds[0][0], int(limits["ge"]), int(limits["lt"])
    return None


def _compare_const(r: Rules, t: int) -> tuple[int, str, Any] | None:
    term = r.u[t]
    if term.op not in ("lt", "ge", "le", "gt") or len(term.args) != 2:
        return None
    value = r.full_value(term.args[1])
    if value is None:
        return None
    op = {"le": "lt", "gt": "ge"}.get(term.op, term.op)
    shift = 1 if term.op in ("le", "gt") else 0
    return term.args[0], op, value + shift


def _is_shift_of(r: Rules, shifted: int, ids: int, lo: int, hi: int, assumed: dict[int, int]) -> bool:
    """`shifted` is ids - lo wherever ids lies in [lo, hi) (with the terms of `assumed`, a mask
    testing that, replaced by their values there); an index clamped to the shard counts."""
    offset = r.literal("full", (), (-lo,), r.shape(ids), r.u[ids].dtype)
    local = r.view(r.lin([(ids, Fraction(1)), (offset, Fraction(1))]), r.shape(shifted))
    return rebuild(r, shifted, assumed, {ids: (Fraction(lo), Fraction(hi - 1))}) == local


def _shifted_ids(r: Rules, index: int, lo: int) -> int | None:
    """The ids of an index spelled ids - lo (perhaps clamped to the shard, perhaps reshaped)."""
    term = r.u[index]
    if term.op in ("bcast", "view"):
        return _shifted_ids(r, term.args[0], lo)
    if term.op in ("maximum", "minimum"):
        varying = [a for a in term.args if r.full_value(a) is None]
        return _shifted_ids(r, varying[0], lo) if len(varying) == 1 else None
    if term.op == "lin" and len(term.args) == 2:
        for (t, c), (k, kc) in itertools.permutations(zip(term.args, term.attrs[0])):
            if c == 1 and r.full_value(k) is not None and r.full_value(k) * kc == -lo:
                return t
    return index if lo == 0 else None  # ids - 0 is ids


def _exp(r: Rules, args, attrs, shape, dtype) -> int:
    """exp(a - log b) = exp(a) / b (and exp(a + log b) = exp(a) * b): the exp of a log-softmax (its
    backward takes one) is the softmax exp(x - m) / sum(exp(x - m)) a vocab-parallel loss spells."""
    term = r.u[args[0]]
    if term.op == "lin":
        for i, (t, c) in enumerate(zip(term.args, term.attrs[0])):
            inner = r.u[_unbroadcast(r, t)]
            if c in (1, -1) and inner.op == "log":
                base = inner.args[0] if t == _unbroadcast(r, t) else r.bcast(inner.args[0], shape, r.u[t].attrs[0])
                rest = r.lin([(a, k) for j, (a, k) in enumerate(zip(term.args, term.attrs[0])) if j != i])
                power = r.build("exp", (rest,), attrs, shape, dtype)
                return r.build("div" if c == -1 else "mul", (power, base), (), shape, dtype)
    return _elementwise(r, "exp", args, attrs, shape, dtype)


def _scatter(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """Writes of one entry per row along `dim` (the index has size 1 there). Normal form: a one-hot
    scatter_add(0, dim, index, values). A write into x is x plus the one-hot of the change; a rank's
    one-hot of the ids in its range [lo, hi) is the [lo, hi) slice of the one-hot over the axis."""
    base, index, src = args
    (dim,) = attrs
    if r.shape(index)[dim] != 1:
        return r.literal(op, args, attrs, shape, dtype)
    zeros = r.literal("full", (), (0.0 if dtype in FLOAT_DTYPES else 0,), shape, dtype)
    if r.full_value(base) != 0:
        change = src
        if op == "scatter":
            here = r.build("gather", (base, index), attrs, r.shape(index), dtype)
            change = r.lin([(src, Fraction(1)), (here, Fraction(-1))])
        one_hot = r.build("scatter_add", (zeros, index, change), attrs, shape, dtype)
        return r.lin([(base, Fraction(1)), (one_hot, Fraction(1))])
    if r.full_value(src) == 0:
        return zeros
    values, constant = r.u[src], r.full_value(src)
    if values.op == "lin" and len(values.args) == 1:  # linear in the values: scale outside
        return r.scale(r.build("scatter_add", (zeros, index, values.args[0]), attrs, shape, dtype), values.attrs[0][0])
    if _is_finite_number(constant) and constant != 1 and dtype in FLOAT_DTYPES:
        ones = r.literal("full", (), (1.0,), r.shape(src), dtype)
        return r.scale(r.build("scatter_add", (zeros, index, ones), attrs, shape, dtype), constant)
    local = _local_one_hot(r, index, src, dim, shape, dtype)
    if local is not None:
        return local
    if r.reference_size is None:
        r.reference_one_hots.setdefault((dim, index), set()).add(shape[dim])
    return r.literal("scatter_add", (zeros, index, src), attrs, shape, dtype)


def _local_one_hot(r: Rules, index: int, src: int, dim: int, shape, dtype) -> int | None:
    """scatter_add(0, dim, I, S) on a rank owning [lo, hi) of the axis, where S is zero for ids
    outside [lo, hi) and I is ids - lo inside it: the [lo, hi) slice of scatter_add(0, dim, ids, S')
    with S' the values inside, over the axis width the reference wrote such a one-hot with. In the
    reference, [lo, hi) covering the whole axis (the same masked code run on one rank) gives that
    one-hot itself: ids outside the axis write nothing either way."""
    for mask, (ids, lo, hi, outside) in _range_masks(r, src):
        if hi - lo != shape[dim] or r.u[ids].shape and math.prod(r.shape(ids)) != math.prod(r.shape(index)):
            continue
        true, false = (r.const(("full", v), r.shape(mask), "bool") for v in (True, False))
        inside, beyond = (false, true) if outside else (true, false)
        if r.full_value(rebuild(r, src, {mask: beyond}, {})) != 0 or not _is_shift_of(r, index, ids, lo, hi, {mask: inside}):
            continue
        whole_index = r.view(ids, r.shape(index))
        if (lo, hi) == (0, shape[dim]) and r.reference_size is None:
            widths = [hi]
        else:
            widths = sorted(w for w in r.reference_one_hots.get((dim, whole_index), ()) if w >= hi)
        if not widths:
            continue
        whole_shape = tuple(widths[0] if d == dim else n for d, n in enumerate(shape))
        zeros = r.literal("full", (), (0.0 if dtype in FLOAT_DTYPES else 0,), whole_shape, dtype)
        values = rebuild(r, src, {mask: inside}, {})
        whole = r.build("scatter_add", (zeros, whole_index, values), (dim,), whole_shape, dtype)
        return r.slice(whole, tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(shape)))
    return None


def _range_masks(r: Rules, t: int) -> list[tuple[int, tuple[int, int, int, bool]]]:
    """The boolean terms inside `t` that test ids against a range: (mask, (ids, lo, hi, outside)),
    outside True for `ids < lo | ids >= hi`, False for `lo <= ids < hi`."""
    found, seen, stack = [], set(), [t]
    while stack:
        x = stack.pop()
        if x in seen:
            continue
        seen.add(x)
        term = r.u[x]
        if term.dtype == "bool":
            beyond = _outside_range(r, x)
            within = _inside_range(r, x)
            if beyond is not None:
                found.append((x, (*beyond, True)))
            elif within is not None:
                found.append((x, (*within, False)))
        stack.extend(term.args)
    return found


def _inside_range(r: Rules, mask: int) -> tuple[int, int, int] | None:
    """Recognize `ids >= lo & ids < hi` (perhaps reshaped) as (ids, lo, hi)."""
    term = r.u[mask]
    if term.op == "view":
        inner = _inside_range(r, term.args[0])
        return None if inner is None else (r.view(inner[0], term.shape), *inner[1:])
    if term.op != "logical_and" or len(term.args) != 2:
        return None
    bounds = [_compare_const(r, a) for a in term.args]
    if None in bounds or bounds[0][0] != bounds[1][0]:
        return None
    limits = {b[1]: b[2] for b in bounds}
    if "ge" in limits and "lt" in limits:
        return bounds[0][0], int(limits["ge"]), int(limits["lt"])
    return None


def _keep_literal(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    return r.literal(op, args, attrs, shape, dtype)


# --- boolean masks ------------------------------------------------------------------------------
def _times_mask(r: Rules, args: tuple[int, int], shape, dtype) -> int | None:
    """x * mask (a bool mask times numbers) is where(not mask, 0, x): the masked-out form the
    vocab-parallel lookup rule reads, as vLLM spells its shifted ids `mask * (ids - offset)`."""
    for i, a in enumerate(args):
        if r.u[a].dtype == "bool" and dtype != "bool":
            other = args[1 - i]
            zero = r.const(("full", 0), shape, dtype)
            return r.build("where", (r.build("logical_not", (a,), (), shape, "bool"), zero, other), (), shape, dtype)
    return None


def _assuming(r: Rules, t: int, cond: int, value: bool) -> int:
    """`t` where it is read, when `cond` has `value` there: where(cond, a, b) inside t (through
    sums) is a or b. So ids - where(outside, 0, start) in the inside branch is ids - start."""
    term = r.u[t]
    if term.op == "where" and term.args[0] == cond:
        return term.args[1] if value else term.args[2]
    if term.op == "lin" and any(r.op(a) == "where" for a in term.args):
        return r.lin([(_assuming(r, a, cond, value), c) for a, c in zip(term.args, term.attrs[0])])
    return t


def _logical(r: Rules, op: str, args, attrs, shape, dtype) -> int:
    """and/or/not with a known operand fold; not(not m) is m; `x >= a and x < b` with a >= b is
    the empty range (vLLM's added-vocabulary mask when nothing was added)."""
    if op == "logical_not":
        inner = r.u[args[0]]
        if inner.op == "logical_not":
            return inner.args[0]
        known = r.full_value(args[0])
        if isinstance(known, bool):
            return r.const(("full", not known), shape, "bool")
        return _elementwise(r, op, args, attrs, shape, dtype)
    absorbing = op == "logical_or"  # or(m, True) is True; and(m, False) is False
    for i, a in enumerate(args):
        known = r.full_value(a)
        if isinstance(known, bool):
            return r.const(("full", absorbing), shape, "bool") if known == absorbing else args[1 - i]
    if op == "logical_and" and _empty_range(r, args):
        return r.const(("full", False), shape, "bool")
    return _elementwise(r, op, args, attrs, shape, dtype)


def _empty_range(r: Rules, args: tuple[int, ...]) -> bool:
    bounds = [_compare_const(r, a) for a in args]
    if None in bounds or bounds[0][0] != bounds[1][0]:
        return False
    limits = {op: value for _, op, value in bounds}
    return "ge" in limits and "lt" in limits and limits["ge"] >= limits["lt"]


_BY_OP: dict[str, Callable[..., int]] = {
    "add": _add,
    "mul": _mul,
    "div": _div,
    "log": _log,
    "exp": _exp,
    "log_softmax": _log_softmax,
    **{op: lambda r, args, attrs, shape, dtype, op=op: _logical(r, op, args, attrs, shape, dtype) for op in ("logical_and", "logical_or", "logical_not")},
}
_BY_KIND: dict[str, Callable[..., int]] = {
    "unary": _unary,
    "binary": _elementwise,
    "compare": _elementwise,
    "where": _where,
    "layout": _layout,
    "reduce": _reduce,
    "softmax": _softmax,
    "matmul": _matmul,
    "embedding": _embedding,
    "gather": _gather,
    "scatter": _scatter,
    "mask": _keep_literal,
}
