"""CI formats: GitHub workflow annotations at the culprit line, and SARIF 2.1.0."""

from __future__ import annotations

import json
import os

from shardproof.relations.diagnose.finding import KINDS
from shardproof.report.ci import github, sarif
from shardproof.report.model import Report, Site


def _discrepancy() -> Report:
    here = os.getcwd()
    return Report(
        "discrepancy", 2, 1.0, 5, 20, "missing reduction: a partial sum, 100%\nof it", kind="missing reduction",
        claim="output 0", fix="all-reduce `y` after line 10 of mlp.py",
        distributed=[Site(f"{here}/mlp.py", 10, "y = self.down(x)", "matmul", 0, "mm"),
                     Site(f"{here}/mlp.py", 12, "return y", "view", 0, "view")],
    )


def test_github_annotates_the_culprit_line_as_an_error_and_the_others_as_notices() -> None:
    lines = github(_discrepancy()).splitlines()
    assert lines[0].startswith("::error file=mlp.py,line=10,title=shardproof%3A missing reduction::")
    assert "100%25%0Aof it" in lines[0] and "Fix: all-reduce `y` after line 10" in lines[0]  # one line, escaped
    assert lines[1].startswith("::notice file=mlp.py,line=12,")
    assert lines[2].startswith("discrepancy: missing reduction")  # the text report follows for the log
    assert github(Report("equivalent", 2, 1.0, 5, 20)).startswith("::notice title=shardproof%3A equivalent::equivalent: 2 ranks")


def test_sarif_has_one_result_at_the_culprit_with_its_rule() -> None:
    log = json.loads(sarif(_discrepancy()))
    run = log["runs"][0]
    assert log["version"] == "2.1.0" and [r["id"] for r in run["tool"]["driver"]["rules"]] == [k.replace(" ", "_") for k in KINDS]
    [result] = run["results"]
    assert result["ruleId"] == "missing_reduction" and result["level"] == "error"
    assert result["locations"][0]["physicalLocation"] == {"artifactLocation": {"uri": "mlp.py"}, "region": {"startLine": 10}}
    assert result["relatedLocations"][0]["physicalLocation"]["region"]["startLine"] == 12
    assert json.loads(sarif(Report("equivalent", 2, 1.0, 5, 20)))["runs"][0]["results"] == []
