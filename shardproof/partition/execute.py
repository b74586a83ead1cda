"""Symbolic execution that proves each distinct repeated call once (layer memoization).

The reference runs first; each of its calls becomes an opaque term `call(args)` with attrs
(template, output index): output i of that template applied to those arguments. The ranks then run
in lock-step. When every rank reaches its k-th call, the reference's k-th call and the ranks' are
proven together in a small universe of their own, over the call's canonical boundary (see
`boundary`): the reference's arguments are fresh leaves, so the small proof holds whatever they are.
Each rank's outputs, now written over the reference call's outputs and arguments, are carried back
with those leaves replaced by the reference's actual arguments and its outputs by the opaque terms.
The outcome is the same universe a full execution would build, up to the opaque terms: the caller
compares outputs as usual.

A boundary already proven is not proven again: 125 identical layers share one small proof; a call
of a shape proven before (see `call_shapes`) does not even read its boundary, and a rank's terms
are built only when read (`Terms`), so its arguments are never built. Calls that do not line up
between the reference and the ranks raise NotPartitioned.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterator

from shardproof.ir.graph import BOUND_LEAF_PREFIX, Graph
from shardproof.ir.ops import waits_for_peers
from shardproof.partition.boundary import Boundary, NotPartitioned, build_entries, read_boundary, transplant
from shardproof.partition.call_shapes import Ops, argument_ops, call_shape
from shardproof.partition.gradients import over_reference_gradients
from shardproof.partition.structure import derived, structural
from shardproof.partition.templates import Template, expand
from shardproof.relations.diagnose import grounded
from shardproof.relations.execute import CollectiveMismatch, Execution, resolve_collective, term_of
from shardproof.relations.messages import Mailbox
from shardproof.relations.rules import Rules

Bindings = dict[str, int]  # leaf name -> term: a template's `arg:i` leaves, bound reference outputs


class Unmatched(Exception):
    """The `index`-th call's outputs on some rank do not agree with the reference's, or the ranks
    issue different collectives inside it."""

    def __init__(self, index: int) -> None:
        super().__init__(f"call {index} parts ways with the reference")
        self.index = index


@dataclass(frozen=True)
class Instance:
    """One call: the nodes of its outputs (consecutive, by output index) and of its inputs."""

    template: Template
    module: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]


def instances(graph: Graph) -> list[Instance]:
    found = []
    for outputs in structural(graph, "calls", _call_outputs):
        first = graph.nodes[outputs[0]]
        template, _, module = first.attrs
        found.append(Instance(template, module, first.inputs, outputs))
    return found


def _call_outputs(graph: Graph) -> list[tuple[int, ...]]:
    """The output nodes of each call, in order."""
    found: list[tuple[int, ...]] = []
    for node in graph.nodes:
        if node.op == "call":
            if node.attrs[1] == 0:
                found.append((node.id,))
            else:
                found[-1] += (node.id,)
    return found


def aligned(reference: Graph, ranks: list[Graph], expand_call: int | None = None) -> tuple[Graph, list[Graph]]:
    """The graphs with only those calls kept that every graph makes, to the same modules (by
    qualified name and occurrence) in the same order, except the `expand_call`-th of them; other
    calls expanded into plain ops."""
    graphs = [reference, *ranks]
    sites = [structural(g, "sites", _sites) for g in graphs]
    common = set(sites[0]).intersection(*sites[1:])
    orders = {tuple(s for s in graph_sites if s in common) for graph_sites in sites}
    if len(orders) != 1:
        common = set()
    elif expand_call is not None:
        common.discard(orders.pop()[expand_call])
    kept = []
    for graph, graph_sites in zip(graphs, sites):
        calls = structural(graph, "calls", _call_outputs)
        if all(site in common for site in graph_sites):
            kept.append(graph)
            continue
        keep_ids = frozenset(o for outputs, site in zip(calls, graph_sites) if site in common for o in outputs)
        expanded = expand(graph, lambda node: node.id in keep_ids)
        if expanded is not graph:
            expanded.structure = derived(graph.structure, ("kept", keep_ids))
        kept.append(expanded)
    return kept[0], kept[1:]


def through_call(graph: Graph, index: int) -> Graph:
    """The graph up to its `index`-th call, whose outputs become the graph's."""
    call = instances(graph)[index]
    return Graph(graph.nodes[: call.outputs[-1] + 1], list(call.outputs), graph.rank, derived(graph.structure, ("through", index)))


