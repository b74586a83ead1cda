"""`shardproof init`: the template verifies as written, from scratch or around a model class."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from shardproof.cli import main

MODULE = '''
import torch


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32)
        self.down = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
'''


def test_the_template_is_a_case_that_is_proven(tmp_path: Path, capsys) -> None:
    case = tmp_path / "mlp_case.py"
    assert main(["init", str(case)]) == 0
    assert f"shardproof verify {case}" in capsys.readouterr().out
    assert "def shard_state(ref_state" in case.read_text() and "def inputs()" in case.read_text()
    assert main(["verify", str(case), "--quiet", "--world-size", "4"]) == 0
    assert main(["init", str(case)]) == 2 and "already exists" in capsys.readouterr().err


def test_a_template_around_a_model_class_lists_its_layers_and_verifies(tmp_path: Path, monkeypatch, capsys) -> None:
    (tmp_path / "mymodels.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mymodels", raising=False)
    case = tmp_path / "block_case.py"
    assert main(["init", str(case), "--model", "mymodels:Block"]) == 0
    text = case.read_text()
    assert "from mymodels import Block" in text and "Linear layers of Block: up, down" in text
    assert main(["verify", str(case), "--quiet"]) == 0  # an empty plan: replicas, proven equivalent


@pytest.mark.parametrize(("model", "message"), [("mymodels", "pkg.module:Class"), ("nosuch.module:X", "cannot import"),
                                                ("textwrap:dedent", "not a torch.nn.Module class")])
def test_a_model_that_cannot_be_used_is_named(tmp_path: Path, capsys, model: str, message: str) -> None:
    assert main(["init", str(tmp_path / "case.py"), "--model", model]) == 2
    assert message in capsys.readouterr().err
