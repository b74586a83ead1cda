"""Equality saturation: proves equalities that the normal form of `relations.rules` misses.

The rules give most values one term, but they neither reorder products nor expand them over
sums, so `mul(mul(a, b), c)` and `mul(a, mul(b, c))` keep different ids. Here the sub-DAGs of two
terms go into an egglog e-graph, ring identities over the reals are applied for a bounded number
of iterations, and the roots are compared: True is a proof, False only means "not found".

Every term is `(Node id)`, unioned with its structure over its children's nodes. Besides
commutativity and associativity, the rules only expand (products and linear ops over sums, scalars
outwards) and collect coefficients: the two sides meet in their expanded form without the blow-up
of factoring rules. Sound because:
- congruence only holds for functions of their arguments' values, and `piece` (or `max_piece`) is
  not one (its meaning depends on how its argument was computed), so a piece is an atom like a leaf;
- opaque ops are keyed by (op, attrs, shape, dtype), since e.g. a view's target is its shape;
- the algebra is modelled on float terms only (integer `lin` truncates, boolean sums saturate);
- every `Add` joins operands of one shape, so dropping a zero-scaled operand keeps the shape.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import tempfile
from collections import defaultdict
from fractions import Fraction
from types import ModuleType
from typing import TYPE_CHECKING, Any

from shardproof.relations.rules import FLOAT_DTYPES
from shardproof.relations.universe import Term, Universe

if TYPE_CHECKING:
    from egglog.bindings import EGraph

ATOMS = {"leaf", "full", "const", "piece", "max_piece", "arg_piece", "top_piece"}
LINEAR_OPS = {"sum", "slice", "view", "permute", "bcast", "repeat"}
MATCH_LIMIT = 20_000  # back-off: a rule matching more often sits out, so growth stays bounded

# Terms arrive as relation rows read from files, turned into e-nodes by the `load` rules in one
# pass: a top-level command per term costs ~20 us (a `union`: more as the e-graph grows), a row ~3 us.
RULES = """
(datatype* (E (Node i64) (Add E E) (Scale BigRat E) (Mul E E) (MatMul E E) (App i64 Args))
           (Args (List i64) (Nil) (Cons E Args)))
(relation AddR (i64 i64 i64))
(relation ScaleR (i64 String String i64))
(relation MulR (i64 i64 i64))
(relation MatMulR (i64 i64 i64))
(relation AppR (i64 i64 i64))
(relation ArgR (i64 i64 i64))
(relation Linear (i64))
(relation Proven ())
(ruleset load)
(rule ((AddR t x y)) ((union (Node t) (Add (Node x) (Node y)))) :ruleset load)
(rule ((ScaleR t n d x)) ((union (Node t) (Scale (bigrat (from-string n) (from-string d)) (Node x)))) :ruleset load)
(rule ((MulR t x y)) ((union (Node t) (Mul (Node x) (Node y)))) :ruleset load)
(rule ((MatMulR t x y)) ((union (Node t) (MatMul (Node x) (Node y)))) :ruleset load)
(rule ((AppR t k l)) ((union (Node t) (App k (List l)))) :ruleset load)
(rule ((ArgR l x rest)) ((union (List l) (Cons (Node x) (List rest)))) :ruleset load)
(union (List 0) (Nil))
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
    bindings = _engine()
    EggSmolError, EGraph = bindings.EggSmolError, bindings.EGraph  # noqa: N806

    nodes = _sub_dag(universe, (a, b), max_nodes)
    if nodes is None:
        return False
    with tempfile.TemporaryDirectory() as folder:
        egraph = EGraph(fact_directory=folder)
        _run(egraph, RULES)
        _load(egraph, folder, _Export(universe, nodes).rows)
    goal = f"(= (Node {a}) (Node {b}))"
    _run(egraph, f"(rule ({goal}) ((Proven)) :ruleset algebra)\n{_schedule(iterations)}")
    try:
        _run(egraph, f"(check {goal})")
    except EggSmolError:
        return False
    return True


