"""partition/gradients: which rank gradients are tried against the reference's."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardproof.case import load_case
from shardproof.partition import gradients

EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"


def test_a_gradient_over_the_ranks_own_incoming_gradient_is_not_saturated(monkeypatch: pytest.MonkeyPatch, checked_step) -> None:
    """Megatron's layers pass each rank its own gradient (a free leaf at the backward call's
    boundary): no candidate over the reference's gradients can be proven equal to what is built
    over it, so none is tried. The step is proven all the same, the oracle agreeing."""
    tried: list[tuple] = []
    monkeypatch.setattr(gradients, "prove_equal", lambda *args, **options: tried.append(args) or False)
    assert checked_step(load_case(EXAMPLES / "llama_tp.py"), 2).verdict == "equivalent"
    assert tried == []
