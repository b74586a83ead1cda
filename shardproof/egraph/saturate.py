"""Equality saturation: proves equalities that the normal form of `relations.rules` misses.

The rules give most values one term, but they neither reorder products nor expand them over
sums, so `mul(mul(a, b), c)` and `mul(a, mul(b, c))` keep different ids. Here the sub-DAGs of two
terms go into an egglog e-graph, ring identities over the reals are applied for a bounded number
of iterations, and the roots are compared: True is a proof, False only means "not found".

Every term is `(Node id)`, unioned with its structure over its children's nodes. The rules only
expand (products over sums, linear ops over sums, scalars outwards) and collect coefficients, so
the two sides meet in their expanded form without the blow-up of factoring rules. Sound because:
- congruence only holds for functions of their arguments' values, and `piece` is not one (its
  meaning depends on how its argument was computed), so a piece is an atom like a leaf;
- opaque ops are keyed by (op, attrs, shape, dtype), since e.g. a view's target is its shape;
- the algebra is modelled on float terms only (integer `lin` truncates, boolean sums saturate);
- every `Add` joins operands of one shape, so dropping a zero-scaled operand keeps the shape.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any, Iterator

from egglog.bindings import EggSmolError, EGraph

from shardproof.relations.rules import FLOAT_DTYPES
from shardproof.relations.universe import Term, Universe

ATOMS = {"leaf", "full", "const", "piece"}
LINEAR_OPS = {"sum", "slice", "view", "permute", "bcast", "repeat"}
MATCH_LIMIT = 10_000  # back-off: a rule matching more often sits out, so growth stays bounded
BATCH = 100  # commands per parse: one huge program parses slowly, one per call pays overhead

RULES = """
(datatype* (E (Node i64) (Add E E) (Scale BigRat E) (Mul E E) (MatMul E E) (App i64 Args))
           (Args (Nil) (Cons E Args)))
(relation Linear (i64))
(relation Proven ())
(ruleset algebra)
(rewrite (Add x y) (Add y x) :ruleset algebra)
(birewrite (Add (Add x y) z) (Add x (Add y z)) :ruleset algebra)
(rewrite (Mul x y) (Mul y x) :ruleset algebra)
(birewrite (Mul (Mul x y) z) (Mul x (Mul y z)) :ruleset algebra)
(rewrite (Mul (Add x y) z) (Add (Mul x z) (Mul y z)) :ruleset algebra)
(rewrite (Mul (Scale c x) y) (Scale c (Mul x y)) :ruleset algebra)
(rewrite (MatMul (Add x y) w) (Add (MatMul x w) (MatMul y w)) :ruleset algebra)
(rewrite (MatMul w (Add x y)) (Add (MatMul w x) (MatMul w y)) :ruleset algebra)
(rewrite (MatMul (Scale c x) w) (Scale c (MatMul x w)) :ruleset algebra)
(rewrite (MatMul w (Scale c x)) (Scale c (MatMul w x)) :ruleset algebra)
(rewrite (Scale c (Add x y)) (Add (Scale c x) (Scale c y)) :ruleset algebra)
(rewrite (Scale c (Scale d x)) (Scale (* c d) x) :ruleset algebra)
(rewrite (Add x x) (Scale (bigrat (bigint 2) (bigint 1)) x) :ruleset algebra)
(rewrite (Add (Scale c x) x) (Scale (+ c (bigrat (bigint 1) (bigint 1))) x) :ruleset algebra)
(rewrite (Add (Scale c x) (Scale d x)) (Scale (+ c d) x) :ruleset algebra)
(rule ((= e (Scale c x)) (= c (bigrat (bigint 1) (bigint 1)))) ((union e x)) :ruleset algebra)
(rule ((= e (Add (Scale c x) y)) (= c (bigrat (bigint 0) (bigint 1)))) ((union e y)) :ruleset algebra)
(rule ((= e (App k (Cons (Add x y) (Nil)))) (Linear k))
      ((union e (Add (App k (Cons x (Nil))) (App k (Cons y (Nil)))))) :ruleset algebra)
