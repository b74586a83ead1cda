"""Where and why a rank parts ways with the reference, once the outputs were not proven equal.

The first op of a rank whose value is not built from reference values by layout and linear
structure alone is where the two programs diverge. What the divergence looks like says what kind
of fault it is: a partial sum consumed by a nonlinear op (missing reduction), a sum over ranks whose
pieces overlap or leave gaps (wrong shard / double counting), the right terms with the wrong
coefficients (double counting, wrong scale), or an operand that is the wrong region of a reference
tensor (wrong layout). Anything else is `unknown`: a rule may be missing, which is not a bug.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS
from shardproof.relations.execute import Execution
from shardproof.relations.layout import reshape_groups
from shardproof.relations.rules import Rules
from shardproof.relations.skipped import skipped_backward

PIECES = {"piece", "max_piece"}  # one rank's part of a sum (or max) over ranks
STRUCTURAL = {"slice", "cat", "bcast", "repeat", "lin", "full", "const", *PIECES}
LAYOUT_OPS = {"view", "permute", "slice", "expand", "convert", "cat"}
LAYOUT_TERMS = {"view", "permute", "slice", "bcast", "repeat"}  # normal-form terms that only move elements


def grounded(rules: Rules, t: int, memo: dict[int, bool]) -> bool:
    """Built from reference values by regions and linear structure only: still agreeing."""
    if t not in memo:
        term = rules.u[t]
        memo[t] = rules.in_reference(t) or (term.op in STRUCTURAL and all(grounded(rules, a, memo) for a in term.args))
    return memo[t]


@dataclass
class Finding:
    verdict: str  # "discrepancy" or "unknown"
    kind: str  # missing reduction, double counting, wrong scale, wrong layout, wrong axis, unknown
    message: str
    distributed: list[tuple[int, Node]] = field(default_factory=list)  # (rank, node), culprit first
    reference: list[Node] = field(default_factory=list)
    op: str | None = None
    scale: Fraction | None = None  # wrong scale, double counting: the factor on the reference value
    claim: str | None = None  # the claim (steps.Check label) found failing; None: the programs as a whole

    @property
    def brief(self) -> str:
        """The kind of fault with its factor, to name a claim that fails alongside the one diagnosed."""
        return self.kind if self.scale is None else f"{self.kind}: x{self.scale}"


class Diagnoser:
    def __init__(self, run: Execution, reference: Graph, ranks: list[Graph]):
        self.run = run
        self.r: Rules = run.rules
        self.reference = reference
        self.ranks = ranks
        self._grounded: dict[int, bool] = {}
        self._ref_lins: dict[frozenset, int] = {}
        for t in run.reference:
            term = self.r.u[t]
            if term.op == "lin":
                self._ref_lins.setdefault(frozenset(term.args), t)

    # --- what counts as still agreeing -------------------------------------------------------
    def grounded(self, t: int) -> bool:
        return grounded(self.r, t, self._grounded)

    def region_of_reference(self, t: int) -> bool:
        return self.r.in_reference(t) or any(self.r.in_reference(root) for root, _ in self.r.regions(t))

    def partial(self, t: int) -> bool:
        return bool(self.unreduced(t))

    def partial_kind(self, terms: list[int]) -> str:
        """How to name the unreduced value: a partial max when only max pieces are held."""
        held = set().union(*(self.unreduced(t) for t in terms))
        return "partial max" if {op for op, _ in held} == {"max_piece"} else "partial sum"

    def unreduced(self, t: int) -> set[tuple]:
        """The pieces (kind, axis and range) that `t` holds without their sum (or max) over ranks."""
        term = self.r.u[t]
        if term.op in PIECES:
            return {(term.op, term.attrs)}
        if term.op in ("lin", "slice", "bcast", "repeat"):
            return set().union(*(self.unreduced(a) for a in term.args))
        return set()

    # --- entry --------------------------------------------------------------------------------------
    def diagnose(self, mismatched_outputs: list[tuple[int, int]]) -> Finding:
        """`mismatched_outputs`: (rank, output index) pairs whose value was not proven."""
        divergence = self._first_divergence(mismatched_outputs)
        if divergence is not None:
            rank, node, chain = divergence
            found = self._misassembled_input(rank, node) or self._mixing_reshape(rank, chain)
            if found is not None:
                return found
            if OPS[node.op].kind == "collective":
                return self._at_collective(rank, node)
            # a partial sum consumed along the chain is a fault by itself; other divergences may
            # be its consequences (a max's gradient through the unreduced sum, say)
            consumer = next((n for n in chain if self._partial_inputs(rank, n)), None)
            if consumer is None:
                skipped = skipped_backward(self.run, self.reference, self.ranks[rank], chain)
                if skipped is not None:
                    step, ref_step, message = skipped
                    return Finding("discrepancy", "missing backward step", message, [(rank, step)], [ref_step])
            return self._at_op(rank, consumer or node)
        rank, index = mismatched_outputs[0]
        node = self.ranks[rank][self.ranks[rank].outputs[index]]
        return self._at_output(rank, node)

    def _bad(self, rank: int, node: Node) -> bool:
        if node.op in ("leaf", "const"):
            return False
        t = self.run.ranks[rank][node.id]
        collective = OPS[node.op].kind == "collective"
        return not self.grounded(t) or (collective and not self.region_of_reference(t))

    def _first_divergence(self, mismatched_outputs: list[tuple[int, int]]) -> tuple[int, Node, list[Node]] | None:
        """The earliest op from which a chain of disagreeing ops reaches a mismatched output,
        with that chain (in execution order).

        Intermediates the reference never computes (a vocab mask, say) are fine as long as a
        rule absorbs them before they reach an output."""
        best: tuple[int, Node, list[Node]] | None = None
        for rank, index in mismatched_outputs:
            graph = self.ranks[rank]
            start = graph[graph.outputs[index]]
            if not self._bad(rank, start):
                continue
            seen, stack = {start.id}, [start]
            while stack:
                node = stack.pop()
                for i in node.inputs:
                    if i not in seen and self._bad(rank, graph[i]):
                        seen.add(i)
                        stack.append(graph[i])
            chain = [graph[i] for i in sorted(seen)]
            if best is None or (chain[0].id, rank) < (best[1].id, best[0]):
                best = (rank, chain[0], chain)
        return best

    def _misassembled_input(self, rank: int, node: Node) -> Finding | None:
        """An operand that concatenates shards along another dim than they were split on."""
        for i in node.inputs:
            found = self._wrong_axis_finding(rank, self.ranks[rank][i])
            if found is not None:
                found.distributed.append((rank, node))
                return found
        return None

    def _wrong_axis_finding(self, rank: int, node: Node) -> Finding | None:
        axes = self._wrong_axis(self.run.ranks[rank][node.id])
        if axes is None:
            return None
        return Finding(
            "discrepancy",
            "wrong axis",
            f"wrong layout (wrong axis): shards split along dim {axes[1]} are concatenated along dim {axes[0]}",
            [(rank, node)],
        )

    def _mixing_reshape(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first op of the disagreeing chain whose value reshapes data so that axes mix, e.g.
        (seq*batch, h) read as (batch, seq, h): a group of several dims becomes several dims of
        other sizes. Reshapes compose in the normal form, so this shows even when each op alone
        only merges or splits."""
        terms = self.run.ranks[rank]
        for node in chain:
            mixed = self._mixing_view(terms[node.id], set())
            if mixed is not None:
                return Finding(
                    "discrepancy",
                    "wrong layout",
                    f"wrong layout: a reshape regroups axes {mixed[0]} as {mixed[1]}, mixing elements of "
                    "different axes (e.g. batch and sequence)",
                    [(rank, node)],
                )
        return None

    def _mixing_view(self, t: int, seen: set[int]) -> tuple[str, str] | None:
        if t in seen:
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

    # --- a sum over ranks that does not add up ------------------------------------------------------
    def _at_collective(self, rank: int, node: Node) -> Finding:
        narrow = self._wrong_group(rank, node)
        if narrow is not None:
            return narrow
        t = self.run.ranks[rank][node.id]
        term = self.r.u[t]
        parts = list(zip(term.args, term.attrs[0])) if term.op == "lin" else [(t, Fraction(1))]
        pieces = [(a, c) for a, c in parts if self.r.u[a].op == "piece"]
        if pieces:
            return self._uneven_pieces(rank, node, pieces)
        miscounted = self._miscounted(parts)
        if miscounted is not None:
            extra, have, want = miscounted
            repeated = self._double_reduction(rank, node)
            if repeated is not None:
                return repeated
            factor = have / want
            counted = f"after `{node.op}` the term {self.r.u.render(extra, 2)} is counted {have} times where the " \
                      f"reference counts it {want} times"
            if factor == len(node.attrs[-1]) and self._held_whole(rank, node, extra):
                culprit = self._introducing(rank, node, lambda x: extra in self._lin_args(x))
                message = f"double counting (x{factor}): {counted}: it is added on every rank before the sum over ranks"
                return Finding("discrepancy", "double counting", message, [(rank, culprit), (rank, node)], scale=factor)
            scaling = self._scaling_origin(rank, node)
            culprit = scaling[0] if scaling else self._introducing(rank, node, lambda x: extra in self._lin_args(x))
            where = f": each rank's share is scaled by {scaling[1]} here" if scaling else ""
            return Finding("discrepancy", "wrong scale", f"wrong scale (x{factor}): {counted}{where}",
                           [(rank, culprit), (rank, node)], scale=factor)
        return self._unexplained(rank, node)

    def _held_whole(self, rank: int, node: Node, extra: int) -> bool:
        """Every rank's operand of the sum `node` holds the reference term `extra` itself (a bias
        added before the all-reduce), not its share of it: summing counts it once per rank."""
        operand = self.run.ranks[rank][node.inputs[0]]
        return extra == operand or extra in self._lin_args(operand)

    def _scaling_origin(self, rank: int, node: Node, want: Fraction | None = None) -> tuple[Node, Fraction] | None:
        """The first op that multiplies a rank's (or micro-batch's) share of a sum flowing into `node`
        by a constant (a mean's division, a loss normalisation), with that factor: where a wrong scale
        is usually set. In a backward the factor is a constant divided out of the gradient seed (a
        mean's backward yields 1/count), which the normal form folds into the share's other factors,
        so the division computing it stands for the scaling. With `want`, the reference's factor on
        the whole, a share scaled by exactly that is right and passed over."""
        terms = self.run.ranks[rank]
        for n in self._partial_chain(rank, node):
            term = self.r.u[terms[n.id]]
            scales = any(self.r.full_value(terms[i]) is not None for i in n.inputs)
            if scales and term.op == "lin" and any(c not in (1, want) for c in term.attrs[0]) \
                    and all(self.r.u[a].op == "piece" for a in term.args):
                return n, term.attrs[0][0]
        graph = self.ranks[rank]
        for n in graph.ancestors(graph[node.inputs[0]]):
            factor = _normalising(self.r.full_value(terms[n.id])) if n.op in ("div", "mul") else None
            if factor is not None and factor != want:
                return n, factor
        return None

    def _double_reduction(self, rank: int, node: Node) -> Finding | None:
        """A sum over ranks of an operand that an earlier sum over the same ranks produced: every
        rank holds the whole, so summing again counts it once per rank."""
        earlier = self._earlier_reduction(rank, node)
        if earlier is None:
            return None
        group = list(node.attrs[-1])
        where = f" at {earlier.loc.short()}" if earlier.loc is not None else ""
        return Finding(
            "discrepancy",
            "double reduction",
            f"double reduction: the operand of `{node.op}` is the result of the `{earlier.op}`{where}, already summed "
            f"over ranks {group}; summing it again counts it {len(group)} times",
            [(rank, node), (rank, earlier)],
        )

    def _earlier_reduction(self, rank: int, node: Node) -> Node | None:
        """The all-reduce (sum) over the same ranks whose result `node`, another sum, reduces again."""
        if node.op != "all_reduce" or node.attrs[0] != "sum":
            return None
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        operand = terms[node.inputs[0]]
        for ancestor in reversed(graph.ancestors(graph[node.inputs[0]])):
            if ancestor.op == "all_reduce" and ancestor.attrs == node.attrs and terms[ancestor.id] == operand:
                return ancestor
        return None

    def _uneven_pieces(self, rank: int, node: Node, pieces: list[tuple[int, Fraction]]) -> Finding:
        ranges = sorted((self.r.u[p].attrs[1], self.r.u[p].attrs[2], c) for p, c in pieces)
        size = self.r.u[pieces[0][0]].attrs[3]
        covered = ", ".join(f"[{lo}:{hi})" + (f" x{c}" if c != 1 else "") for lo, hi, c in ranges)
        duplicated = any(c != 1 for _, _, c in ranges)
        group = node.attrs[-1]
        origin = self._piece_origin(rank, node)
        culprit = self._slice_source(node.id, ranges) or (rank, origin if origin is not None else node)
        kind = "double counting" if duplicated else "missing reduction"
        return Finding(
            "discrepancy",
            "wrong layout" if duplicated else kind,
            f"wrong layout ({kind}): `{node.op}` over ranks {list(group)} adds up parts {covered} of a sum over "
            f"an axis of size {size}; the parts must cover it exactly once (a rank holds the wrong shard)",
            [culprit, (rank, node)],
        )

    def _miscounted(self, parts: list[tuple[int, Fraction]]) -> tuple[int, Fraction, Fraction] | None:
        """A reference sum with the same terms but other coefficients: (term, have, want)."""
        same = self._ref_lins.get(frozenset(a for a, _ in parts))
        if same is not None:
            want = dict(zip(self.r.u[same].args, self.r.u[same].attrs[0]))
            for a, c in parts:
                if want.get(a) != c:
                    return a, c, want[a]
        if len(parts) == 1 and self.r.in_reference(parts[0][0]) and parts[0][1] != 1:
            return parts[0][0], parts[0][1], Fraction(1)
        return None

    # --- an op whose value the reference never computes ----------------------------------------------
    def _partial_inputs(self, rank: int, node: Node) -> list[int]:
        """The terms of `node`'s operands that are partial sums (or maxes) over ranks."""
        terms = self.run.ranks[rank]
        return [terms[i] for i in node.inputs if self.partial(terms[i])]

    def _at_op(self, rank: int, node: Node) -> Finding:
        partial_inputs = self._partial_inputs(rank, node)
        if partial_inputs:
            origin = self._piece_origin(rank, node)
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction: a {self.partial_kind(partial_inputs)} (each rank holds only its share) reaches "
                f"`{node.op}` without an all-reduce",
                [(rank, origin), (rank, node)] if origin is not None else [(rank, node)],
                op=node.op,
            )
        return self._wrong_operand(rank, node)

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
        if len(differing) == 1 and term.attrs[0] not in differing:
            return term.attrs[0], differing.pop()
        return None

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
        if node.op in LAYOUT_OPS and self._blocks_in_own_chunks(rank, terms[d_in]):
            culprit = node  # the right data, read with the wrong layout
        elif culprit.op == "slice":
            culprit = self._loader_instead(rank, culprit) or culprit
        elif culprit.op not in LAYOUT_OPS:
            culprit = self._loader_slice(rank, culprit, unnatural=True) or culprit
        return Finding(
            "discrepancy",
            "wrong layout",
            f"wrong layout: on rank {rank}, operand {position} of `{node.op}` is "
            f"{self.r.u.render(terms[d_in], 3)} but the reference uses {self.r.u.render(ref_terms[r_in], 3)}",
            [(rank, culprit), (rank, node)],
            [match, self.reference[r_in]],
        )

    def _misweighted_term(self, rank: int, node: Node, operand: int, ref_operand: int) -> Finding | None:
        """A sum (of this rank's region) with the reference's terms where one term has another
        coefficient and the rest agree: a wrong scale of that term. It was set where the rank first
        weighs it against an agreeing term in the wrong ratio (a smoothing term's 1 / vocab size)."""
        have, want = _weights(self.r, self.r.as_region(operand)[0]), _weights(self.r, ref_operand)
        if len(have) < 2 or have.keys() != want.keys():
            return None
        wrong = [k for k in have if have[k] != want[k]]
        right = [k for k in have if have[k] == want[k]]
        if not wrong or not right:
            return None
        bad, good = wrong[0], right[0]
        ratio = want[bad] / want[good]

        def misweighs(t: int) -> bool:
            weights = _weights(self.r, t)
            return bad in weights and good in weights and weights[bad] / weights[good] != ratio

        culprit = self._introducing(rank, node, misweighs)
        term = "constant term" if isinstance(bad, tuple) else f"term {self.r.u.render(bad, 2)}"
        return Finding(
            "discrepancy",
            "wrong scale",
            f"wrong scale: on rank {rank} the {term} of a sum reaching `{node.op}` has coefficient "
            f"{have[bad]} where the reference has {want[bad]}, while the other terms agree",
            [(rank, culprit), (rank, node)],
        )

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
                return self._loader_slice(rank, graph[source])
            covered.add((root, inside[0]))
        return self._loader_slice(rank, graph[source]) if len(covered) < siblings else None

    def _loader_slice(self, rank: int, node: Node, unnatural: bool = False) -> Node | None:
        """The first op of the checkpoint loader (state-only slicing or joining) that `node`
        depends on; with `unnatural`, the first slice that does not take this rank's own chunk."""
        graph = self.ranks[rank]
        state_only: dict[int, bool] = {}
        for ancestor in graph.ancestors(node):
            if ancestor.op == "leaf":
                state_only[ancestor.id] = str(ancestor.attrs[0]).startswith("state:")
            else:
                state_only[ancestor.id] = bool(ancestor.inputs) and all(state_only.get(i, False) for i in ancestor.inputs)
            if state_only[ancestor.id] and ancestor.op == "cat" and not unnatural:
                return ancestor
            if state_only[ancestor.id] and ancestor.op == "slice":
                dim, lo, hi = ancestor.attrs
                if not unnatural or lo != rank * (hi - lo):
                    return ancestor
        return None

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

    # --- outputs that differ without any divergent op ---------------------------------------------------
    def _at_output(self, rank: int, node: Node) -> Finding:
        t = self.run.ranks[rank][node.id]
        term = self.r.u[t]
        if self.partial(t):
            return self._unreduced_output(rank, node)
        parts = list(zip(term.args, term.attrs[0])) if term.op == "lin" else [(t, Fraction(1))]
        miscounted = self._miscounted(parts)
        if miscounted is not None:
            extra, have, want = miscounted
            culprit = self._introducing(rank, node, lambda x: self._scaled(x))
            if OPS[culprit.op].kind == "collective":
                repeated = self._double_reduction(rank, culprit)
                if repeated is not None:
                    return repeated
            factor = have / want
            message = f"wrong scale (x{factor}): {factor} times the reference value"
            scaling = self._scaling_origin(rank, node, want)
            if scaling is None:
                return Finding("discrepancy", "wrong scale", message, [(rank, culprit)], scale=factor)
            where = f"; each share of it is scaled by {scaling[1]} here, where the reference scales the whole by {want}"
            return Finding("discrepancy", "wrong scale", message + where, [(rank, scaling[0]), (rank, culprit)], scale=factor)
        return self._wrong_axis_finding(rank, node) or self._unexplained(rank, node)

    def _unreduced_output(self, rank: int, node: Node) -> Finding:
        """A partial sum reaches an output: where did it miss its reduction? Added to a sum that was
        already reduced (a micro-batch accumulated after the all-reduce), reduced only as a copy the
        program then drops (the all-reduce ran on another buffer), or never reduced at all."""
        joined = self._added_after_reduction(rank, node)
        if joined is not None:
            join, collective = joined
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction: this rank's share of a sum is added to a value already reduced by `{collective.op}` "
                f"over ranks {list(collective.attrs[-1])}; the other ranks' shares of it never arrive",
                [(rank, join), (rank, collective)],
            )
        for collective in reversed(self._partial_chain(rank, node)):
            narrow = self._wrong_group(rank, collective)
            if narrow is not None:
                return narrow
        copy = self._reduced_copy(rank, node)
        if copy is not None:
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction (wrong buffer): `{copy.op}` over ranks {list(copy.attrs[-1])} reduces a copy of this "
                "value and its result is never used; the value used is each rank's own share",
                [(rank, copy)],
            )
        origin = self._piece_origin(rank, node)
        return Finding(
            "discrepancy",
            "missing reduction",
            f"missing reduction: the output is still a {self.partial_kind([self.run.ranks[rank][node.id]])} (each rank "
            "holds only its share); it needs an all-reduce",
            [(rank, origin)] if origin is not None else [(rank, node)],
        )

    def _added_after_reduction(self, rank: int, node: Node) -> tuple[Node, Node] | None:
        """The first `add` on the way to `node` of a partial sum that went through a collective and
        one that never did, with that collective."""
        chain = self._partial_chain(rank, node)
        on_chain = {n.id for n in chain}
        reduced_by: dict[int, Node] = {}
        for n in chain:
            if OPS[n.op].kind == "collective":
                reduced_by[n.id] = n
                continue
            ins = [i for i in n.inputs if i in on_chain]
            done = [reduced_by[i] for i in ins if i in reduced_by]
            if done:
                reduced_by[n.id] = done[0]
                if n.op == "add" and len(done) < len(ins):
                    return n, done[0]
        return None

    def _wrong_group(self, rank: int, node: Node) -> Finding | None:
        """A reducing collective whose sum stays partial over its group but adds up once the same
        collective's inputs on the other ranks join: it reduces over too few ranks."""
        if node.op not in ("all_reduce", "reduce_scatter"):
            return None
        k = [n.id for n in self.ranks[rank].nodes if n.op in ("all_reduce", "reduce_scatter")].index(node.id)
        inputs = {}  # each rank's input to its k-th reduction
        for graph in self.ranks:
            reductions = [n for n in graph.nodes if n.op in ("all_reduce", "reduce_scatter")]
            if k < len(reductions):
                inputs[graph.rank] = self.run.ranks[graph.rank][reductions[k].inputs[0]]
        group = list(node.attrs[-1])
        others = sorted(set(inputs) - set(group))
        mine = self.r.lin([(inputs[s], Fraction(1)) for s in group if s in inputs])
        everyone = self.r.lin([(t, Fraction(1)) for t in inputs.values()])
        if not others or not self.partial(mine) or self.partial(everyone):
            return None
        return Finding(
            "discrepancy",
            "wrong group",
            f"wrong group: `{node.op}` over ranks {group} adds up only part of a sum; ranks {others} hold the other "
            f"shares (reduce over ranks {sorted(group + others)})",
            [(rank, node)],
        )

    def _reduced_copy(self, rank: int, node: Node) -> Node | None:
        """A collective whose input is a value on the way to `node` but whose result never reaches it."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        chain_terms = {terms[n.id] for n in self._partial_chain(rank, node)}
        used = {n.id for n in graph.ancestors(node)}
        for n in graph.nodes:
            if OPS[n.op].kind == "collective" and n.id not in used and terms[n.inputs[0]] in chain_terms:
                return n
        return None

    # --- finding the line that introduced something ---------------------------------------------------
    def _lin_args(self, t: int) -> tuple[int, ...]:
        term = self.r.u[t]
        return term.args if term.op == "lin" else ()

    def _scaled(self, t: int) -> bool:
        term = self.r.u[t]
        return (
            term.op == "lin"
            and not self.r.in_reference(t)
            and any(c != 1 for c in term.attrs[0])
            and all(self.r.in_reference(a) for a in term.args)
        )

    def _introducing(self, rank: int, node: Node, test) -> Node:
        """The earliest ancestor of `node` on this rank whose value passes `test`."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for ancestor in graph.ancestors(node):
            if ancestor.op not in ("leaf", "const") and test(terms[ancestor.id]):
                return ancestor
        return node

    def _piece_origin(self, rank: int, node: Node) -> Node | None:
        """The op where the partial sum that reaches `node` unreduced was created (a contraction or
        reduction over a shard): the earliest op of the chain of partial values ending at `node`.
        Partial values reduced on the way (a row-parallel matmul before its all-reduce) are not it."""
        origins = [n for n in self._partial_chain(rank, node) if n.op not in LAYOUT_OPS]
        return origins[0] if origins else None

    def _partial_chain(self, rank: int, node: Node) -> list[Node]:
        """`node` and the ops whose partial values flow into it, in execution order."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        chain, stack = {node.id}, [node]
        while stack:
            for i in stack.pop().inputs:
                if i not in chain and self.partial(terms[i]):
                    chain.add(i)
                    stack.append(graph[i])
        return [graph[i] for i in sorted(chain)]

    def _slice_source(self, node_id: int, ranges: list[tuple[int, int, Fraction]]) -> tuple[int, Node] | None:
        """The loader slice, on a rank whose share is not its own, that picked a summed part."""
        for rank, graph in enumerate(self.ranks):
            for ancestor in graph.ancestors(graph[node_id]):
                if ancestor.op != "slice" or graph[ancestor.inputs[0]].op != "leaf":
                    continue
                _, lo, hi = ancestor.attrs
                if any((l, h) == (lo, hi) for l, h, _ in ranges) and lo != rank * (hi - lo):
                    return rank, ancestor
        return None

    def _unexplained(self, rank: int, node: Node) -> Finding:
        return Finding(
            "unknown",
            "unknown",
            f"could not relate `{node.op}` on rank {rank} to the reference: no rule applies to its operands "
            f"({', '.join(self.r.u.render(self.run.ranks[rank][i], 2) for i in node.inputs)})",
            [(rank, node)],
            op=node.op,
        )


def _weights(r: Rules, t: int) -> dict[Any, Fraction]:
    """A sum's coefficient per term, terms taken through layout ops (a slice, view or transpose of
    a term is that term; a constant counts by its value), or {} if `t` is no sum."""
    term = r.u[t]
    if term.op != "lin":
        return {}
    weights: dict[Any, Fraction] = {}
    for a, c in zip(term.args, term.attrs[0]):
        while r.u[a].op in LAYOUT_TERMS:
            a = r.u[a].args[0]
        key = ("full", *r.u[a].attrs) if r.u[a].op == "full" else a
        weights[key] = weights.get(key, Fraction(0)) + c
    return weights


def _is_rank_chunk(rank: int, part: tuple[int, int], whole: tuple[int, int]) -> bool:
    """`part` is chunk `rank` (modulo the number of chunks) of `whole` cut into equal chunks."""
    (lo, hi), (w_lo, w_hi) = part, whole
    width = hi - lo
    return part == whole or (lo - w_lo) == (rank % ((w_hi - w_lo) // width)) * width


def _shape_compatible(local: tuple[int, ...], full: tuple[int, ...]) -> bool:
    return len(local) == len(full) and all(f % l == 0 for l, f in zip(local, full) if l)


def _normalising(value: object) -> Fraction | None:
    """`value` as the factor 1/k (k > 1 a whole number) that a mean or a loss normalisation applies."""
    if not isinstance(value, (int, float, Fraction)) or isinstance(value, bool) or not 0 < value < 1:
        return None
    count = round(1 / value)
    return Fraction(1, count) if abs(1 / value - count) < 1e-9 * count else None