def _engine() -> ModuleType:
    """egglog's engine (`egglog.bindings`, its Rust extension) without the package around it,
    whose Python front end imports black, graphviz and opentelemetry (1-1.5 s, most of a warm
    run's proof of a tiny model). Loaded when first needed, not with this module: it starts a
    thread pool, which a process forked afterwards (the warm server's workers,
    shardproof/serve.py) would wait on forever."""
    loaded = sys.modules.get(_ENGINE)
    if loaded is not None:
        return loaded
    package = importlib.util.find_spec("egglog")
    folders = package.submodule_search_locations if package is not None else None
    found = importlib.machinery.PathFinder.find_spec("bindings", list(folders or []))
    if found is None or found.origin is None:
        raise ImportError("egglog's bindings are not installed (pip install egglog)")
    spec = importlib.util.spec_from_file_location(_ENGINE, found.origin)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[_ENGINE] = module  # `import egglog` later finds its bindings loaded
    return module


_ENGINE = "egglog.bindings"


def _load(egraph: EGraph, folder: str, rows: dict[str, list[tuple[Any, ...]]]) -> None:
    """Write each relation's rows as a TSV file, read them all, and build the e-nodes."""
    commands = []
    for relation, table in rows.items():
        with open(os.path.join(folder, relation), "w") as f:
            f.writelines("\t".join(map(str, row)) + "\n" for row in table)
        commands.append(f'(input {relation} "{relation}")')
    _run(egraph, "\n".join([*commands, "(run load 1)"]))


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


class _Export:
    """The rows describing each term; the parts a term is built of get fresh negative ids."""

    def __init__(self, universe: Universe, nodes: list[int]) -> None:
        self.universe = universe
        self.rows: dict[str, list[tuple[Any, ...]]] = defaultdict(list)
        self.keys: dict[tuple[Any, ...], int] = {}  # opaque (op, attrs, shape, dtype) -> App key
        self.last_id = 0  # also list id 0: the empty argument list
        for t in nodes:
            self.term(t)

    def fresh(self) -> int:
        self.last_id -= 1
        return self.last_id

    def term(self, t: int) -> None:
        term = self.universe[t]
        if term.op in ATOMS or not term.args:
            return
        modelled = term.dtype in FLOAT_DTYPES
        if modelled and term.op in ("mul", "matmul"):
            self.rows["MulR" if term.op == "mul" else "MatMulR"].append((t, *term.args))
        elif modelled and term.op == "lin" and all(self.universe[x].shape == term.shape for x in term.args):
            self.lin(t, list(zip(term.args, term.attrs[0])))
        else:
            self.app(t, term)

    def lin(self, t: int, pairs: list[tuple[int, Fraction]]) -> None:
        """A right-nested chain of Add over the scaled arguments, its head named t."""
        node = self.scaled(*pairs[-1], name=t if len(pairs) == 1 else None)
        for i in range(len(pairs) - 2, -1, -1):
            name = t if i == 0 else self.fresh()
            self.rows["AddR"].append((name, self.scaled(*pairs[i]), node))
            node = name

    def scaled(self, x: int, c: Fraction, name: int | None = None) -> int:
        if c == 1 and name is None:
            return x
        name = self.fresh() if name is None else name
        self.rows["ScaleR"].append((name, c.numerator, c.denominator, x))
        return name

    def app(self, t: int, term: Term) -> None:
        """An opaque op: its key says which function, its argument list is a chain of cells."""
        key_of = (term.op, term.attrs, term.shape, term.dtype)
        key = self.keys.get(key_of)
        if key is None:
            key = self.keys[key_of] = len(self.keys)
            if term.op in LINEAR_OPS:
                self.rows["Linear"].append((key,))
        rest = 0
        for x in reversed(term.args):
            cell = self.fresh()
            self.rows["ArgR"].append((cell, x, rest))
            rest = cell
        self.rows["AppR"].append((t, key, rest))


def _run(egraph: EGraph, program: str) -> None:
    egraph.run_program(*egraph.parse_program(program))
