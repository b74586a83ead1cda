"""A backward step a rank skips: the backward of one of its forward lines runs but computes
nothing, where the reference's backward of the line that computes the same forward values does.

DTensor's `loss_parallel()` is the model: its log_softmax backward handler returns the gradient as
is, because its nll_loss backward already folds the log_softmax backward in. Any other consumer of
the log-probs then misses `- softmax * sum(grad)`. The first op that disagrees is downstream (the
sum of the gradients the log-probs receive), so the step is looked for by line: a forward line
whose backward on the rank only moves data (or emits nothing; the lowering marks such a step, see
`Lowerer.mark_silent_steps`), while the reference's backward of the same values computes.
"""

from __future__ import annotations

from shardproof.ir.graph import Graph, Node
from shardproof.ir.ops import OPS
from shardproof.relations.execute import Execution

MOVING = {"leaf", "const", "layout", "collective", "p2p"}  # op kinds that compute no new values
Line = tuple[str, int]


def skipped_backward(run: Execution, reference: Graph, graph: Graph, chain: list[Node]) -> tuple[Node, Node, str] | None:
    """(the rank's op at the skipped step, the reference's first op of that step, the message),
    or None. `chain`: the rank's disagreeing ops in execution order; they start in the backward."""
    if not chain or chain[0].loc is None or not chain[0].loc.backward:
        return None
    backward = [n for n in graph.nodes if n.loc is not None and n.loc.backward]
    seen = {_line(n) for n in backward if _computes(n)}  # lines whose backward computes on this rank
    for node in backward:
        line = _line(node)
        if line in seen:
            continue
        seen.add(line)
        lines = _reference_lines(run, reference, graph, line)
        steps = [n for n in reference.nodes if n.loc is not None and n.loc.backward and _computes(n) and _line(n) in lines]
        if steps:
            ops = ", ".join(f"`{op}`" for op in sorted({n.op for n in steps}))
            message = (f"missing backward step: on rank {graph.rank} the backward of line {line[1]} computes nothing "
                       f"(it only passes its gradient on), where the reference's backward of the same values "
                       f"computes {ops}")
            return node, steps[0], message
    return None


def _reference_lines(run: Execution, reference: Graph, graph: Graph, line: Line) -> set[Line]:
    """The reference's forward lines that compute the values (or the whole tensors of the regions)
    this rank computes at forward line `line`."""
    rules, terms = run.rules, run.ranks[graph.rank]
    wanted = {rules.as_region(terms[n.id])[0] for n in graph.nodes if _line(n) == line and not n.loc.backward and _computes(n)}
    return {_line(n) for n in reference.nodes if n.loc is not None and not n.loc.backward and _computes(n)
            and run.reference[n.id] in wanted}


def _line(node: Node) -> Line | None:
    return None if node.loc is None else (node.loc.file, node.loc.line)


def _computes(node: Node) -> bool:
    return OPS[node.op].kind not in MOVING
