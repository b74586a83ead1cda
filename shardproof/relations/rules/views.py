"""Reshapes: the constructor of views, which moves a reshape through slices, concatenations,
broadcasts, permutes and batched matmuls so that layouts reaching one value by different reshapes
meet. A part of `Rules`, kept apart for its size: it reaches the other constructors through `self`.
"""

from __future__ import annotations

import math
from fractions import Fraction

from shardproof.relations.layout import Box, box_shape, cut_to_one_index, dst_ones_ahead, full_box, reshape_groups, view_of_box
from shardproof.relations.rules.values import PARTS


class ViewRules:
    """The `view` constructor of `Rules`."""

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
        if term.op == "cat":
            unbroadcast = self._cat_without_broadcast_ones(x, shape)
            if unbroadcast is not None:
                return unbroadcast
            factored = self._cat_factored(x)
            if factored is not None:
                return self.scale(self.view(factored[0], shape), factored[1])
        if term.op == "bcast":
            moved = self._view_bcast(x, shape)
            if moved is not None:
                return moved
            if _reshaped_from(term) is not None:
                # a broadcast that only inserts size-1 dims is a reshape too, one that the groups
                # above may not follow: a rank's slice given a new axis to all-gather along, then
                # flattened with it
                return self.view(term.args[0], shape)
        if term.op == "repeat":
            unrepeated = self._view_repeat(x, shape)
            if unrepeated is not None:
                return unrepeated
        if term.op == "slice" and self.u[term.args[0]].op == "permute":
            moved = self._view_sliced_permute(x, shape, reorder=self._block_moved_behind(x))
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
            if found is None and term.op == "slice" and self.u[root].op == "permute":
                found = self._view_sliced_permute(x, shape, reorder=True)
            if found is None and term.op == "slice":
                found = self._view_inner_slice(root, region, shape)
            if found is not None:
                return found
        inserted = _inserted_ones(term.shape, shape)
        if inserted is not None:
            restored = self._restore_ones(x, shape)
            return restored if restored is not None else self.bcast(x, shape, inserted)
        if term.op == "cat":
            moved = self._view_cat(x, shape)
            if moved is not None:
                return moved
        if term.op == "permute":
            moved = self._view_permute(x, shape)
            if moved is not None:
                return moved
        if term.op == "matmul" and len(self.shape(term.args[1])) == 2 and shape[-1] == term.shape[-1] and (
            len(term.shape) == 2 or _regroups(term.shape, shape)
        ):
            # a batched product's rows reshaped (a router's flatten) reshape its operand; one that only
            # drops or adds size-1 dims stays outside, the form a batch of one's layout rules meet
            rows, inner = term.args
            lifted = self.view(rows, shape[:-1] + self.shape(rows)[-1:])
            return self.build("matmul", (lifted, inner), term.attrs, shape, term.dtype)
        if term.op == "matmul" and len(self.shape(term.args[1])) == 2 and shape[-1] == term.shape[-1]:
            # the rows' own reshape undone (einsum's unsqueeze before its bmm, squeezed after): the
            # product of the rows as they were (equal counts of rows and elements: equal last dims)
            rows, inner = term.args
            before = _reshaped_from(self.u[rows])
            if before is not None and self.shape(before)[:-1] == shape[:-1]:
                return self.build("matmul", (before, inner), term.attrs, shape, term.dtype)
        if term.op == "matmul" and len(term.shape) > 2 and len(shape) > 2 and shape[-2:] == term.shape[-2:]:
            regrouped = self._view_matmul_batch(x, shape)
            if regrouped is not None:
                return regrouped
        batch = _batch_regrouped(term.shape, shape) if term.op == "matmul" and len(term.shape) > 2 else None
        if batch is not None and batch != term.shape[:-2]:  # the same batch: the ones only dropped
            # the batch regrouped and size-1 dims put among the matrix dims (einsum unflattens its
            # bmm's batch with a one for each dim it contracted): the regrouped product, the ones added after
            regrouped = self._view_matmul_batch(x, batch + term.shape[-2:])
            if regrouped is not None:
                return self.view(regrouped, shape)
        return self.literal("view", (x,), (), shape, term.dtype)

    def _cat_factored(self, x: int) -> tuple[int, Fraction] | None:
        """(Y, c) with cat(parts) = c * Y, c != 1 the largest rational dividing the parts' common
        factors (zeros aside), as `common_factor` takes it of a sum: a reshape that does not keep the
        cat loses the parts' scales into its view, where a rank's microbatch rows (scaled by its share
        of the batch) no longer meet the reference's (scaled by the whole batch); a scale outside the
        view meets it by the factor between them."""
        term = self.u[x]
        factors = [self.common_factor(p)[1] for p in term.args if self.full_value(p) != 0]
        if not factors:
            return None
        c = Fraction(math.gcd(*(k.numerator for k in factors)), math.lcm(*(k.denominator for k in factors)))
        if c == 1:
            return None
        return self.cat([self.scale(p, 1 / c) for p in term.args], term.attrs[0]), c

    def _cat_without_broadcast_ones(self, x: int, shape: tuple[int, ...]) -> int | None:
        """view(cat(parts)) that only drops size-1 dims every part merely broadcasts into (not the
        cat dim): the cat of the parts viewed without them. Such a dim holds no layout of any part, so
        a cat of columns kept one row deep (a rank's gate gradients an all_to_all returned per
        peer) meets the reference's cat of those columns, each part's scale staying inside it."""
        term = self.u[x]
        dim = term.attrs[0]
        kept = _inserted_ones(shape, term.shape)
        dropped = set(range(len(term.shape))) - set(kept or ())
        if not kept or dim in dropped or not all(self._broadcast_along(p, dropped) for p in term.args):
            return None
        parts = [self.view(p, tuple(self.shape(p)[d] for d in kept)) for p in term.args]
        return self.cat(parts, kept.index(dim))

    def _broadcast_along(self, t: int, dims: set[int]) -> bool:
        """`t` is a broadcast along `dims` (a constant, or sums of such broadcasts)."""
        term = self.u[t]
        if term.op in ("lin", "piece"):
            return all(self._broadcast_along(a, dims) for a in term.args)
        return term.op == "full" or (term.op == "bcast" and not dims & set(term.attrs[0]))

    def _view_cat(self, x: int, shape: tuple[int, ...]) -> int | None:
        """A reshape that merges the cat dim of one-row-deep parts with the next dim reshapes
        their cat along that next dim. A reshape that merges or splits other dims and leaves the
        cat dim alone (its own group) reshapes each part the same way. Reshapes that only add or
        drop size-1 dims stay outside: broadcasts carry those."""
        term = self.u[x]
        dim = term.attrs[0]
        groups = reshape_groups(term.shape, shape) or []
        if any(dim in src and dim + 1 in src for src, _ in groups) and all(self.shape(p)[dim] == 1 for p in term.args):
            # parts one row deep stacked along `dim` lie in memory as the parts joined along the next dim
            # (a batch of one all-gathered on dim 0, then flattened with the sequence it shards)
            return self.view(self.cat(list(term.args), dim + 1), shape)
        if all(len(src) <= 1 and len(dst) <= 1 for src, dst in groups):
            return None
        return self._cat_of_views(x, shape)

    def _cat_of_views(self, x: int, shape: tuple[int, ...]) -> int | None:
        """view(cat(parts), shape) as the cat of the parts viewed alike, when the reshape leaves
        the cat dim alone (its own group) or splits it into one outer row per part (ranks' equal
        blocks stacked flat, viewed (ranks, rows, ...)); None otherwise. Parts spanning several
        outer rows stay a view of the cat: a rank's [q | k | v] rows read as per-group blocks is
        then wrong at that view, where the diagnosis names it."""
        term = self.u[x]
        dim = term.attrs[0]
        alone = [dst for src, dst in reshape_groups(term.shape, shape) or [] if src == [dim] and dst]
        if not alone:
            return None
        out_dim, inner = alone[0][0], math.prod(shape[d] for d in alone[0][1:])
        if len(alone[0]) > 1 and any(self.shape(p)[dim] != inner for p in term.args):
            return None
        parts = []
        for p in term.args:
            part_shape = tuple(self.shape(p)[dim] // inner if d == out_dim else s for d, s in enumerate(shape))
            parts.append(self.view(p, part_shape))
        return self.cat(parts, out_dim)

    def exposed_cat(self, x: int) -> int | None:
        """`x` as a cat (or None) when it is one seen through permutes, broadcasts and reshapes that
        keep the cat dim whole: in normal form, reshapes that only add or drop size-1 dims, which
        `_view_cat` leaves outside the cat. Products split by the parts of such an operand as by a
        cat's, so a batch of one flattened for a weight gradient splits like a larger batch,
        whose flattening distributes over the cat."""
        term = self.u[x]
        if term.op == "cat":
            return x
        inner = self.exposed_cat(term.args[0]) if term.op in ("permute", "view", "bcast") else None
        if inner is None:
            return None
        if term.op == "permute":
            found = self.permute(inner, term.attrs[0])
        elif term.op == "bcast":
            found = self._cat_of_bcasts(inner, term.shape, term.attrs[0])
        else:
            found = self._cat_of_views(inner, term.shape)
        return found if found is not None and self.op(found) == "cat" else None  # joined parts: no cat

    def _cat_of_bcasts(self, x: int, shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
        """bcast(cat(parts), shape) as the cat of the parts broadcast alike: the cat dim is one of
        the base's own dims, which a broadcast only places (a fused gradient broadcast over the
        experts of a grouped product, which products split by its parts)."""
        term = self.u[x]
        out_dim = dims[term.attrs[0]]
        parts = [self.bcast(p, shape[:out_dim] + (self.shape(p)[term.attrs[0]],) + shape[out_dim + 1 :], dims) for p in term.args]
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
        plain = view_of_box(self.shape(root), region, shape)
        for flag in ("ones_split", "ones_last") if self.reference_size is not None else ():
            other = view_of_box(self.shape(root), region, shape, **{flag: True})
            if other is not None and other != plain:
                whole = self.view(root, other[0])  # built in the reference run it would count as the reference's
                if self.in_reference(whole):
                    return self.slice(whole, other[1])
        if plain is None:
            return None
        whole = self.view(root, plain[0])
        undoes = self.op(root) == "view" and whole == self.u[root].args[0]
        if (self.reference_size is not None and not undoes and not self.in_reference(whole)
                and _drops_selected_row(self.shape(root), region, shape)):
            # a rank's one head merged as the outer factor of the dims after it is a column range of
            # a flattening the reference never makes; held apart, it meets the reference's own
            # merge of those heads with another dim (Megatron's (s, b, heads, d) -> (s, b * heads, d)).
            # A reshape back to the very tensor `root` was flattened from (a flat buffer's row read
            # back in its tensor's shape) makes none: its rows are that tensor's. Only that: a view
            # whose normal form is another op (a broadcast adding ones, a permute) is still new
            held = self._view_inner_slice(root, region, shape)
            if held is not None:
                return held
        return self.slice(whole, plain[1])

    def _view_inner_slice(self, root: int, region: Box, shape: tuple[int, ...]) -> int | None:
        """view(X[box]) where the box restricts a dim that the reshape merges under an outer one
        (the v columns [64:96] of fused per-head qkv, merged with the heads; or merged under a
        selected row the reshape drops, a rank's one head) or drops (one column of a strided slice's
        grid): no box of a view of X is that, so X sliced on those inner dims alone stays a tensor of its own, Y, and the
        rest of the box (a rank's heads) is a box of view(Y). The reference slices the same Y."""
        root_shape = self.shape(root)
        groups = reshape_groups(box_shape(region), shape)
        if groups is None:
            return None
        inner: set[int] = set()
        rows: list[int] = []  # selected rows the reshape drops, not yet placed
        for gi, gj in groups:
            sliced = [d for d in gi if region[d] != (0, root_shape[d])]
            if gi and not gj:
                rows += sliced
            elif gi:
                # rows right before a sliced group are its outer factor where the reference slices
                # that group alone (one head of fused qkv's v columns, flattened); elsewhere, and
                # before a whole group, they are held apart: one-wide columns dropped, or a batch of
                # one's row whose heads are a range (XLA drops a data-parallel rank's batch of one)
                outer_factor = rows and sliced and _box_on(root_shape, region, sliced) in self.reference_boxes.get(root, ())
                inner |= set(sliced) if outer_factor else {*rows, *(d for d in sliced if d != gi[0])}
                rows = []
        inner |= set(rows)
        if not inner:
            return None
        inner_box = tuple(region[d] if d in inner else (0, s) for d, s in enumerate(root_shape))
        held = self.literal("slice", (root,), (inner_box,), box_shape(inner_box), self.u[root].dtype)
        outer_box = tuple((0, hi - lo) if d in inner else (lo, hi) for d, (lo, hi) in enumerate(region))
        if outer_box == full_box(self.shape(held)):
            return self.literal("view", (held,), (), shape, self.u[root].dtype)
        return self._view_region(held, outer_box, shape)

    def _restore_ones(self, x: int, shape: tuple[int, ...]) -> int | None:
        """view(x, shape), where `shape` only adds size-1 dims to x's, as a term that restores dims a
        reshape inside x dropped: a dropped view of S with as many size-1 dims as `shape` is a
        permute of S (size-1 dims are interchangeable); permutes and batched products carry the
        ones through. So a rank's one head, dropped for a batched product and added back after
        it, is again the head it sliced. None where x restores nothing (a broadcast then)."""
        term = self.u[x]
        ones = shape.count(1)
        if term.op == "view":
            source = self.shape(term.args[0])
            if _without_ones(source) != _without_ones(term.shape) or source.count(1) != ones:
                return None
            return self.permute(term.args[0], _onto(source, range(len(source)), shape))
        if term.op == "permute":
            # the ones go into the permute's operand right after the dim they follow in `shape`
            inner, perm = self.shape(term.args[0]), term.attrs[0]
            sources = iter(perm[d] for d in range(len(perm)) if term.shape[d] != 1)  # operand dims of shape's non-ones
            follows: dict[int, int] = {}  # operand dim (-1: none) -> the ones of `shape` right after it
            last = -1
            for size in shape:
                if size == 1:
                    follows[last] = follows.get(last, 0) + 1
                else:
                    last = next(sources)
            layout, position = [1] * follows.get(-1, 0), {}
            for d, size in enumerate(inner):
                if size != 1:
                    position[d] = len(layout)
                    layout += [size] + [1] * follows.get(d, 0)
            restored = self._restored(term.args[0], tuple(layout))
            if restored is None:
                return None
            order = [position[d] for d in perm if inner[d] != 1]
            return self.permute(restored, _onto(tuple(layout), order, shape))
        if term.op == "matmul" and len(term.shape) > 2 and shape[-2:] == term.shape[-2:]:
            operands = []
            for a in term.args:
                a_shape = self.shape(a)
                if a_shape[:-2] != term.shape[:-2]:
                    return None  # an operand broadcast over the batch
                found = self._restored(a, shape[:-2] + a_shape[-2:])
                if found is None:
                    return None
                operands.append(found)
            return self.build("matmul", tuple(operands), term.attrs, shape, term.dtype)
        return None

    def _restored(self, x: int, shape: tuple[int, ...]) -> int | None:
        """`_restore_ones` of x, through the other constructors (elementwise ops map it over their
        operands) where x is not one of the terms it reads."""
        if self.u[x].op in ("view", "permute", "matmul"):
            return self._restore_ones(x, shape)
        found = self.view(x, shape)
        return None if self.u[found].op == "bcast" else found

    def _view_sliced_permute(self, x: int, shape: tuple[int, ...], reorder: bool) -> int | None:
        """view(permute(Y, p)[box]) that drops exactly the dims the box cuts to one index, where Y
        splits a dim into blocks: the permute of Y's box with those dims dropped. Where the permute
        keeps the other dims in order it is a region of what Y splits (a rank's block of tokens or
        heads moved ahead for an all_to_all, then dropped: Ulysses' switch), taken before any other
        view law. Where it reorders them (one entry of each interleaved rotary pair of heads moved
        ahead), it is asked for only when no region of the slice's operand is found: a rank's box
        of a transposed product's rows is better read as that region (JAX's 2-D mesh attention)."""
        term = self.u[x]
        permuted = self.u[term.args[0]]
        if self.op(permuted.args[0]) != "view":  # blocks of a dim the program split, not dims of their own
            return None
        perm, box = permuted.attrs[0], term.attrs[0]
        cut = cut_to_one_index(box, permuted.shape)
        if not cut or shape != tuple(n for d, n in enumerate(term.shape) if d not in cut):
            return None
        inner_box: list[tuple[int, int]] = [(0, 0)] * len(perm)
        for d, p in enumerate(perm):
            inner_box[p] = box[d]
        dropped = {perm[d] for d in cut}
        kept = [p for p in range(len(perm)) if p not in dropped]
        order = tuple(kept.index(p) for p in perm if p not in dropped)
        if not reorder and order != tuple(range(len(order))):
            return None
        sliced = self.slice(permuted.args[0], tuple(inner_box))
        return self.permute(self.view(sliced, tuple(box_shape(tuple(inner_box))[p] for p in kept)), order)

    def _block_moved_behind(self, x: int) -> bool:
        """x = permute(Y, p)[box] with Y = view(Z) splitting Z's dims into blocks, where every dim
        the box cuts to one index is the block index of such a split (Y's outer factor) and the
        permute moves another factor of that split ahead of it (Ulysses' rank block of heads, its
        heads per rank moved ahead of the sequence): the block is a range of Z's dim with its
        factors reordered, which no region of a view of the permute meets, so the reordering law
        is asked for first. A cut dim Y keeps whole (a data-parallel batch row) or a split whose
        factors keep their order (Megatron's one head per rank) is left to the region laws."""
        permuted = self.u[self.u[x].args[0]]
        y = permuted.args[0]
        if self.op(y) != "view":
            return False
        perm, box = permuted.attrs[0], self.u[x].attrs[0]
        groups = reshape_groups(self.shape(self.u[y].args[0]), self.shape(y)) or []
        splits = {gj[0]: gj[1:] for gi, gj in groups if len(gi) == 1 and len(gj) > 1}
        cut = [perm[d] for d in cut_to_one_index(box, permuted.shape)]
        where = {p: d for d, p in enumerate(perm)}
        return bool(cut) and all(c in splits and any(where[f] < where[c] for f in splits[c]) for c in cut)

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

    def _view_repeat(self, x: int, shape: tuple[int, ...]) -> int | None:
        """repeat(X, d, k) reshaped so that dim d splits into (X's size, k) is X broadcast along the
        new k-sized dim: row a * k + b is row a of X (a broadcast key flattened into a batch of
        heads for bmm, put back into its heads)."""
        term = self.u[x]
        d, times = term.attrs
        inner = term.args[0]
        groups = reshape_groups(term.shape, shape)
        split = next((gj for gi, gj in groups or () if gi == [d]), None)
        if split is None or len(split) != 2 or (shape[split[0]], shape[split[1]]) != (self.shape(inner)[d], times):
            return None
        kept = tuple(j for j in range(len(shape)) if j != split[1])
        return self.bcast(self.view(inner, tuple(shape[j] for j in kept)), shape, kept)

    def _view_bcast(self, x: int, shape: tuple[int, ...]) -> int | None:
        """Reshape a broadcast group by group. Groups of kept dims reshape the base (taking a
        size-1 dim just before them along); a kept dim merged with broadcast dims after it, or a
        kept size-1 dim followed by broadcast dims merged into one, is a repeat (GQA's repeat_kv);
        other size-1 dims pair up in order, broadcast ones dropped before the base's own."""
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
        ahead = dst_ones_ahead(groups)
        for g, (gi, gj) in enumerate(groups):
            if not gi:
                pending = _paired_ones(pending, kept, ahead[g])
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
            mine = [d for d in gi if d in kept]
            if kept & set(pending) and mine != gi:  # kept size-1 dims before kept dims: the base drops them
                return None
            pending.clear()
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


def _box_on(shape: tuple[int, ...], region: Box, dims: list[int]) -> Box:
    """The box restricting only `dims` as `region` does."""
    return tuple(region[d] if d in dims else (0, n) for d, n in enumerate(shape))


def _paired_ones(pending: list[int], kept: set[int], room: int) -> list[int]:
    """The size-1 source dims of a run that pair with its `room` size-1 destination dims. Where
    more are dropped than added, the broadcast ones go first and the base keeps its own: one kv
    head's gradient at a batch of one, summed over its query heads, (1, 1, 1, s, d) ->
    (1, 1, s, d), stays that head of the reference's (1, kv_heads, s, d)."""
    surplus = len(pending) - room
    if surplus <= 0:
        return pending
    dropped = sorted(pending, key=lambda d: d in kept)[:surplus]
    return [d for d in pending if d not in dropped]


def _reshaped_from(term) -> int | None:
    """The term that `term` reshapes (a view, or a broadcast that only adds size-1 dims), if any."""
    if term.op == "view":
        return term.args[0]
    if term.op == "bcast" and all(n == 1 for d, n in enumerate(term.shape) if d not in term.attrs[0]):
        return term.args[0]
    return None


def _regroups(src: tuple[int, ...], dst: tuple[int, ...]) -> bool:
    """The reshape merges or splits dims, beyond adding or dropping size-1 ones."""
    return [n for n in src if n != 1] != [n for n in dst if n != 1]


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


def _batch_regrouped(product: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The batch dims of `shape`, when reshaping a `product`-shaped batched product to it regroups
    only the batch and adds size-1 dims among or after the matrix dims (None otherwise, and where
    `shape` adds no such dims, `_view_matmul_batch`'s case, and for a batch of ones, whose reshapes
    the layout rules of a batch of one meet)."""
    count, size = 0, 1
    while count < len(shape) and size < math.prod(product[:-2]):
        size *= shape[count]
        count += 1
    rest = shape[count:]
    if not count or size != math.prod(product[:-2]) or len(rest) == 2 or _without_ones(rest) != _without_ones(product[-2:]):
        return None
    return shape[:count]


def _without_ones(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The sizes of `shape` but its size-1 dims, which views add and drop freely."""
    return tuple(s for s in shape if s != 1)


def _onto(source: tuple[int, ...], order, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The permutation of a `source`-shaped tensor to `shape` (equal but for where size-1 dims
    sit) that puts source's non-one dims, taken in `order`, where `shape`'s non-one dims are."""
    kept = iter(d for d in order if source[d] != 1)
    ones = iter(d for d in range(len(source)) if source[d] == 1)
    return tuple(next(ones) if size == 1 else next(kept) for size in shape)


def _drops_selected_row(root_shape: tuple[int, ...], region: Box, shape: tuple[int, ...]) -> bool:
    """Whether reshaping `region` of a `root_shape` tensor to `shape` drops one selected row of a
    longer dim (a rank's one head), which a plain reading folds into the dims after it."""
    groups = reshape_groups(box_shape(region), shape) or []
    return any(gi and not gj and root_shape[gi[0]] > 1 for gi, gj in groups)
