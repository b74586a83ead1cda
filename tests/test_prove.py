"""Where the normal form stops, equality saturation (egglog) finishes the proof, and only there."""

from __future__ import annotations

import torch

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric


class Scaled(torch.nn.Module):
    def __init__(self, reassociate: bool, drop: bool = False):
        super().__init__()
        self.a = torch.nn.Parameter(torch.randn(4, 8))
        self.b = torch.nn.Parameter(torch.randn(4, 8))
        self.reassociate, self.drop = reassociate, drop

    def forward(self, x):
        if self.drop:
            return x * self.a
        return (x * self.a) * self.b if self.reassociate else x * (self.a * self.b)


def _case(reassociate: bool, drop: bool = False) -> Case:
    return Case(lambda: Scaled(False), lambda rank, n: Scaled(reassociate, drop), lambda: (torch.randn(4, 8),))


def test_reassociated_product_is_proven_by_saturation() -> None:
    case = _case(reassociate=True)
    assert run_numeric(case, 2).agree
    assert verify(case, world_size=2).verdict == "equivalent"


def test_a_different_product_is_not_proven() -> None:
    case = _case(reassociate=True, drop=True)
    report = verify(case, world_size=2)
    assert not run_numeric(case, 2).agree
    assert report.verdict != "equivalent"
