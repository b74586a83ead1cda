"""The `Diagnoser`: finds where a rank first parts ways with the reference and hands that op to the
mixin of the kind of fault its value shows; it also holds what they share (which terms agree, which
are partial, which op introduced a term).
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Callable

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS
from shardproof.relations.diagnose.agreement import LAYOUT_OPS, grounded, unreduced
from shardproof.relations.diagnose.candidates import TopCandidates
from shardproof.relations.diagnose.collectives import CollectiveFaults
from shardproof.relations.diagnose.dims import OtherDims
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.grad_sync import GradientSync
from shardproof.relations.diagnose.indices import IndexAxes
from shardproof.relations.diagnose.input_cuts import Claimed, InputCuts
from shardproof.relations.diagnose.lookups import MaskedLookups
from shardproof.relations.diagnose.merges import MergeWeights
from shardproof.relations.diagnose.misplaced import MisplacedTerms
from shardproof.relations.diagnose.missing_reduction import MissingReductions
from shardproof.relations.diagnose.other_share import OtherShares, Shared
from shardproof.relations.diagnose.overlap import OverlappingShards
from shardproof.relations.diagnose.reads import CollectiveOperands
from shardproof.relations.diagnose.shards import RankChunks
from shardproof.relations.diagnose.swapped import SwappedOperands
from shardproof.relations.diagnose.unmasked import UnmaskedSlots
from shardproof.relations.diagnose.upstream import UpstreamReductions
from shardproof.relations.diagnose.wrong_layout import LayoutFaults
from shardproof.relations.diagnose.wrong_scale import ScaleFaults
from shardproof.relations.execute import Execution
from shardproof.relations.rules import Rules
from shardproof.relations.rules.values import SIMPLE_DENOMINATOR
from shardproof.relations.skipped import skipped_backward
from shardproof.report.terms import describe, line_of, placement, value_name


class Diagnoser(MissingReductions, ScaleFaults, CollectiveFaults, CollectiveOperands, OverlappingShards, MaskedLookups,
                LayoutFaults, RankChunks, TopCandidates, MergeWeights, SwappedOperands,
                MisplacedTerms, IndexAxes, OtherDims, UpstreamReductions, UnmaskedSlots, InputCuts, GradientSync,
                OtherShares):
    def __init__(self, run: Execution, reference: Graph, ranks: list[Graph], claims: bool = True,
                 seed_holds: Callable[[], bool] = lambda: False):
        """`claims`: the outputs diagnosed are the case's claims, not a call's outputs compared as
        if whole, which a rank may rightly hold as a scaled share (a region of a reference term).
        `seed_holds`: whether the loss and some gradient are proven (prove._seed_holds)."""
        self.run = run
        self.r: Rules = run.rules
        self.reference = reference
        self.ranks = ranks
        self.claims = claims
        self.seed_holds = seed_holds
        self._grounded: dict[int, bool] = {}
        self._moved: dict[int, bool] = {}  # agreement where moves of agreeing values agree (`grounded`)
        self._moves = False  # whether `_bad` takes such moves as agreeing
        self._expected: dict[tuple[int, int], int] = {}  # (rank, output index) -> the term it must equal
        self._ref_lins: dict[frozenset, int] = {}
        for t in run.reference:
            term = self.r.u[t]
            if term.op == "lin":
                self._ref_lins.setdefault(frozenset(term.args), t)

    def counterpart(self, rank: int, node: Node) -> Node | None:
        """`node` (of another rank's program) in `rank`'s program: the node of its id and op, if
        there is one (programs imported from dumps need not match node for node)."""
        graph = self.ranks[rank]
        found = graph[node.id] if node.id < len(graph.nodes) else None
        return found if found is not None and found.op == node.op else None

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
        return "partial max" if {op for op, _ in held} <= {"max_piece", "arg_piece", "top_piece"} else "partial sum"

    def unreduced(self, t: int) -> set[tuple]:
        return unreduced(self.r, t)

    # --- entry --------------------------------------------------------------------------------------
    def diagnose(self, mismatched_outputs: list[tuple[int, int]], expected: dict[tuple[int, int], int] | None = None,
                 whole: int | None = None, claim: Claimed | None = None, shared: Shared | None = None) -> Finding:
        """`mismatched_outputs`: (rank, output index) pairs whose value was not proven; `expected`,
        where known, the term each of them must equal (a state after the step); `whole`, the
        reference value each must equal, for a replicated output; `claim`, the layout the outputs
        are claimed in, with the reference output's shape; `shared`, for outputs claimed as shards
        over all ranks, that claim's layout with the reference output's term (other_share.py). A
        discrepancy is led by the loader's cut of an input that takes another share than the rank's
        (input_cuts.py)."""
        found = self._diagnosed(mismatched_outputs, expected, whole)
        if found.verdict == "unknown":
            found = self._other_share(mismatched_outputs, shared) or found
        return self._input_cut_first(found, claim) if found.verdict == "discrepancy" else found

    def _diagnosed(self, mismatched_outputs: list[tuple[int, int]], expected: dict[tuple[int, int], int] | None,
                   whole: int | None) -> Finding:
        for (rank, index), wanted in (expected or {}).items():
            scaled = self._prescaled_share(rank, self.ranks[rank][self.ranks[rank].outputs[index]], wanted)
            if scaled is not None:
                return scaled
        self._expected = dict(expected or {}) if whole is None else {pair: whole for pair in mismatched_outputs}
        found = self._diverging(mismatched_outputs)
        if found.verdict == "unknown":  # moves of agreeing values may hide where the numbers part
            self._moves = True
            moved = self._diverging(mismatched_outputs)
            self._moves = False
            if moved.verdict == "discrepancy":
                return moved
        found = found if found.verdict != "unknown" else self._sum_terms_differ(mismatched_outputs) or found
        if found.kind in ("wrong layout", "wrong axis", "unknown"):  # an output the expected one scaled has its layout
            return self._scaled_whole(expected or {}) or found
        return found

    def _sum_terms_differ(self, mismatched_outputs: list[tuple[int, int]]) -> Finding | None:
        """An output that is the reference's sum but for some terms (misplaced.py)."""
        for rank, index in mismatched_outputs:
            node, wanted = self.ranks[rank][self.ranks[rank].outputs[index]], self._expected.get((rank, index))
            found = self._misplaced_term(rank, node, wanted) or self._split_sum(rank, node, wanted)
            if found is not None:
                return found
        return None

    def _diverging(self, mismatched_outputs: list[tuple[int, int]]) -> Finding:
        """The finding at the first divergence from the reference, else at the first mismatched output."""
        divergence = self._first_divergence(mismatched_outputs)
        if divergence is not None:
            rank, node, chain = divergence
            found = (
                self._swapped_operands(rank, chain[:1])  # at the first op where the values part: the rest follows from it
                or self._uninitialised_read(rank, chain)
                or self._misreduced(rank, chain)
                or self._reduced_across(rank, chain)
                or self._misassembled_input(rank, node)
                or self._overlapping_gather(rank, chain)
                or self._mixing_reshape(rank, chain)
                or self._misaligned_contraction(rank, chain)
                or self._unmasked_slots(rank, chain)
                or self._mismatched_lookup_mask(rank, chain)
                or self._misplaced_positions(rank, chain)
                or self._too_few_candidates(rank, chain)
                or self._along_other_dim(rank, chain)
                or self._misweighted_merge(rank, chain)
                or self._swapped_operands(rank, chain)
                or self._index_along_other_dim(rank, chain)
            )
            if found is not None:
                return found
            if OPS[node.op].kind == "collective":
                return self._at_collective(rank, node)
            # a partial sum consumed along the chain is a fault by itself; other divergences may
            # be its consequences (a max's gradient through the unreduced sum, say)
            consumer = next((n for n in chain if self._partial_inputs(rank, n) and not self._linear_in_partials(rank, n)), None)
            if consumer is None:
                skipped = skipped_backward(self.run, self.reference, self.ranks[rank], chain)
                if skipped is not None:
                    step, ref_step, message = skipped
                    return Finding("discrepancy", "missing backward step", message, [(rank, step)], [ref_step])
            return self._at_op(rank, consumer or node)
        rank, index = mismatched_outputs[0]
        node = self.ranks[rank][self.ranks[rank].outputs[index]]
        return self._at_output(rank, node)

    def wrong_shape(self, rank: int, node: Node, wanted: Node) -> Finding:
        """A rank's output of another shape than the reference output it must equal."""
        shape, expected = tuple(node.shape), tuple(wanted.shape)
        message = f"wrong layout: {value_name(node)} on rank {rank} has shape {shape} where the reference's has {expected}"
        shards = {e // k for e in expected for k in range(1, len(self.ranks) + 1) if e % k == 0}
        origin = self._shape_origin(rank, node, set(shape) - shards - {1}, set(expected) - set(shape) - {1})
        if origin is not None:  # not a shard left ungathered: an op made a size the program never needs
            where = f"`{origin[0].op}` at {line_of(origin[0])}"
            message += f"; its sizes go wrong at {where} (size {origin[1]})"
            fix = f"check the dim {where} works along: the sizes of the reference's output are lost there"
            return Finding("discrepancy", "wrong layout", message, [(rank, origin[0]), (rank, node)], [wanted], fix=fix)
        fix = f"make {value_name(node)} at {line_of(node)} the whole {expected} tensor on every rank (gather its shards)"
        return Finding("discrepancy", "wrong layout", message, [(rank, node)], [wanted], fix=fix)

    def _shape_origin(self, rank: int, node: Node, foreign: set[int], lost: set[int]) -> tuple[Node, int] | None:
        """The op, on the way back from `node` along a size of its shape the reference's output
        does not have (`foreign`), that made that size from inputs without it (a cat along the
        wrong dim) or dropped a size the reference's output keeps (`lost`: a reduction along the
        wrong dim), with that size."""
        graph, size = self.ranks[rank], next(iter(sorted(foreign)), None)
        while size is not None and node.op not in ("leaf", "const"):
            dropped = [s for s in lost if s not in node.shape and any(s in graph[i].shape for i in node.inputs)]
            carrying = [graph[i] for i in node.inputs if size in graph[i].shape]
            if dropped or not carrying:
                return (node, dropped[0] if dropped else size) if node.loc is not None else None
            node = carrying[0]
        return None

    def _linear_in_partials(self, rank: int, node: Node) -> bool:
        """Whether `node` maps shares of a sum to shares of its result (moving elements, adding shares,
        scaling by or multiplying with values every rank holds whole, a collective): a partial sum
        may pass it on its way to an all-reduce (a row-parallel output reshaped first). For a
        `max_piece` only moving elements does."""
        if OPS[node.op].kind == "collective":
            return True
        if node.op in LAYOUT_OPS:
            return True  # moving elements (a cat of shares into a flat buffer too) uses no share as whole
        if not self.partial(self.run.ranks[rank][node.id]):
            return False  # the share went into a value no rule carries it through: used as if whole
        partial = [i for i in node.inputs if self.partial(self.run.ranks[rank][i])]
        if self.partial_kind([self.run.ranks[rank][i] for i in partial]) != "partial sum":
            return False
        if node.op in ("neg", "sum") or (node.op == "add" and len(partial) == len(node.inputs)):
            return True  # (a share added to a value held whole is counted once per rank: a fault)
        return node.op in ("mul", "matmul") and len(partial) == 1 or (node.op == "div" and partial == [node.inputs[0]])

    def _bad(self, rank: int, node: Node) -> bool:
        if node.op in ("leaf", "const"):
            return False
        t = self.run.ranks[rank][node.id]
        collective = OPS[node.op].kind == "collective"
        agrees = grounded(self.r, t, self._moved, moved=True) if self._moves else self.grounded(t)
        return not agrees or (collective and not self.region_of_reference(t))

    def _first_divergence(self, mismatched_outputs: list[tuple[int, int]]) -> tuple[int, Node, list[Node]] | None:
        """The earliest op from which a chain of disagreeing ops reaches a mismatched output,
        with that chain (in execution order), on the rank where it begins (see `_diverging_from`).

        Intermediates the reference never computes (a vocab mask, say) are fine as long as a
        rule absorbs them before they reach an output."""
        best: tuple[int, Node, list[Node]] | None = None
        for rank, index in mismatched_outputs:
            graph = self.ranks[rank]
            found = self._diverging_from(rank, graph[graph.outputs[index]], set())
            if found is None:
                continue
            rank, chain = found
            if best is None or (chain[0].id, rank) < (best[1].id, best[0]):
                best = (rank, chain[0], chain)
        return best

    def _diverging_from(self, rank: int, start: Node, followed: set[tuple[int, int]]) -> tuple[int, list[Node]] | None:
        """The rank and chain of disagreeing ops (in execution order) that reaches `start`. A chain
        that begins at a recv continues on the sender, up to the value it sent: a received tensor
        is a copy of the sent one, so the values parted there (a pipeline stage's input gradient
        wrong because the last stage's loss is)."""
        if not self._bad(rank, start):
            return None
        graph = self.ranks[rank]
        seen, stack = {start.id}, [start]
        while stack:
            node = stack.pop()
            for i in node.inputs:
                if i not in seen and self._bad(rank, graph[i]):
                    seen.add(i)
                    stack.append(graph[i])
        chain = [graph[i] for i in sorted(seen)]
        sent = self._sent(rank, chain[0]) if chain[0].op == "recv" else None
        if sent is not None and sent not in followed:
            followed.add(sent)
            upstream = self._diverging_from(sent[0], self.ranks[sent[0]][sent[1]], followed)
            if upstream is not None:
                return upstream
        return rank, chain

    def _sent(self, rank: int, recv: Node) -> tuple[int, int] | None:
        """(sender, node id) of the value `recv` received: a send to `rank` of the very term."""
        sender, term = recv.attrs[0], self.run.ranks[rank][recv.id]
        if not isinstance(sender, int) or not 0 <= sender < len(self.ranks):
            return None
        terms = self.run.ranks[sender]
        return next(((sender, n.inputs[0]) for n in self.ranks[sender].nodes
                     if n.op == "send" and n.attrs[0] == rank and terms[n.inputs[0]] == term), None)

    def _at_op(self, rank: int, node: Node) -> Finding:
        partial_inputs = self._partial_inputs(rank, node)
        if partial_inputs:
            found = self._wrong_shard_summed(rank, node) or self._share_let_in(rank, node)
            if found is not None:
                return found
            kind = self.partial_kind(partial_inputs)
            return Finding(
                "discrepancy",
                "missing reduction",
                f"missing reduction: a {kind} (`{placement(kind)}`: each rank holds only its share) reaches "
                f"`{node.op}` without an all-reduce",
                [*self._reduction_sites(rank, node), (rank, node)],
                op=node.op,
                fix=self._reduction_fix(rank, node, kind, consumer=node),
            )
        return self._wrong_operand(rank, node)

    def _at_output(self, rank: int, node: Node) -> Finding:
        t = self.run.ranks[rank][node.id]
        if self.partial(t):
            return self._unreduced_output(rank, node)
        miscounted = self._miscounted(self._lin_parts(t))
        if miscounted is not None:
            extra, have, want = miscounted
            swapped = self._swapped_subtraction(rank, node, have / want)
            if swapped is not None:
                return swapped
            culprit = self._earliest(rank, node, lambda x: self._carrying(x, extra, have)) \
                or self._introducing(rank, node, self._scaled)
            factor = have / want
            counted = f"{factor} times the reference value"
            scaling = self._scaling_origin(rank, node, want)
            if OPS[culprit.op].kind == "collective":
                repeated = self._double_reduction(rank, culprit)
                if repeated is not None:
                    return repeated
                other_op = self._other_reduce_op(rank, culprit, factor, counted)
                if other_op is not None and scaling is not None:  # rescaling the shares would do as well
                    return replace(other_op, distributed=[*other_op.distributed, (rank, scaling[0])],
                                   fix=f"{other_op.fix}, or scale by {scaling[1] / factor} instead of {scaling[1]} "
                                   f"at {line_of(scaling[0])}")
                if other_op is not None:
                    return other_op
            message = f"wrong scale (x{factor}): {counted}"
            fix = f"scale {value_name(culprit)} by {1 / factor} at {line_of(culprit)}"
            if scaling is None:
                return Finding("discrepancy", "wrong scale", message, [(rank, culprit)], scale=factor, fix=fix)
            sites, share = [(rank, scaling[0]), (rank, culprit)], f"; each share of it is scaled by {scaling[1]} here"
            if want.denominator > SIMPLE_DENOMINATOR:  # folded float constants, not a scale anyone wrote
                return Finding("discrepancy", "wrong scale", message + share, sites, scale=factor,
                               fix=f"scale by {scaling[1] / factor} instead of {scaling[1]} at {line_of(scaling[0])}")
            return Finding("discrepancy", "wrong scale", f"{message}{share}, where the reference scales the whole by {want}",
                           sites, scale=factor,
                           fix=f"scale by {want} (the whole) instead of {scaling[1]} (a share) at {line_of(scaling[0])}")
        return (self._wrong_axis_finding(rank, node) or self._misplaced_positions(rank, [node])
                or self._unwritten_output(rank, node) or self._overlapping_gather(rank, [node])
                or self._unexplained(rank, node))

    # --- finding the line that introduced something ---------------------------------------------------
    def _lin_args(self, t: int) -> tuple[int, ...]:
        term = self.r.u[t]
        return term.args if term.op == "lin" else ()

    def _lin_parts(self, t: int) -> list[tuple[int, Fraction]]:
        """The (term, coefficient) pairs of the sum `t`; a term that is no sum is its one part."""
        term = self.r.u[t]
        return list(zip(term.args, term.attrs[0])) if term.op == "lin" else [(t, Fraction(1))]

    def _introducing(self, rank: int, node: Node, test) -> Node:
        """The earliest ancestor of `node` on this rank whose value passes `test`, else `node`."""
        return self._earliest(rank, node, test) or node

    def _earliest(self, rank: int, node: Node, test) -> Node | None:
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for ancestor in graph.ancestors(node):
            if ancestor.op not in ("leaf", "const") and test(terms[ancestor.id]):
                return ancestor
        return None

    def _unexplained(self, rank: int, node: Node) -> Finding:
        return Finding(
            "unknown",
            "unknown",
            f"could not relate `{node.op}` on rank {rank} to the reference: no rule applies to its operands "
            f"({', '.join(describe(self.r.u, self.run.ranks[rank][i], 2) for i in node.inputs)})",
            [(rank, node)],
            op=node.op,
        )
