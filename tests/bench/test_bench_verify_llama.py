"""Smoke test for bench/verify_llama.py: one tiny configuration in a spawned child."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The bench script, importable by name so the spawned child can unpickle its target."""
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    return importlib.import_module("verify_llama")


@pytest.mark.slow
def test_one_configuration_gives_a_full_row(bench: ModuleType):
    row = bench.run_configuration(2, 1, None, timeout=120)
    assert row.verdict in {"equivalent", "discrepancy", "unknown"}, row.note
    assert row.total is not None and row.total >= row.capture >= 0
    assert row.peak_mib > 0 and row.terms > 0 and row.reference_ops > 0 and row.distributed_ops > row.reference_ops
    table = bench.render(bench.HEADERS, [row.cells()], markdown=True)
    assert table.splitlines()[2].startswith(f"| 2 | 1 | {row.verdict} |")


@pytest.mark.slow
def test_training_configuration_gives_a_full_row(bench: ModuleType):
    row = bench.run_configuration(2, 1, None, timeout=120, mode="train")
    assert row.verdict == "equivalent", row.note
    assert row.total is not None and row.distributed_ops > row.reference_ops


@pytest.mark.slow
def test_a_pipeline_configuration_gives_a_full_row(bench: ModuleType):
    """What `--pipeline` measures: examples/llama_pp.py, 2 stages of one layer each at 2 ranks."""
    row = bench.run_configuration(2, 2, None, timeout=300, mode="pipeline")
    assert row.verdict == "equivalent", row.note
    assert row.total is not None and row.peak_mib > 0 and row.distributed_ops > row.reference_ops


@pytest.mark.slow
def test_a_training_step_of_the_tensor_parallel_case_reuses_its_layer_proofs(bench: ModuleType):
    """What `bench/scale.py --train` measures: examples/llama_tp.py in training mode."""
    row = bench.run_configuration(2, 3, None, timeout=120, mode="train", case_file=bench.EXAMPLES / "llama_tp.py")
    assert row.verdict == "equivalent", row.note
    assert row.calls_reused > 0


def test_ratios_skip_failed_configurations(bench: ModuleType):
    rows = [bench.Row(2, 2, "unknown", 1.0, 1.0, 2.0), bench.Row(2, 8, "error", note="boom")]
    assert bench.ratios(rows) == [("time(8 layers) / time(2 layers)", "ws 2", "-", "-")]
