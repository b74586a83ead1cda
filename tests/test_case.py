"""Loading a case file: its folder is importable while it loads and while its functions run, as
under `python case.py`, so a case can keep its model in a module next to it."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from shardproof import verify
from shardproof.case import load_case
from shardproof.cli import main
from shardproof.errors import CaseError
from shardproof.oracle import run_numeric
from shardproof.partition.backends import _on_pool, portable

HELPERS = '''
import torch

class MLP(torch.nn.Module):
    def __init__(self, hidden=8, ffn=16):
        super().__init__()
        self.up = torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))
'''

# the class is imported when the file loads, the reduction only when forward first runs (under
# tracing, in the oracle's rank threads, in a pool's worker)
CASE = '''
import torch
from _helpers import MLP

class ReducedMLP(MLP):
    def forward(self, x):
        from _reduce import all_reduce
        return all_reduce(super().forward(x))

def reference():
    return MLP()

def distributed(rank, world_size):
    return ReducedMLP(ffn=16 // world_size)

def shard_state(ref, rank, n):
    return {"up.weight": ref["up.weight"].chunk(n, 0)[rank], "down.weight": ref["down.weight"].chunk(n, 1)[rank]}

def inputs():
    return (torch.randn(2, 8),)
'''

REDUCE = '''
import torch.distributed as dist

def all_reduce(y):
    dist.all_reduce(y)
    return y
'''


def _folder(root: Path, reduce: str = REDUCE) -> Path:
    """A case file with its two neighbours; their names are forgotten as a new process would."""
    root.mkdir(exist_ok=True)
    for name, text in (("_helpers.py", HELPERS), ("_reduce.py", reduce), ("case.py", CASE)):
        (root / name).write_text(textwrap.dedent(text))
    for name in ("_helpers", "_reduce"):
        sys.modules.pop(name, None)
    return root / "case.py"


def test_a_case_importing_its_neighbours_is_proven_through_the_cli(tmp_path: Path) -> None:
    assert main(["verify", str(_folder(tmp_path)), "--quiet", "--backend", "none"]) == 0


def test_a_case_importing_its_neighbours_is_proven_through_the_api(tmp_path: Path) -> None:
    case = load_case(_folder(tmp_path))
    assert str(tmp_path.resolve()) not in sys.path  # only while loading and while the case runs
    assert verify(case, world_size=4, backend="none").verdict == "equivalent"
    assert str(tmp_path.resolve()) not in sys.path


def test_the_oracle_runs_a_case_importing_its_neighbours(tmp_path: Path) -> None:
    assert run_numeric(load_case(_folder(tmp_path)), 4).agree


def test_a_neighbour_missing_its_reduction_is_a_discrepancy(tmp_path: Path) -> None:
    case = load_case(_folder(tmp_path, REDUCE.replace("dist.all_reduce(y)", "pass")))
    report = verify(case, world_size=2, backend="none")
    assert report.verdict == "discrepancy" and "missing reduction" in report.diagnosis
    assert not run_numeric(case, 2).agree


def test_each_case_finds_its_own_neighbour_of_a_shared_name(tmp_path: Path) -> None:
    """Two folders each with a `_reduce.py`: the second case must not get the first one's."""
    right = load_case(_folder(tmp_path / "right"))
    wrong = load_case(_folder(tmp_path / "wrong", REDUCE.replace("dist.all_reduce(y)", "pass")))
    assert verify(wrong, world_size=2, backend="none").verdict == "discrepancy"
    assert verify(load_case(right.source), world_size=2, backend="none").verdict == "equivalent"


def test_a_pool_worker_imports_the_neighbours_too(tmp_path: Path) -> None:
    """The worker is a fresh process: it re-loads the file and traces a rank that imports lazily."""
    case = load_case(_folder(tmp_path))
    graphs = list(_on_pool(portable(case), 2, [1], True, workers=1))
    assert [graph.rank for graph in graphs] == [1]


BUILT = '''
from shardproof.case import Case
from case import reference, distributed, shard_state, inputs

CASE = Case(reference=reference, distributed=distributed, inputs=inputs, shard_state=shard_state, world_size=4)
'''


def test_a_case_built_elsewhere_is_taken_as_it_is(tmp_path: Path) -> None:
    """`CASE`, as an integration builds it (`CASE = transformers_case(config)`), stands for the functions."""
    _folder(tmp_path)
    (tmp_path / "built.py").write_text(textwrap.dedent(BUILT))
    sys.modules.pop("case", None)
    case = load_case(tmp_path / "built.py")
    assert case.world_size == 4
    assert verify(case, backend="none").verdict == "equivalent"
    assert run_numeric(case, 4).agree


def test_a_case_that_is_no_case_is_refused(tmp_path: Path) -> None:
    (tmp_path / "built.py").write_text("CASE = 'llama'\n")
    with pytest.raises(CaseError, match="CASE must be a Case"):
        load_case(tmp_path / "built.py")
