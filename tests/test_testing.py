"""shardproof.testing.assert_equivalent, and the pytest plugin that collects `*_case.py` files."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from shardproof.testing import assert_equivalent

CASES = Path(__file__).parent / "cases"
MLP = '''
import torch, torch.distributed as dist

class MLP(torch.nn.Module):
    def __init__(self, ffn=16):
        super().__init__()
        self.up = torch.nn.Linear(8, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, 8, bias=False)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        if dist.is_initialized():
            dist.all_reduce(y)
        return y

def reference():
    return MLP()

def distributed(rank, world_size):
    return MLP(ffn=16 // world_size)

def inputs():
    return (torch.randn(2, 8),)
'''


def test_assert_equivalent_returns_the_report_or_fails_with_it() -> None:
    assert assert_equivalent(CASES / "row-bias-before-reduce_fixed.py", world_size=2).verdict == "equivalent"
    with pytest.raises(AssertionError, match=r"(?s)^discrepancy: double counting.*row-bias-before-reduce_buggy.py:39"):
        assert_equivalent(CASES / "row-bias-before-reduce_buggy.py")


@pytest.mark.slow
def test_the_plugin_collects_case_files_as_tests(pytester: pytest.Pytester) -> None:
    pytester.makefile(".py", mlp_case=textwrap.dedent(MLP))
    pytester.makefile(".py", unreduced_case=textwrap.dedent(MLP).replace("            dist.all_reduce(y)\n", "            pass\n"))
    pytester.makefile(".py", helper=textwrap.dedent(MLP))  # not a case file by its name: not collected
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*unreduced_case.py is not proven equivalent:*", "*missing reduction*"])