(rule ((= e (App k (Cons (Scale c x) (Nil)))) (Linear k))
      ((union e (Scale c (App k (Cons x (Nil)))))) :ruleset algebra)
"""


def prove_equal(universe: Universe, a: int, b: int, max_nodes: int = 5000, iterations: int = 8) -> bool:
    """True only if saturation proves terms `a` and `b` equal; False if unproven or too big."""
    if a == b:
        return True
    nodes = _sub_dag(universe, (a, b), max_nodes)
    if nodes is None:
        return False
    egraph = EGraph()
    _run(egraph, [RULES])
    _run(egraph, list(_declarations(universe, nodes)))
    goal = f"(= (Node {a}) (Node {b}))"
    _run(egraph, [f"(rule ({goal}) ((Proven)) :ruleset algebra)", _schedule(iterations)])
    try:
        _run(egraph, [f"(check {goal})"])
    except EggSmolError:
        return False
    return True


def _schedule(iterations: int) -> str:
    """Back-off bounds each iteration's growth; stop as soon as the goal holds."""
    scheduler = f"(let-scheduler slow (back-off :match-limit {MATCH_LIMIT}))"
    return f"(run-schedule {scheduler} (repeat {iterations} (run-with slow algebra :until (Proven))))"


def _sub_dag(universe: Universe, roots: tuple[int, ...], max_nodes: int) -> list[int] | None:
    """The ids below `roots` (not below atoms), children first; None past `max_nodes`."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if len(seen) > max_nodes:
            return None
        if universe[t].op not in ATOMS:
            stack.extend(universe[t].args)
    return sorted(seen)  # arguments always have smaller ids than their term


def _declarations(universe: Universe, nodes: list[int]) -> Iterator[str]:
    """One `union` per structured term, plus `Linear` facts for the keys of linear ops."""
    keys: dict[tuple[Any, ...], int] = {}
    for t in nodes:
        term = universe[t]
        if term.op in ATOMS or not term.args:
            continue
        structure = _algebra(universe, term)
        if structure is None:
            key_of = (term.op, term.attrs, term.shape, term.dtype)
            key = keys.get(key_of)
            if key is None:
                key = keys[key_of] = len(keys)
                if term.op in LINEAR_OPS and len(term.args) == 1:
                    yield f"(Linear {key})"
            structure = f"(App {key} {_cons(term.args)})"
        yield f"(union (Node {t}) {structure})"


def _algebra(universe: Universe, term: Term) -> str | None:
    """The term over Add/Scale/Mul/MatMul if its op's algebra is modelled, else None (opaque)."""
    if term.dtype not in FLOAT_DTYPES:
        return None
    if term.op == "lin" and all(universe[x].shape == term.shape for x in term.args):
        return _sum([_scaled(x, c) for x, c in zip(term.args, term.attrs[0])])
    if term.op in ("mul", "matmul") and term.attrs == () and len(term.args) == 2:
        x, y = term.args
        return f"({'Mul' if term.op == 'mul' else 'MatMul'} (Node {x}) (Node {y}))"
    return None


def _scaled(x: int, c: Fraction) -> str:
    if c == 1:
        return f"(Node {x})"
    return f'(Scale (bigrat (from-string "{c.numerator}") (from-string "{c.denominator}")) (Node {x}))'


def _sum(parts: list[str]) -> str:
    out = parts[-1]
    for part in reversed(parts[:-1]):
        out = f"(Add {part} {out})"
    return out


def _cons(args: tuple[int, ...]) -> str:
    out = "(Nil)"
    for x in reversed(args):
        out = f"(Cons (Node {x}) {out})"
    return out


def _run(egraph: EGraph, commands: list[str]) -> list[Any]:
    outputs = []
    for i in range(0, len(commands), BATCH):
        outputs.extend(egraph.run_program(*egraph.parse_program("\n".join(commands[i : i + BATCH]))))
    return outputs

