"""Tracing repeated modules once: copies become calls, and the program still means what torch computes.

The meaning is checked numerically: the captured reference, calls expanded, is executed into terms
whose value on random leaves (relations/evaluate) must equal the eager model's output.
"""

from __future__ import annotations

from typing import Callable

import pytest
import torch
from torch import nn
from torch.func import functional_call

from shardproof import verify
from shardproof.capture.torch_capture import capture
from shardproof.case import Case
from shardproof.oracle import run_numeric
from shardproof.partition.templates import expand
from shardproof.programs import Captured
from shardproof.relations.evaluate import evaluate
from shardproof.relations.execute import execute
from shardproof.state import module_state

WIDTH, DEPTH = 6, 4


class Block(nn.Module):
    def __init__(self, scale: float = 0.5) -> None:
        super().__init__()
        self.scale = scale
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scale * self.down(torch.relu(self.up(self.norm(x))))


class Counting(Block):
    """Changes its own state on every call: each call traces other ops, no copy may stand in."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * self.calls


class InPlace(Block):
    """Writes into its input: a copy standing in would skip the write."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        x.mul_(2.0)
        return out


SHARED: dict[str, torch.Tensor] = {}


class ReadsOutside(Block):
    """Reads a traced tensor that is not among its inputs (set by the model before the layers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + SHARED["bias"]


class Mask:
    """Not pytree data: a call key names it by identity, and each forward makes a new one (as
    torchtitan makes its FlexAttention BlockMask from the positions in every forward)."""

    def __init__(self, bias: torch.Tensor) -> None:
        self.bias = bias


class ReadsMask(Block):
    def forward(self, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        return super().forward(x) + mask.bias


class MaskedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.project = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(ReadsMask() for _ in range(DEPTH))
        self.runs = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.runs += 1
        x = self.project(x)
        mask = Mask(x.mean(0))
        for block in self.blocks:
            x = block(x, mask)
        return x


class Stack(nn.Module):
    """An input projection, so every block sees the same kind of input (one requiring grad)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.project = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.project(x)
        SHARED["bias"] = x.mean(0)
        for block in self.blocks:
            x = block(x)
        return x


def _case(make: Callable[[], nn.Module]) -> Case:
    return Case(make, lambda rank, n: make(), lambda: (torch.randn(3, WIDTH),))


def _block_calls(captured: Captured) -> list:
    """The templates of the reference's calls of whole blocks (`blocks.3`, not `blocks.3.norm`)."""
    return [node.attrs[0] for node in captured.reference.nodes if node.op == "call" and node.attrs[2].count(".") == 1]


def _assert_computes_what_torch_does(make: Callable[[], nn.Module], captured: Captured) -> None:
    """Terms are values over the reals (float64): evaluated on float64 leaves, against float64 torch."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(3, WIDTH, dtype=torch.float64)
    state = {name: torch.randn_like(t, dtype=torch.float64) for name, t in module_state(model).items()}
    leaves = {f"state:{name}": t for name, t in state.items()} | {"input:0": x}
    graph = expand(captured.reference)
    run = execute(graph, [])
    value = evaluate(run.rules.u, run.reference[graph.outputs[0]], leaves)
    torch.testing.assert_close(value, functional_call(make().double(), state, (x.clone(),)))


def test_repeated_layers_are_traced_once_and_expand_to_what_torch_computes() -> None:
    make = lambda: Stack([Block() for _ in range(DEPTH)])  # noqa: E731
    captured = capture(_case(make), 2)
    assert len(_block_calls(captured)) == DEPTH, "every block is a call of the first one's template, the first too"
    assert captured.reference.op_count() == capture(_case(make), 2, memo=False).reference.op_count()
    _assert_computes_what_torch_does(make, captured)


def test_layers_that_differ_in_an_attribute_get_their_own_graph() -> None:
    make = lambda: Stack([Block(scale=0.5), Block(scale=0.5), Block(scale=2.0), Block(scale=2.0)])  # noqa: E731
    captured = capture(_case(make), 2)
    assert len(set(_block_calls(captured))) == 2
    _assert_computes_what_torch_does(make, captured)


@pytest.mark.parametrize("layer", [Counting, InPlace, ReadsOutside], ids=lambda c: c.__name__)
def test_layers_that_a_copy_cannot_stand_in_for_are_traced_every_time(layer: type) -> None:
    make = lambda: Stack([layer() for _ in range(DEPTH)])  # noqa: E731
    captured = capture(_case(make), 2)
    assert not _block_calls(captured)
    _assert_computes_what_torch_does(make, captured)


def test_a_module_reading_an_argument_object_made_in_each_trace_is_excluded_once() -> None:
    """Its calls read tensors their key does not hold: excluded by the module's structure, so the
    trace is redone once, not until Python happens to reuse the object's address."""
    model = MaskedStack()
    captured = capture(Case(lambda: model, lambda rank, n: MaskedStack(), lambda: (torch.randn(3, WIDTH),)), 2)
    assert not _block_calls(captured)
    assert model.runs <= 3  # traced, excluded and traced again (a meta-tensor trace may precede)


def test_reused_calls_keep_verdicts_agreeing_with_the_numbers() -> None:
    good = _case(lambda: Stack([Block() for _ in range(DEPTH)]))
    assert run_numeric(good, 2).agree
    assert verify(good, world_size=2).verdict == "equivalent"
    bad = Case(good.reference, lambda rank, n: Stack([Block(scale=0.5 + (i == 2)) for i in range(DEPTH)]), good.inputs)
    assert not run_numeric(bad, 2).agree
    assert verify(bad, world_size=2).verdict == "discrepancy"
