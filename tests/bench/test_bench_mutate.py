"""Smoke test for bench/mutate.py: mutants keep every other line, and a few run end to end."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
CASES = Path(__file__).resolve().parents[1] / "cases"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("mutate")


def test_mutants_touch_only_the_distributed_side_and_keep_line_numbers(bench: ModuleType):
    path = CASES / "missing-allreduce_fixed.py"
    original = path.read_text()
    found = importlib.import_module("mutants").mutants(path)
    operators = {m.operator for m in found}
    assert {"collective deleted", "ReduceOp changed"} <= operators
    reference_lines = range(70, 80)  # class MLP: the reference
    for mutant in found:
        text = mutant.source(original)
        ast.parse(text)
        assert text.count("\n") == original.count("\n")
        assert text != original and mutant.line not in reference_lines
        changed = [i + 1 for i, (a, b) in enumerate(zip(original.splitlines(), text.splitlines())) if a != b]
        assert changed and mutant.line <= changed[0] and changed[-1] <= mutant.end_line


def test_draws_are_reproducible(bench: ModuleType):
    cases = bench.default_cases()
    assert [m.describe() for m in bench.choose(cases, 20, seed=4)] == [m.describe() for m in bench.choose(cases, 20, 4)]
    assert bench.choose(cases, 20, seed=4) != bench.choose(cases, 20, seed=5)


@pytest.mark.slow
def test_a_deleted_or_max_all_reduce_is_killed_on_its_line(bench: ModuleType):
    """Real gloo ranks say the mutant differs; shardproof finds it at the mutated line."""
    mutants = importlib.import_module("mutants").mutants(CASES / "missing-allreduce_fixed.py")
    deleted = [m for m in mutants if m.operator == "collective deleted" and "reduce_from" in m.before]
    max_op = [m for m in mutants if m.operator == "ReduceOp changed"][:1]
    outcomes = bench.run(deleted + max_op, world_size=2, timeout=300, progress=False)
    for outcome in outcomes:  # the all-reduce deleted; made a MAX (a wrong reduce op)
        assert outcome.truth == "differs" and outcome.row == "killed" and outcome.on_line, outcome
    assert "| killed | 2 |" in bench.table(outcomes)
