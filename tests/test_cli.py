"""The command line: exit codes, JSON report, and clear messages for unusable input."""

from __future__ import annotations

import json
import logging
import textwrap
from pathlib import Path

import pytest

from shardproof.cli import main

CASES = Path(__file__).parent / "cases"
MLP = '''
import torch, torch.distributed as dist

class MLP(torch.nn.Module):
    def __init__(self, hidden=8, ffn=16):
        super().__init__()
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))

def reference():
    return MLP()

def distributed(rank, world_size):
    return MLP(ffn=16 // world_size)

def shard_state(ref, rank, n):
    return {"up.weight": ref["up.weight"].chunk(n, 0)[rank], "down.weight": ref["down.weight"].chunk(n, 1)[rank]}

def inputs():
    return (torch.randn(2, 8),)
'''


def _case(tmp_path: Path, text: str) -> str:
    path = tmp_path / "case.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


def test_equivalent_writes_the_json_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out.json"
    code = main(["verify", str(CASES / "row-bias-before-reduce_fixed.py"), "--json", str(out), "--quiet"])
    report = json.loads(out.read_text())
    assert code == 0 and report["verdict"] == "equivalent"
    assert report["world_size"] == 2 and report["discrepancy"] is None and report["unknown"] is None
    assert report["reference_ops"] > 0 and report["distributed_ops"] > report["reference_ops"]
    assert "equivalent" in capsys.readouterr().out


def test_discrepancy_json_lists_the_culprit_first(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    path = CASES / "row-bias-before-reduce_buggy.py"
    code = main(["verify", str(path), "--json", str(out), "--quiet"])
    found = json.loads(out.read_text())["discrepancy"]
    assert code == 1
    first = found["distributed"][0]
    assert Path(first["file"]).name == path.name and "BUG" in first["code"] and first["rank"] in (0, 1)
    assert "double counting" in found["diagnosis"] and found["claims"] == ["output 0"]


def test_missing_all_reduce_in_a_new_case_is_found(tmp_path: Path, capsys) -> None:
    """A model never seen before: the row-parallel partial sum is returned unreduced."""
    assert main(["verify", _case(tmp_path, MLP), "--quiet"]) == 1
    assert "missing reduction" in capsys.readouterr().out


def test_the_same_case_with_its_all_reduce_is_proven(tmp_path: Path) -> None:
    fixed = MLP.replace("return self.down(torch.relu(self.up(x)))", "y = self.down(torch.relu(self.up(x)))\n        if dist.is_initialized():\n            dist.all_reduce(y)\n        return y")
    assert main(["verify", _case(tmp_path, fixed), "--quiet", "--world-size", "4"]) == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("def reference(:\n", "syntax error"),
        ("import torch\ndef reference(): return torch.nn.Linear(2, 2)\n", "missing required function"),
        (MLP.replace("return (torch.randn(2, 8),)", "return (torch.randn(2, 9),)"), "tracing the reference model failed"),
        (MLP.replace("return MLP(ffn=16 // world_size)", "raise RuntimeError('no such layer')"), "no such layer"),
    ],
    ids=["syntax-error", "missing-function", "shape-mismatch", "model-raises"],
)
def test_unusable_input_exits_2_with_a_message(tmp_path: Path, capsys, caplog, text: str, message: str) -> None:
    assert main(["verify", _case(tmp_path, text), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # torch logs no traceback of its own


def test_missing_file_exits_2(capsys) -> None:
    assert main(["verify", "no/such/case.py", "--quiet"]) == 2
    assert "case file not found" in capsys.readouterr().err


def test_an_op_without_a_layout_law_on_shards_exits_2_naming_it(tmp_path: Path, capsys) -> None:
    """Sorting each column commutes with taking a rank's columns, but no rule says so for `sort`
    (it has no tag, no decomposition): the ranks agree with the reference numerically, the
    proof is missing, so the verdict is unknown, never a discrepancy."""
    sorted_hidden = "y = self.down(torch.relu(self.up(x)).sort(0).values)\n        if dist.is_initialized():\n            dist.all_reduce(y)\n        return y"
    text = MLP.replace("return self.down(torch.relu(self.up(x)))", sorted_hidden)
    assert main(["verify", _case(tmp_path, text), "--quiet"]) == 2
    assert "aten.sort" in capsys.readouterr().out