def _sites(graph: Graph) -> list[tuple[str, int]]:
    """(module, occurrence) of each call: the second call of one module is (name, 1)."""
    seen: dict[str, int] = {}
    out = []
    for inst in instances(graph):
        out.append((inst.module, seen.get(inst.module, 0)))
        seen[inst.module] = out[-1][1] + 1
    return out


@dataclass
class CallProof:
    """A proven boundary: its universe, the terms standing for the boundary's leaves, the
    reference call's outputs, and each rank's outputs there."""

    rules: Rules
    leaves: list[int]  # term of each boundary entry that is a leaf (cut or free), in entry order
    reference_outputs: list[int]
    rank_outputs: list[list[int]]


@dataclass
class ReferenceCall:
    """The reference's side of one call: its arguments' and outputs' terms, and what computes them."""

    instance: Instance
    args: list[int]
    outputs: list[int]
    argument_ops: Ops | None
    terms: list[int]  # the reference's terms by node


@dataclass
class _Answer:
    """A proof found by a call's shape, and which atom each of its free leaves is."""

    proof: CallProof
    frees: list[int]


@dataclass
class CallProofs:
    """Proofs by boundary (and by call shape, see call_shapes); `proven` distinct boundaries,
    `reused` calls answered from them."""

    proofs: dict[Hashable, CallProof] = field(default_factory=dict)
    shapes: dict[Hashable, _Answer | None] = field(default_factory=dict)  # None: a free leaf is no atom
    proven: int = 0  # of the programs' own calls; calls inside templates are part of proving those
    reused: int = 0
    _nested: int = 0  # proofs of calls in progress

    def outputs(self, rules: Rules, reference: ReferenceCall, ranks: list[tuple[Graph, Instance, Terms]]) -> list[list[int]]:
        """Each rank's output terms for one call, in `rules`' universe."""
        templates = (reference.instance.template, tuple(instance.template for _, instance, _ in ranks))
        sides = [(reference.argument_ops, reference.terms)] + [(argument_ops(g, i.inputs), t) for g, i, t in ranks]
        shape = call_shape(rules, sides, (templates, _pattern(reference.args)))
        answer = None if shape is None else self.shapes.get(shape.key)
        if answer is not None:
            self._count(reused=True)
            return _carried(rules, answer.proof, reference, [shape.atoms[i] for i in answer.frees])
        args = [[terms[i] for i in instance.inputs] for _, instance, terms in ranks]
        boundary = read_boundary(rules.u, reference.args, args, rules.in_reference)
        key = boundary.key(templates)
        proof = self.proofs.get(key)
        self._count(reused=proof is not None)
        if proof is None:
            self._nested += 1
            try:
                proof = self.proofs[key] = prove_call(boundary, reference.instance.template, [i.template for _, i, _ in ranks], self)
            finally:
                self._nested -= 1
        if shape is not None and shape.key not in self.shapes:
            frees = [shape.atoms.index(t) for t in boundary.frees if t in shape.atoms]
            self.shapes[shape.key] = _Answer(proof, frees) if len(frees) == len(boundary.frees) else None
        return _carried(rules, proof, reference, boundary.frees)


    def _count(self, reused: bool) -> None:
        if not self._nested:
            self.reused += reused
            self.proven += not reused


def _carried(rules: Rules, proof: CallProof, reference: ReferenceCall, frees: list[int]) -> list[list[int]]:
    """The proof's rank outputs in `rules`' universe: its cut leaves are the reference's arguments,
    its free leaves `frees`, its reference outputs the reference call's."""
    substitution = dict(zip(proof.leaves, list(dict.fromkeys(reference.args)) + frees))
    substitution.update(zip(proof.reference_outputs, reference.outputs))
    # all ranks at once: what they share (a replicated output, the reference's terms) is copied once
    copied = iter(transplant(proof.rules.u, rules, [t for outs in proof.rank_outputs for t in outs], substitution))
    return [[next(copied) for _ in outs] for outs in proof.rank_outputs]


