"""The JSON report: a documented kind of fault, the failing claim, a fix, relative paths, and the
schema every report is checked against (tests/conftest.py checks every report the suite makes)."""

from __future__ import annotations

import json
from pathlib import Path

from shardproof import verify
from shardproof.relations.diagnose.finding import KINDS

CASES = Path(__file__).parent.parent / "cases"
SCHEMA = json.loads((Path(__file__).parent.parent.parent / "shardproof" / "report" / "schema.json").read_text())


def test_the_schema_enumerates_exactly_the_kinds_of_fault() -> None:
    kind = SCHEMA["properties"]["discrepancy"]["oneOf"][1]["properties"]["kind"]
    assert kind["enum"] == [k.replace(" ", "_") for k in KINDS]
    assert all(k.replace(" ", "_") in kind["description"] for k in KINDS)


def test_a_discrepancy_names_its_kind_claim_and_fix_with_paths_relative_to_the_working_directory(monkeypatch) -> None:
    monkeypatch.chdir(CASES.parent.parent)
    report = verify(CASES / "missing-allreduce_buggy.py").to_json()
    found = report["discrepancy"]
    assert found["kind"] == "missing_reduction" and found["claim"] == "output 0"
    assert found["fix"].startswith("all-reduce `output_` over ranks [0, 1] after line 56 of missing-allreduce_buggy.py")
    assert found["distributed"][0]["file"] == "tests/cases/missing-allreduce_buggy.py"
