"""Inference engines' sampling over vocab-parallel logits and their writes of gathered shards into
a preallocated buffer (tests/cases: greedy-argmax-*, topk-*, logits-buffer-*), through the command line as
a user runs it, at the smallest and the largest world size of the corpus: each buggy twin exits 1
with its marked line first and its kind of fault named, each fixed twin exits 0; the numeric oracle
agrees with both."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from shardproof.case import load_case
from shardproof.cli import main
from shardproof.oracle import run_numeric

CASES = Path(__file__).parent.parent / "cases"
IDS = ("greedy-argmax-offset", "greedy-argmax-off-by-one", "greedy-argmax-funcol", "topk-offset", "topk-candidates-flat",
       "topk-local-k", "logits-buffer-unwritten")
KIND_WORDS = {"layout": "wrong layout", "unwritten": "uninitialised memory read", "too-few": "too few candidates"}


def _marked(path: Path) -> tuple[int, str]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        found = re.search(r"# BUG\((?P<kind>[a-z-]+)\)", line)
        if found:
            return number, found["kind"]
    raise AssertionError(f"{path.name} has no BUG marker")


def _verify(path: Path, world_size: int, out: Path) -> tuple[int, dict]:
    code = main(["verify", str(path), "--world-size", str(world_size), "--json", str(out), "--quiet", "--backend", "none"])
    return code, json.loads(out.read_text())


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("case_id", IDS)
def test_the_buggy_sampler_exits_1_at_its_marked_line(case_id: str, world_size: int, tmp_path: Path) -> None:
    path = CASES / f"{case_id}_buggy.py"
    line, kind = _marked(path)
    code, report = _verify(path, world_size, tmp_path / "out.json")
    assert code == 1, report
    first = report["discrepancy"]["distributed"][0]
    assert (Path(first["file"]).name, first["line"]) == (path.name, line)
    assert KIND_WORDS[kind] in report["discrepancy"]["diagnosis"]
    assert not run_numeric(load_case(path), world_size).agree


@pytest.mark.parametrize("world_size", [2, 8])
@pytest.mark.parametrize("case_id", IDS)
def test_the_fixed_sampler_exits_0(case_id: str, world_size: int, tmp_path: Path) -> None:
    path = CASES / f"{case_id}_fixed.py"
    code, report = _verify(path, world_size, tmp_path / "out.json")
    assert code == 0 and report["verdict"] == "equivalent", report
    assert run_numeric(load_case(path), world_size).agree
