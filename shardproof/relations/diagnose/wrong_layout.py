"""Wrong layout: shards joined along another axis than they were split on, a reshape that mixes
axes, or an operand that is the wrong region of the reference's, traced back to the op that cut
it. A part of `Diagnoser`.
"""

from __future__ import annotations

from shardproof.ir.graph import Node
from shardproof.ir.ops import OPS
from shardproof.relations.diagnose.agreement import LAYOUT_OPS
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.layout import reshape_groups
from shardproof.relations.rules.topk import POSITIONS, call_of
from shardproof.report.terms import describe, line_of, region, value_name


_REDUCTIONS = ("sum", "amax", "argmax")  # over dims attrs[0], keepdim attrs[1]


class LayoutFaults:
    """Operands holding the wrong data, or the right data in the wrong layout."""

    def _misassembled_input(self, rank: int, node: Node) -> Finding | None:
        """An operand that concatenates shards along another dim than they were split on."""
        for i in node.inputs:
            found = self._wrong_axis_finding(rank, self.ranks[rank][i])
            if found is not None:
                found.distributed.append((rank, node))
                return found
        return None

    def _reduced_across(self, rank: int, chain: list[Node]) -> Finding | None:
        """A reduction of the ranks' partial results, joined along one dim (gathered, stacked), that
        reduces along another: it never combines them (the best of each rank's candidates picked
        over tokens instead of over ranks). Found at the reduction."""
        terms = self.run.ranks[rank]
        for node in chain:
            if node.op not in _REDUCTIONS:
                continue
            rank_of_input = len(self.ranks[rank][node.inputs[0]].shape)
            dims = {d % rank_of_input for d in node.attrs[0]}
            joined = self._joined_partials(terms[node.inputs[0]])
            if joined is None or joined in dims:
                continue
            value = value_name(self.ranks[rank][node.inputs[0]])
            return Finding(
                "discrepancy",
                "wrong reduce dim",
                f"wrong reduce dim: `{node.op}` reduces {value} along dim {sorted(dims)}, but {value} joins the ranks' "
                f"partial results along dim {joined}: they are never combined",
                [(rank, node)],
                op=node.op,
                fix=f"reduce along dim {joined}, the dim the ranks' parts are joined along, at {line_of(node)}",
            )
        return None

    def _joined_partials(self, t: int) -> int | None:
        """The dim along which `t` joins partial results (pieces of a sum or max over ranks), each
        part possibly reshaped (a dim inserted to stack them)."""
        term = self.r.u[t]
        if term.op == "view" and self.r.u[term.args[0]].op == "cat":
            return None  # a flat buffer viewed: which dim joins is not read off here
        if term.op != "cat" or len(term.args) < 2:
            return None
        parts = [self.r.u[a].args[0] if self.r.u[a].op == "view" else a for a in term.args]
        return term.attrs[0] if all(self.partial(a) for a in parts) else None

    def _wrong_axis_finding(self, rank: int, node: Node) -> Finding | None:
        axes = self._wrong_axis(self.run.ranks[rank][node.id])
        if axes is None:
            return None
        return Finding(
            "discrepancy",
            "wrong axis",
            f"wrong layout (wrong axis): shards split along dim {axes[1]} are concatenated along dim {axes[0]}",
            [(rank, node)],
            fix=f"concatenate along dim {axes[1]}, the dim the shards were split on, at {line_of(node)}",
        )

    def _misplaced_positions(self, rank: int, chain: list[Node]) -> Finding | None:
        """Positions of a rank's largest values over its shard of an axis (an argmax or top k over
        the shard plus an offset) shifted by another offset than the shard's start, where they are
        gathered at the argmax of the ranks' maxes (greedy sampling) or the top k of their top
        values (top-k sampling): found at the op that computes them before the
        collectives and layout ops that stack them. Every rank diverges at the pick; the shift may
        be on another (rank 0's shard starts at 0)."""
        for other in sorted(range(len(self.ranks)), key=lambda r: r != rank):
            graph, terms, end = self.ranks[other], self.run.ranks[other], self.counterpart(other, chain[-1])
            if end is None:
                continue
            picks = [n for n in graph.ancestors(end) if n.op == "gather" and self._picks_largest(other, n)]
            for node in sorted({source.id: source for pick in picks for source in self._stacked_from(other, pick)}.values(),
                               key=lambda n: n.id):
                shift = self._position_shift(terms[node.id])
                if shift is not None:
                    dim, lo, hi, by = shift
                    return Finding(
                        "discrepancy",
                        "wrong layout",
                        f"wrong layout: rank {other} holds dim {dim}'s indices [{lo}:{hi}) and adds {lo + by} to the positions "
                        f"of its largest values, where its shard starts at {lo}: the picked positions are off by {by}",
                        [(other, node)],
                        fix=f"add the shard's start, {lo} on rank {other} (rank * its shard size), to {value_name(node)} at "
                            f"{line_of(node)}",
                    )
        return None

    def _picks_largest(self, rank: int, gather: Node) -> bool:
        """Whether `gather` reads at the argmax of something (over a stack of one rank: position 0)
        or at the positions of a top k."""
        t = self.run.ranks[rank][gather.inputs[1]]
        index = self.r.u[t]
        top = call_of(self.r, t)
        return ("argmax" in (index.op, self.r.u[index.args[0]].op if index.args else None) or self.r.full_value(t) == 0
                or (top is not None and top.path == POSITIONS))

    def _stacked_from(self, rank: int, gather: Node) -> list[Node]:
        """The ops whose values the table of `gather` stacks: reached through layout ops and
        collectives only."""
        graph, found, stack, seen = self.ranks[rank], [], [gather.inputs[0]], set()
        while stack:
            node = graph[stack.pop()]
            if node.id in seen:
                continue
            seen.add(node.id)
            if node.op in LAYOUT_OPS or OPS[node.op].kind == "collective":
                stack.extend(node.inputs)
            elif OPS[node.op].kind not in ("leaf", "const"):
                found.append(node)
        return found

    def _position_shift(self, t: int) -> tuple[int, int, int, int] | None:
        """(dim, lo, hi, k) if `t` is the position of the max (or the top k) over the indices
        [lo, hi) of dim (an `arg_piece` or `top_piece`, or an argmax or top k over all of them) plus
        the constant k (nonzero), else None."""
        term = self.r.u[t]
        if term.op != "lin" or len(term.args) != 2:
            return None
        (position, _), (one, shift) = sorted(zip(term.args, term.attrs[0]), key=lambda pair: self.r.full_value(pair[0]) is not None)
        found = self.r.u[position]
        top = call_of(self.r, position)
        top = top if top is not None and top.path == POSITIONS else None
        if self.r.full_value(one) != 1 or (found.op not in ("arg_piece", "top_piece", "argmax") and top is None):
            return None
        if found.op in ("arg_piece", "top_piece"):
            (_, dim, _), lo, hi, _ = found.attrs
            return dim, lo, hi, shift
        dim = top.dim if top is not None else found.attrs[0][0]
        return dim, 0, self.r.shape(found.args[0])[dim], shift

    def _mixing_reshape(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first op of the disagreeing chain whose value reshapes data so that axes mix, e.g.
        (seq*batch, h) read as (batch, seq, h): a group of several dims becomes several dims of
        other sizes. Reshapes compose in the normal form, so this shows even when each op alone
        only merges or splits. Terms already searched (shared by the chain's values) are not searched again."""
        terms = self.run.ranks[rank]
        searched: set[int] = set()
        for node in chain:
            mixed = self._mixing_view(terms[node.id], searched)
            if mixed is not None:
                return Finding(
                    "discrepancy",
                    "wrong layout",
                    f"wrong layout: a reshape regroups axes {mixed[0]} as {mixed[1]}, mixing elements of "
                    "different axes (e.g. batch and sequence)",
                    [(rank, node)],
                    fix=f"move the axes into place (permute or transpose) before the reshape at {line_of(node)}",
                )
        return None

    def _mixing_view(self, t: int, seen: set[int]) -> tuple[str, str] | None:
        if t in seen or self.r.in_reference(t):  # the reference's own reshapes mix nothing
            return None
        seen.add(t)
        term = self.r.u[t]
        if term.op == "view":
            source = self.r.shape(term.args[0])
            for gi, gj in reshape_groups(source, term.shape) or []:
                if len(gi) > 1 and len(gj) > 1 and [source[d] for d in gi] != [term.shape[d] for d in gj]:
                    return "x".join(str(source[d]) for d in gi), "x".join(str(term.shape[d]) for d in gj)
        for a in term.args:
            found = self._mixing_view(a, seen)
            if found is not None:
                return found
        return None

    def _wrong_axis(self, t: int) -> tuple[int, int] | None:
        """(cat dim, split dim) when a cat joins regions of one tensor cut along another dim."""
        term = self.r.u[t]
        if term.op != "cat":
            return None
        regions = [self.r.as_region(p) for p in term.args]
        if len({root for root, _ in regions}) != 1:
            return None
        boxes = [box for _, box in regions]
        differing = {d for d in range(len(boxes[0])) if len({b[d] for b in boxes}) > 1}
        if len(differing) != 1 or term.attrs[0] in differing:
            return None
        dim, split = term.attrs[0], differing.pop()
        stacked = split == dim + 1 and all(self.r.shape(p)[dim] == 1 for p in term.args)
        if stacked and all(a[split][1] == b[split][0] for a, b in zip(boxes, boxes[1:])):
            return None  # consecutive parts stacked along a new axis ahead of their dim: the whole, reshaped
        return dim, split

    def _wrong_operand(self, rank: int, node: Node) -> Finding:
        """The op has a reference twin; find the operand that holds the wrong data, and the
        line that put it there (a runtime slice/reshape, or the checkpoint loader)."""
        terms, ref_terms = self.run.ranks[rank], self.run.reference
        match = self._should_match(rank, node)
        if match is None:
            return self._unexplained(rank, node)
        pairs = list(zip(node.inputs, match.inputs))
        wrong = [p for p, (d, r) in enumerate(pairs) if not self._own_chunk(rank, terms[d], ref_terms[r])]
        if not wrong:
            wrong = self._misaligned(rank, pairs)
        if not wrong:
            culprit = node if node.op in LAYOUT_OPS else self._loader_slice(rank, node) or node
            what = f"`{node.op}` on rank {rank} rearranges its operands differently from the reference"
            return Finding("discrepancy", "wrong layout", f"wrong layout: {what}", [(rank, culprit), (rank, node)], [match])
        position = wrong[0]
        d_in, r_in = pairs[position]
        misweighted = self._misweighted_term(rank, node, terms[d_in], ref_terms[r_in])
        if misweighted is not None:
            misweighted.reference.insert(0, match)
            return misweighted
        culprit = self._walk_back(rank, self.ranks[rank][d_in], self.reference[r_in])
        # the loader's cut of another chunk than a rank's own, on this rank or on one whose shard a
        # collective brought here, comes first: the ops after it may be right for a right shard
        own_blocks = node.op in LAYOUT_OPS and self._blocks_in_own_chunks(rank, terms[d_in])
        wrong_cut, owner = self._wrong_cut(rank, culprit, here=not own_blocks, blocks=culprit.op not in LAYOUT_OPS), rank
        if wrong_cut is not None:
            owner, culprit = wrong_cut
        elif own_blocks:
            culprit = node  # the right data, read with the wrong layout
        elif culprit.op == "slice":  # a runtime split of a shard the loader may have split wrong
            culprit = self._loader_instead(rank, culprit) or culprit
        return Finding(
            "discrepancy",
            "wrong layout",
            f"wrong layout: on rank {rank}, operand {position} of `{node.op}` ({value_name(self.ranks[rank][d_in])}) is "
            f"{describe(self.r.u, terms[d_in], 3)} but the reference uses {describe(self.r.u, ref_terms[r_in], 3)}",
            [(owner, culprit), (rank, node)],
            [match, self.reference[r_in]],
            fix=f"make {value_name(culprit)} at {line_of(culprit)} take rank {owner}'s own part of what the reference uses there",
            regions=[region(self.r, f"rank {rank}", terms[d_in]), region(self.r, "reference", ref_terms[r_in])],
        )

    def _should_match(self, rank: int, node: Node) -> Node | None:
        """The reference op of the same kind that shares the most operands with this one:
        an operand that is a region of the reference's counts 2, one over the same tensor 1."""
        terms = self.run.ranks[rank]
        best, best_score = None, 0
        for ref_node in self.reference.nodes:
            if ref_node.op != node.op or len(ref_node.inputs) != len(node.inputs):
                continue
            score = 0
            for d, r in zip(node.inputs, ref_node.inputs):
                if self._consistent(terms[d], self.run.reference[r]):
                    score += 2
                elif self.r.root_of(terms[d]) == self.r.root_of(self.run.reference[r]):
                    score += 1
            score += 1.5 * _shape_compatible(node.shape, ref_node.shape)
            if score > best_score and score >= 1:
                best, best_score = ref_node, score
        return best

    def _consistent(self, dist_term: int, ref_term: int) -> bool:
        """The rank's value is the reference value or a region of it."""
        if dist_term == ref_term:
            return True
        term = self.r.u[dist_term]
        if term.op == "cat":
            return all(self._consistent(p, ref_term) for p in term.args)
        dist_roots = [root for root, _ in self.r.regions(dist_term)]
        if ref_term in dist_roots:
            return True
        shared_root = any(root in dist_roots for root, _ in self.r.regions(ref_term))
        return shared_root and self._inside(dist_term, ref_term)

    def _inside(self, dist_term: int, ref_term: int) -> bool:
        d_root, d_box = self.r.as_region(dist_term)
        r_root, r_box = self.r.as_region(ref_term)
        return d_root == r_root and all(rl <= dl and dh <= rh for (dl, dh), (rl, rh) in zip(d_box, r_box))

    def _walk_back(self, rank: int, dist_node: Node, ref_node: Node) -> Node:
        """Up the chain of layout and elementwise ops in step with the reference's chain, to the
        first op whose inputs still hold the right data (and this rank's own chunk of it)."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        while dist_node.op == ref_node.op and (dist_node.op in LAYOUT_OPS or OPS[dist_node.op].kind == "unary"):
            parents = [
                (graph[d], self.reference[r])
                for d, r in zip(dist_node.inputs, ref_node.inputs)
                if not self._own_chunk(rank, terms[d], self.run.reference[r])
            ]
            if not parents:
                return dist_node
            dist_node, ref_node = parents[0]
        return dist_node


def _shape_compatible(local: tuple[int, ...], full: tuple[int, ...]) -> bool:
    return len(local) == len(full) and all(f % l == 0 for l, f in zip(local, full) if l)
