"""Slots summed over ranks unmasked: each rank computes every slot (a routing slot, a token's
label) through its own block [lo, hi) of a stacked table, the slots whose ids lie elsewhere at a
clamped or sentinel row, and must zero those before the sum over ranks. Where a rank's operand of
an all-reduce, masked to its block, makes the sum the reference's value, the mask is what is
missing: every slot is counted on every rank, once with its own rows and once per other rank with
another's. A part of `Diagnoser`.
"""

from __future__ import annotations

from fractions import Fraction

from shardproof.ir.graph import Node
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.rules.masks import range_masks
from shardproof.relations.rules.slots import inside_test, local_lookups
from shardproof.report.terms import describe, line_of, value_name


class UnmaskedSlots:
    """An all-reduce of ranks' values computed from their renumbered lookups for every slot."""

    def _unmasked_slots(self, rank: int, chain: list[Node]) -> Finding | None:
        for node in chain:
            if node.op != "all_reduce" or node.attrs[0] != "sum":
                continue
            group = node.attrs[-1]
            operands = [self.counterpart(q, node) for q in group]
            if None in operands:
                continue
            masked = [self._masked_to_block(q, self.ranks[q][n.inputs[0]]) for q, n in zip(group, operands)]
            if None in masked or not self.grounded(self.r.lin([(m, Fraction(1)) for m, _ in masked])):
                continue
            operand = self.ranks[rank][node.inputs[0]]
            (lo, hi), table = masked[group.index(rank)][1]
            message = (
                f"double counting: `{node.op}` sums {value_name(operand)} over the ranks, and each rank computed it "
                f"for every slot through its rows [{lo}:{hi}) of `{table}`, for ids outside those rows too (at a row "
                f"they do not select): every rank adds every slot, where the reference adds each once, with the row "
                f"of its id"
            )
            fix = (f"zero the slots whose ids lie outside the rank's rows ([{lo}:{hi}) on rank {rank}) in "
                   f"{value_name(operand)} at {line_of(operand)}, before the `{node.op}` at {line_of(node)}")
            return Finding("discrepancy", "double counting", message, [(rank, operand), (rank, node)], fix=fix)
        return None

    def _masked_to_block(self, rank: int, node: Node) -> tuple[int, tuple[tuple[int, int], str]] | None:
        """The rank's value at `node` zeroed on the slots whose ids lie outside the block its
        renumbered lookups read, with that block and table; None where it reads none."""
        value = self.run.ranks[rank][node.id]
        tests = {(ids, lo, hi) for _, (ids, lo, hi, _) in range_masks(self.r, value)}
        for ids, lo, hi in sorted(tests):
            lookups = local_lookups(self.r, value, ids, lo, hi)
            if not lookups or self.r.shape(ids) != self.r.shape(value):
                continue
            zero = self.r.const(("full", 0.0), self.r.shape(value), self.r.u[value].dtype)
            kept = self.r.build("where", (inside_test(self.r, ids, lo, hi), value, zero), (), self.r.shape(value), self.r.u[value].dtype)
            table = self.r.as_region(self.r.u[next(iter(lookups))].args[0])[0]
            return kept, ((lo, hi), describe(self.r.u, table, 1))
        return None
