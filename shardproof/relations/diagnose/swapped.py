"""Swapped operands: a division or subtraction written the other way round. The rank applies an op
to values that agree with the reference's and the values stop agreeing there; the same op with its
operands in the other order, replayed through the ops after it by the same rules, makes them agree
again (the evidence is the rules' own normal form, never a guess). A part of `Diagnoser`.

Three shapes of the same mistake, as a trace records them:
- `a / b` for `b / a`: a `div` whose swapped twin agrees (or makes an op after it agree: a
  softmax's `exp / sum` agrees only once its log is taken);
- `n / x` for `x / n` with `n` a number: torch records `reciprocal(x) * n`, whose twin `x / n`
  is a share scaled like the reference's; the reciprocal is where the values part;
- `b - a` for `a - b` feeding a nonlinear op (`exp(b - a)`): the difference itself is linear, so
  the op after it is where the values part; with its operand negated it agrees.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Iterator

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS, waits_for_peers
from shardproof.relations.diagnose.agreement import LAYOUT_OPS
from shardproof.relations.diagnose.finding import Finding
from shardproof.relations.diagnose.wrong_scale import factor_of
from shardproof.relations.execute import term_of
from shardproof.report.terms import describe, line_of, value_name

REPLAYED = 16  # ops after a swapped op replayed with its twin, at most (up to the next collective)


class SwappedOperands:
    def _swapped_operands(self, rank: int, chain: list[Node]) -> Finding | None:
        """The first op of the disagreeing chain that agrees with the reference (or makes an op
        after it agree) once the operands of a division or subtraction are put the other way round."""
        for node in chain:
            found = self._swapped_division(rank, node) or self._negated_operand(rank, node)
            if found is not None:
                return found
        return None

    def _agrees(self, t: int) -> bool:
        return self.grounded(t) or self.region_of_reference(t)

    def _agrees_after(self, rank: int, node: Node, twin: int) -> bool:
        """Whether `twin` in place of `node`'s value agrees, or makes an op after it agree."""
        return self._agrees(twin) or self._heals(rank, node, twin)

    def _heals(self, rank: int, node: Node, twin: int, limit: int = REPLAYED) -> bool:
        """Whether `twin` in place of `node`'s value makes an op after it agree whose value does not."""
        terms = self.run.ranks[rank]
        return any(self._agrees(t) and not self._agrees(terms[n.id])
                   for n, t in self._replayed(rank, node, twin, limit=limit))

    def _replayed(self, rank: int, node: Node, twin: int, until: int | None = None,
                  limit: int = REPLAYED) -> Iterator[tuple[Node, int]]:
        """The rank's ops after `node` (up to the op `until`) whose values change with `twin` in
        place of `node`'s, with their replayed values, in program order: up to the first such op
        that waits for peers (its value needs their replay too) or `limit` of them."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        replayed, changed = list(terms), {node.id}
        replayed[node.id] = twin
        for n in graph.nodes[node.id + 1:(len(graph.nodes) if until is None else until + 1)]:
            if not changed.intersection(n.inputs):
                continue
            if len(changed) > limit or waits_for_peers(n.op):
                return
            replayed[n.id] = term_of(self.r, n, replayed, rank, {})
            changed.add(n.id)
            yield n, replayed[n.id]

    def _swapped_division(self, rank: int, node: Node) -> Finding | None:
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        t = terms[node.id]
        if self._agrees(t):
            return None
        if node.op == "div" and len(node.inputs) == 2:
            a, b = (terms[i] for i in node.inputs)
            if self.r.full_value(a) is not None or not self._agrees(a) or not self._agrees(b):
                return None
            site, twin = node, self.r.build("div", (b, a), node.attrs, self.r.shape(t), self.r.u[t].dtype)
            numerator, denominator = a, b
        elif node.op == "reciprocal":  # n / x is recorded as reciprocal(x) * n
            x = terms[node.inputs[0]]
            scaled = self._scaled_by_number(rank, node)
            if scaled is None or self.r.full_value(x) is not None or not self._agrees(x):
                return None
            site, number = scaled
            twin = self.r.scale(x, 1 / number)
            numerator, denominator = self.r.const(("full", number), (), self.r.u[x].dtype), x
        else:
            return None
        if not self._agrees_after(rank, site, twin):
            return None
        what, by = describe(self.r.u, numerator, 2), describe(self.r.u, denominator, 2)
        return Finding(
            "discrepancy",
            "swapped operands",
            f"swapped operands: on rank {rank}, {value_name(site)} divides `{what}` by `{by}`; `{by}` divided by "
            f"`{what}` agrees with the reference: the division's operands are the other way round",
            [(rank, site)],
            op="div",
            fix=f"swap the operands of the division at {line_of(site)}",
        )

    def _scaled_by_number(self, rank: int, node: Node) -> tuple[Node, Fraction] | None:
        """The op multiplying `node`'s value by a number (n / x's `* n`), with that number."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        for n in graph.nodes[node.id + 1:]:
            if n.op != "mul" or node.id not in n.inputs or len(n.inputs) != 2:
                continue
            other = n.inputs[1] if n.inputs[0] == node.id else n.inputs[0]
            factor = factor_of(self.r.full_value(terms[other]))
            if factor is not None:
                return n, factor
        return None

    def _negated_operand(self, rank: int, node: Node) -> Finding | None:
        """A nonlinear op of one operand whose operand, negated, makes it agree: the difference
        feeding it subtracts the wrong way round. The culprit is the op that made the difference."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        t = terms[node.id]
        if len(node.inputs) != 1 or OPS[node.op].kind not in ("unary", "pointwise") or node.op == "neg" or self._agrees(t):
            return None
        operand = terms[node.inputs[0]]
        if self.r.full_value(operand) is not None or not self._agrees(operand):
            return None
        negated = self.r.lin([(operand, Fraction(-1))])
        if not self._agrees_after(rank, node, self.r.build(node.op, (negated,), node.attrs, self.r.shape(t), self.r.u[t].dtype)):
            return None
        difference = graph[node.inputs[0]]
        while difference.op in LAYOUT_OPS - {"cat"} and graph[difference.inputs[0]].op not in ("leaf", "const"):
            difference = graph[difference.inputs[0]]
        return Finding(
            "discrepancy",
            "swapped operands",
            f"swapped operands: on rank {rank}, `{node.op}` at {line_of(node)} takes `{describe(self.r.u, operand, 2)}`, "
            f"whose negation agrees with the reference: the subtraction making {value_name(difference)} has its "
            "operands the other way round",
            [(rank, difference), (rank, node)],
            op=node.op,
            fix=f"swap the operands of the subtraction at {line_of(difference)}",
        )

    def _swapped_subtraction(self, rank: int, output: Node, factor: Fraction) -> Finding | None:
        """An output with the reference's terms but the wrong signs (`factor` times its value, as
        `_miscounted` compares them), put right by swapping the operands of a subtraction of
        agreeing values before it (`target - log(sum)` for `log(sum) - target`: where only sums and
        scalings follow, no value disagrees before the output). The earliest subtraction whose
        operands, swapped and replayed to the output, make it the value it must equal (the
        reference's, or a region of it, where it names none) is where the signs went wrong."""
        graph, terms = self.ranks[rank], self.run.ranks[rank]
        wanted = next((w for (r, i), w in self._expected.items() if r == rank and graph.outputs[i] == output.id), None)
        for node in graph.ancestors(output):
            operands = _subtracted(graph, node)
            if operands is None or not all(self._agrees(terms[n.id]) for n in operands):
                continue
            twin = self.r.lin([(terms[node.id], Fraction(-1))])
            at_output = twin if node is output else next(
                (t for n, t in self._replayed(rank, node, twin, output.id) if n.id == output.id), None)
            if at_output is None or not (at_output == wanted if wanted is not None else self.region_of_reference(at_output)):
                continue
            first, second = (describe(self.r.u, terms[n.id], 2) for n in operands)
            return Finding(
                "discrepancy",
                "wrong scale",
                f"wrong scale (x{factor}): {factor} times the reference value: on rank {rank}, {value_name(node)} at "
                f"{line_of(node)} subtracts `{second}` from `{first}`; the other way round, {value_name(output)} "
                "equals the reference's",
                [(rank, node), (rank, output)],
                op=node.op,
                scale=factor,
                fix=f"swap the operands of the subtraction at {line_of(node)}",
            )
        return None


def _subtracted(graph: Graph, node: Node) -> tuple[Node, Node] | None:
    """(a, b) of a subtraction `a - b`, which a trace records as `a + (-b)`; None for another op."""
    if node.op != "add" or len(node.inputs) != 2:
        return None
    a, b = (graph[i] for i in node.inputs)
    if b.op != "neg" and a.op == "neg":
        a, b = b, a
    return (a, graph[b.inputs[0]]) if b.op == "neg" and a.op != "neg" else None
