"""Wrong scale and double counting: the right terms with the wrong coefficients, a sum over ranks
of a value every rank holds whole, and the op that set the factor. A part of `Diagnoser`.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from shardproof.ir.graph import Node
from shardproof.ir.ops import OPS
from shardproof.relations.diagnose.agreement import LAYOUT_OPS, LAYOUT_TERMS
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.rules import Rules
from shardproof.relations.rules.values import is_finite_number
from shardproof.report.terms import describe, line_of, value_name


class ScaleFaults:
    """Coefficients that differ from the reference's, and where they were set."""

    def _miscounted(self, parts: list[tuple[int, Fraction]]) -> tuple[int, Fraction, Fraction] | None:
        """A reference sum with the same terms but other coefficients: (term, have, want). A rank's
        region of a term of such a sum (its rows of an expert's weight gradient, which the reference
        scales) counts as that term: its coefficient is compared with the whole's. A region of a
        term the reference holds unscaled is not taken for it: shares inside a program are often
        scaled regions of reference terms (a call's output divided by the ranks' count), and a
        call's outputs are not compared so at all."""
        wholes = [self._reference_whole(a) if self.claims else a for a, _ in parts]
        if len(set(wholes)) < len(wholes):  # two regions of one whole: no term-by-term comparison
            wholes = [a for a, _ in parts]
        same = self._ref_lins.get(frozenset(wholes))
        if same is not None:
            want = dict(zip(self.r.u[same].args, self.r.u[same].attrs[0]))
            wrong = [(a, c, want[whole]) for (a, c), whole in zip(parts, wholes) if want[whole] != c]
            if wrong:  # the plainest coefficient speaks for them all: a float's rounding leaves 2^-59s
                return min(wrong, key=lambda found: found[2].denominator)
        if len(parts) == 1 and self.r.in_reference(parts[0][0]) and parts[0][1] != 1:
            return parts[0][0], parts[0][1], Fraction(1)
        return None

    def _reference_whole(self, t: int) -> int:
        """`t`, or the reference term `t` is a region of."""
        if self.r.in_reference(t):
            return t
        root, _ = self.r.as_region(t)
        return root if self.r.in_reference(root) else t

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

    def _prescaled_share(self, rank: int, node: Node, expected: int) -> Finding | None:
        """A rank's output `node` that is k != 1 times the term it must equal, reached from its last
        computation through moves, collectives and a scaling by a constant (a gradient divided
        before its reduce-scatter, as Megatron's gradient_scaling_factor does): that constant is the
        wrong one, whatever the reduction after it (a SUM of shares each divided by the group's size
        is an average written by hand, not a reduce op to change)."""
        (base, have), (wanted, want) = self.r.common_factor(self.run.ranks[rank][node.id]), self.r.common_factor(expected)
        if base != wanted or have == want:
            return None
        scaling = self._tail_scaling(rank, node)
        if scaling is None:
            return None
        op, by = scaling
        factor = have / want
        return Finding(
            "discrepancy",
            "wrong scale",
            f"wrong scale (x{factor}): rank {rank}'s value is {factor} times the reference's; it is scaled by {by} "
            f"at {line_of(op)} on its way here",
            [(rank, op), (rank, node)],
            scale=factor,
            fix=f"scale by {by / factor} instead of {by} at {line_of(op)}",
        )

    def _scaled_whole(self, expected: dict[tuple[int, int], int]) -> Finding | None:
        """A rank's output that is k != 1 times the term it must equal: its layout is right, whatever
        a layout finding says about the ops before it (a gradient's view compared with another
        shape's in the reference). See `_unscaled_gradient`."""
        for (rank, index), wanted in expected.items():
            node = self.ranks[rank][self.ranks[rank].outputs[index]]
            (base, have), (whole, want) = self.r.common_factor(self.run.ranks[rank][node.id]), self.r.common_factor(wanted)
            found = self._unscaled_gradient(rank, node, have / want) if base == whole and have != want else None
            if found is not None:
                return found
        return None

    def _unscaled_gradient(self, rank: int, node: Node, factor: Fraction) -> Finding | None:
        """A gradient `node`, `factor` times the reference's, that comes from where it is computed
        through moves alone (no scaling, no collective), while the loss and another gradient agree
        (the backward's seed is right): the average over the ranks whose losses it sums is missing
        where it leaves for its parameter (an FSDP unshard's autograd Function left out, whose
        backward scales and reduces it). Named there, the line that read the parameter, then where
        it was computed."""
        graph, tail = self.ranks[rank], node
        while tail.op in LAYOUT_OPS - {"cat"}:
            tail = graph[tail.inputs[0]]
        computed = tail.loc is not None and tail.loc.backward and OPS[tail.op].kind not in ("leaf", "const", "collective")
        if not computed or not self.seed_holds():
            return None
        return Finding(
            "discrepancy",
            "wrong scale",
            f"wrong scale (x{factor}): rank {rank}'s value is {factor} times the reference's while the loss and another "
            f"gradient agree; nothing scales it on its way from `{tail.op}` at {line_of(tail)} to {value_name(node)} "
            f"at {line_of(node)}",
            [(rank, node), *([(rank, tail)] if tail is not node else [])],
            scale=factor,
            fix=f"scale {value_name(node)} by {1 / factor} at {line_of(node)} (the average over the ranks whose "
                f"losses it sums, as the reduction of a parameter's gradient does)",
        )

    def _tail_scaling(self, rank: int, node: Node) -> tuple[Node, Fraction] | None:
        """The last op multiplying (or dividing) by a constant on the way back from `node` through
        ops that only move one operand's elements or reduce over ranks, with the factor it applies."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        while OPS[node.op].kind == "collective" or node.op in LAYOUT_OPS - {"cat"} or node.op in ("mul", "div"):
            if node.op in ("mul", "div"):
                values = [self.r.full_value(terms[i]) for i in node.inputs]
                if len(values) != 2 or (values[0] is None) == (values[1] is None) or node.op == "div" and values[1] is None:
                    return None  # no constant factor (or nothing but constants)
                factor = factor_of(values[1] if values[1] is not None else values[0])
                if factor is None:
                    return None
                return node, factor ** (-1 if node.op == "div" else 1)
            node = graph[node.inputs[0]]
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
            fix=f"drop the `{node.op}` at {line_of(node)}: the value is already summed",
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
        term = "constant term" if isinstance(bad, tuple) else f"term {describe(self.r.u, bad, 2)}"
        return Finding(
            "discrepancy",
            "wrong scale",
            f"wrong scale: on rank {rank} the {term} of a sum reaching `{node.op}` has coefficient "
            f"{have[bad]} where the reference has {want[bad]}, while the other terms agree",
            [(rank, culprit), (rank, node)],
            fix=f"give the {term} the coefficient {want[bad]} at {line_of(culprit)}",
        )

    def _carrying(self, t: int, term: int, coefficient: Fraction) -> bool:
        """`t` sums the terms of one of the reference's sums and holds `term` with `coefficient`:
        where an output's miscounted term got its coefficient (the op combining the right terms with
        the wrong signs), not any earlier scaled value (a negation, a difference the reference
        writes another way)."""
        sum_ = self.r.u[t]
        return (
            self._scaled(t)
            and len(sum_.args) > 1 and frozenset(sum_.args) in self._ref_lins
            and dict(zip(sum_.args, sum_.attrs[0])).get(term) == coefficient
        )

    def _scaled(self, t: int) -> bool:
        term = self.r.u[t]
        return (
            term.op == "lin"
            and not self.r.in_reference(t)
            and any(c != 1 for c in term.attrs[0])
            and all(self.r.in_reference(a) for a in term.args)
        )


def factor_of(value: object) -> Fraction | None:
    """A constant operand of a product as the factor it scales by (a float read as the fraction it
    rounds), or None for no number or zero."""
    return Fraction(value).limit_denominator(1 << 20) if is_finite_number(value) and value != 0 else None


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


def _normalising(value: object) -> Fraction | None:
    """`value` as the factor 1/k (k > 1 a whole number) that a mean or a loss normalisation applies."""
    if not isinstance(value, (int, float, Fraction)) or isinstance(value, bool) or not 0 < value < 1:
        return None
    count = round(1 / value)
    return Fraction(1, count) if abs(1 / value - count) < 1e-9 * count else None