def _pattern(terms: list[int]) -> tuple[int, ...]:
    """Which of `terms` are the same term."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(t, len(first)) for t in terms)


def prove_call(boundary: Boundary, reference: Template, ranks: list[Template], proofs: CallProofs) -> CallProof:
    """Run the reference template and the rank templates over the boundary, in a universe of their
    own. Calls inside the templates (a decoder layer's attention and MLP) are proven as calls, with
    `proofs`: a layer whose parts were proven costs its own ops; where they do not line up or
    agree, the templates are expanded."""
    try:
        return _over_boundary(boundary, reference, ranks, lambda t: t.graph, proofs)
    except (NotPartitioned, Unmatched):
        return _over_boundary(boundary, reference, ranks, Template.expanded, CallProofs())


def _over_boundary(
    boundary: Boundary, reference: Template, ranks: list[Template], graph_of: Callable[[Template], Graph], proofs: CallProofs
) -> CallProof:
    rules = Rules()
    terms: list[int] = []
    first_rank_entry = len(boundary.cuts)  # cut entries come first: the reference's arguments
    build_entries(rules, boundary.entries, terms, first_rank_entry)
    ref_graph, graphs = aligned(graph_of(reference), [graph_of(t) for t in ranks])
    ref_terms = run_reference(rules, ref_graph, _bindings(boundary.reference_args, terms))
    build_entries(rules, boundary.entries, terms)
    bound = [_bindings(args, terms) for args in boundary.rank_args]
    rank_terms = run_ranks(rules, graphs, bound, reference_calls(ref_graph, ref_terms), proofs)
    leaves = [terms[i] for i, entry in enumerate(boundary.entries) if entry[0] == "cut"]
    leaves += [terms[i] for i, entry in enumerate(boundary.entries) if entry[0] == "free"]
    ref_outputs = [ref_terms[i] for i in ref_graph.outputs]
    frees = frozenset(leaves[len(boundary.cuts) :])
    rank_outputs = [
        over_reference_gradients(rules, boundary, (reference, ref_outputs), (template, r, [terms_r[i] for i in g.outputs]), frees)
        for r, (template, g, terms_r) in enumerate(zip(ranks, graphs, rank_terms))
    ]
    return CallProof(rules, leaves, ref_outputs, rank_outputs)


def reference_calls(reference: Graph, terms: list[int]) -> list[ReferenceCall]:
    return [
        ReferenceCall(c, [terms[i] for i in c.inputs], [terms[o] for o in c.outputs], argument_ops(reference, c.inputs), terms)
        for c in instances(reference)
    ]


def _bindings(entries: tuple[int, ...], terms: list[int]) -> Bindings:
    return {f"arg:{i}": terms[e] for i, e in enumerate(entries)}


OnCall = Callable[[int, int], None]  # (calls resolved, calls in all)


def execute_with_calls(
    reference: Graph, ranks: list[Graph], proofs: CallProofs, on_call: OnCall = lambda done, total: None
) -> Execution:
    """Execute graphs whose calls line up (see `aligned`), proving each distinct call boundary once."""
    ref_calls = instances(reference)
    if any(len(instances(g)) != len(ref_calls) for g in ranks):
        raise NotPartitioned("the ranks make other module calls than the reference")
    rules = Rules()
    ref_terms = run_reference(rules, reference, {})
    bound = {f"{BOUND_LEAF_PREFIX}{i}": ref_terms[out] for i, out in enumerate(reference.outputs)}
    calls = reference_calls(reference, ref_terms)
    return Execution(rules, ref_terms, run_ranks(rules, ranks, [bound for _ in ranks], calls, proofs, on_call))


def run_reference(rules: Rules, graph: Graph, bound: Bindings) -> list[int]:
    """The reference's terms (calls opaque); afterwards the universe's terms so far count as the reference's."""
    terms: list[int] = []
    for node in graph.nodes:
        if node.op == "call":
            terms.append(rules.literal("call", tuple(terms[i] for i in node.inputs), node.attrs, node.shape, node.dtype))
        else:
            terms.append(term_of(rules, node, terms, graph.rank, bound))
    rules.reference_size = len(rules.u)
    return terms


def run_ranks(
    rules: Rules,
    graphs: list[Graph],
    bound: list[Bindings],
    ref_calls: list[ReferenceCall],
    proofs: CallProofs,
    on_call: OnCall = lambda done, total: None,
) -> list[Terms]:
    """The ranks in lock-step: to the next collective or call, then that collective for its group,
    or the next call for every rank at once. Unmatched once a call's outputs on some rank stop
    agreeing with the reference (not built from its values by layout and linear structure): what
    follows depends on them, and is better diagnosed where it starts."""
    leaves: dict[int, dict[str, int]] = {}  # by bindings: ranks bound alike share their leaves' terms
    terms = [Terms(rules, graph, bindings, leaves.setdefault(id(bindings), {})) for graph, bindings in zip(graphs, bound)]
    agreeing: dict[int, bool] = {}
    cursors = [0] * len(graphs)
    calls = [instances(g) for g in graphs] if ref_calls else []
    done = 0  # calls resolved so far (the same count on every rank)
    mailbox = Mailbox()
    while True:
        for r, graph in enumerate(graphs):
            cursors[r] = _next_sync(graph, cursors[r])
            terms[r].reach(cursors[r])
        pending = [r for r, g in enumerate(graphs) if cursors[r] < len(g.nodes)]
        if not pending:
            mailbox.check_delivered()
            return terms
        at_collective = [r for r in pending if graphs[r].nodes[cursors[r]].op != "call"]
        if at_collective:
            before = list(cursors)
            resolve_collective(rules, graphs, terms, cursors, at_collective, mailbox)
            if cursors == before:  # never expected: a collective resolved always moves its group on
                raise NotPartitioned("no collective could be resolved")
            continue
        if len(pending) != len(graphs) or done >= len(ref_calls):
            raise NotPartitioned("the ranks reach module calls at different points")
        here = [calls[r][done] for r in range(len(graphs))]
        if any(inst.outputs != tuple(range(cursors[r], cursors[r] + len(inst.outputs))) for r, inst in enumerate(here)):
            raise NotPartitioned("a call's outputs are not consecutive")
        try:
            outputs = proofs.outputs(rules, ref_calls[done], [(graphs[r], inst, terms[r]) for r, inst in enumerate(here)])
        except CollectiveMismatch as mismatch:
            raise Unmatched(done) from mismatch
        if not all(grounded(rules, t, agreeing) for outs in outputs for t in outs):
            raise Unmatched(done)
        for r, outs in enumerate(outputs):
            terms[r].extend(outs)
            cursors[r] += len(outs)
        done += 1
        on_call(done, len(ref_calls))


def _next_sync(graph: Graph, start: int) -> int:
    syncs = structural(graph, "syncs", _syncs)
    return syncs[bisect_left(syncs, start)]


def _syncs(graph: Graph) -> list[int]:
    """Where a rank waits for the others (a call, a collective, a message), then the end."""
    return [n.id for n in graph.nodes if n.op == "call" or waits_for_peers(n.op)] + [len(graph.nodes)]


class Terms:
    """A rank's terms, node by node; a node's term is built when first read (its inputs first).

    A rank's loader cuts every layer's weights, but a call answered from the proof of an earlier
    one with the same shape (`CallProofs.outputs`) never reads its arguments: at 64 ranks of 126
    layers, building them was most of the proof."""

    def __init__(self, rules: Rules, graph: Graph, bound: Bindings, leaves: dict[str, int]):
        self.rules, self.graph, self.bound = rules, graph, bound
        self.leaves = leaves  # leaf name -> term, shared with the ranks bound alike
        self.built: list[int | None] = []

    def __len__(self) -> int:
        return len(self.built)

    def __getitem__(self, index: int) -> int:
        term = self.built[index]
        return self._build(index) if term is None else term

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(len(self.built)))

    def reach(self, stop: int) -> None:
        """Nodes up to `stop` are due; built when read."""
        self.built.extend([None] * (stop - len(self.built)))

    def append(self, term: int) -> None:
        self.built.append(term)

    def extend(self, terms: list[int]) -> None:
        self.built.extend(terms)

    def _build(self, index: int) -> int:
        """Build the node and every unbuilt node it depends on, in program order (the order an
        eager run builds them in: where two normal forms are true, rules may prefer one that
        already exists)."""
        built, nodes = self.built, self.graph.nodes
        due, stack = {index}, [index]
        while stack:
            for j in nodes[stack.pop()].inputs:
                if built[j] is None and j not in due:
                    due.add(j)
                    stack.append(j)
        for i in sorted(due):
            node = nodes[i]
            if node.op != "leaf":
                built[i] = term_of(self.rules, node, built, self.graph.rank, self.bound)  # type: ignore[arg-type]
                continue
            name = node.attrs[0]
            if name not in self.leaves:
                self.leaves[name] = term_of(self.rules, node, built, self.graph.rank, self.bound)  # type: ignore[arg-type]
            built[i] = self.leaves[name]
        return built[index]  # type: ignore[return-value]
