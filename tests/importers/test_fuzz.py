"""Corrupted graph dumps (bench/fuzz.py, a few seeded trials): never a traceback, never a
discrepancy for a corrupted copy of a correct pair that still means the same program, and every
accepted mutant called equivalent means the program it was."""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
ENTANGLE = Path(__file__).parents[2] / ".." / "shared" / "data" / "entangle"


@pytest.fixture
def fuzz(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("fuzz")


def _failures(fuzz: ModuleType, trials: list) -> list[str]:
    return [f"{t.outcome}: {t.subject} {t.file} ({t.mutation}): {t.detail}" for t in trials if t.outcome in fuzz.FAILURES]


def test_corrupted_generated_dumps_are_refused_or_mean_the_same_program(fuzz: ModuleType, tmp_path: Path) -> None:
    trials = fuzz.run(fuzz.generated_subjects(tmp_path), n=60, seed=13)
    assert not _failures(fuzz, trials)
    outcomes = {t.outcome for t in trials}
    assert "rejected (exit 2)" in outcomes and "equivalent, same program" in outcomes  # both sides exercised


@pytest.mark.skipif(not ENTANGLE.is_dir(), reason="../shared/data/entangle (graph dumps) not present")
def test_corrupted_real_dumps_are_refused_or_mean_the_same_program(fuzz: ModuleType) -> None:
    small = [s for s in fuzz.real_subjects() if s.name in ("aws_llama/tp2_layer1", "bug_grad_accumulation/2step.bug")]
    trials = fuzz.run(small, n=30, seed=5)
    assert not _failures(fuzz, trials)
    assert sum(t.outcome == "rejected (exit 2)" for t in trials) >= 10


@pytest.mark.parametrize("mutation", ["truncate", "delete_line", "duplicate_line", "swap_lines", "change_token",
                                      "change_shape_number", "invalid_utf8", "binary"])
def test_each_mutation_changes_its_input_deterministically(fuzz: ModuleType, mutation: str) -> None:
    data = b"HloModule m\n%a = f32[2,3]{1,0} parameter(0)\nROOT %b = f32[2,3]{1,0} add(%a, %a)\n"
    mutate = fuzz.MUTATIONS[mutation]
    assert mutate(data, random.Random(3)) == mutate(data, random.Random(3))
    assert any(mutate(data, random.Random(seed)) != data for seed in range(5))


def test_the_same_program_is_told_from_a_changed_one(fuzz: ModuleType, tmp_path: Path) -> None:
    """The judge of accepted mutants: operands of a product swapped is the same program; a product
    made a sum is not (the numbers differ)."""
    from shardproof.importers.sources import load_program

    def program(text: str, name: str):
        (tmp_path / name).write_text(text)
        return load_program(tmp_path / name, None, "reference")

    text = fuzz.hlo_mlp(3, reduce=True)
    original = program(text, "a.hlo")
    assert fuzz.same_program(original, program(text.replace("multiply(%g, %sig)", "multiply(%sig, %g)"), "b.hlo"))
    assert not fuzz.same_program(original, program(text.replace("multiply(%g, %sig)", "add(%g, %sig)"), "c.hlo"))
