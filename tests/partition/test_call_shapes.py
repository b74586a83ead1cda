"""Calls answered by their shape: the layers of a model share one proof without building their
arguments on any rank, and a call whose arguments relate otherwise to the reference's (even where
every rank computes them by the same ops) is proven on its own, as the numbers say."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from shardproof import verify
from shardproof.capture.torch_capture import capture
from shardproof.case import Case, load_case
from shardproof.oracle import run_numeric
from shardproof.partition import execute
from shardproof.partition.call_shapes import argument_ops
from shardproof.prove import prove

LLAMA = Path(__file__).parents[2] / "examples" / "llama_tp.py"
WIDTH = 4


def _proven(layers: int, monkeypatch) -> tuple[int, list, list[execute.Terms]]:
    """(boundaries read, the ranks' graphs, their terms) of proving llama_tp at 4 ranks."""
    case = load_case(LLAMA)
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, n_layers=layers)
    captured = capture(case, 4)
    boundaries: list[int] = []
    read = execute.read_boundary
    monkeypatch.setattr(execute, "read_boundary", lambda *args: (boundaries.append(1), read(*args))[1])
    built: list[execute.Terms] = []
    run = execute.run_ranks
    monkeypatch.setattr(execute, "run_ranks", lambda *args, **kw: (lambda out: (built.extend(out), out)[1])(run(*args, **kw)))
    assert prove(captured).verdict == "equivalent"
    monkeypatch.undo()
    return len(boundaries), captured.ranks, built[-4:]  # the programs' run ends last, after those inside calls


def test_layers_of_one_shape_are_proven_once_and_their_shards_never_built(monkeypatch) -> None:
    fewer, _, _ = _proven(6, monkeypatch)
    boundaries, ranks, built = _proven(12, monkeypatch)
    assert boundaries == fewer, "layers past the first of their shape read no boundary"
    last = [call for call in execute.instances(ranks[0]) if call.module.startswith("layers.")][-1]
    assert argument_ops(ranks[0], last.inputs) is argument_ops(ranks[3], last.inputs), "read once per rank class"
    shards = [i for i in last.inputs if ranks[0].nodes[i].op in ("slice", "cat")]
    assert shards and all(built[r].built[i] is None for r in range(4) for i in shards), "never built"


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class _Twice(nn.Module):
    """Two calls of one kind of module; the distributed side doubles the second call's input too."""

    def __init__(self, doubles_second: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Scale(), _Scale()])
        self.doubles_second = doubles_second

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        second = y * 2 if self.doubles_second else y
        return self.blocks[0](x * 2) + self.blocks[1](second)


def _twice(doubles_second: bool) -> Case:
    return Case(lambda: _Twice(False), lambda rank, n: _Twice(doubles_second), lambda: (torch.randn(3, WIDTH), torch.randn(3, WIDTH)), 2)


def test_a_call_whose_ranks_compute_alike_but_the_reference_does_not_is_proven_on_its_own() -> None:
    """Both calls' rank arguments are `input * 2`; only the first call's reference argument is too.
    Answering the second from the first's proof (argument = the reference's) would be wrong."""
    for doubles_second, verdict in ((True, "discrepancy"), (False, "equivalent")):
        case = _twice(doubles_second)
        assert verify(case, world_size=2, backend="none").verdict == verdict
        assert run_numeric(case, 2).agree == (verdict == "equivalent")
