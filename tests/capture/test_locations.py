"""Source locations: ops are placed at the line of user code that issued them, backward ops at the
forward line they differentiate."""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Callable, Iterator

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from shardproof.capture.locations import is_user_code
from shardproof.capture.torch_capture import capture
from shardproof.case import Case
from shardproof.ir.graph import Graph

THIS_FILE = str(Path(__file__).resolve())
VOCAB, HIDDEN = 16, 8


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.output(hidden)


def _parallel_head(rank: int, world_size: int) -> nn.Module:
    plan = {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(Head(), init_device_mesh("cpu", (world_size,)), plan)


def _inputs() -> tuple:
    return torch.randn(6, HIDDEN), torch.arange(6).mul(5).remainder(VOCAB)


def _cross_entropy(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def _entropy_bonus(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(logits, dim=-1)
    return F.nll_loss(log_probs, labels) + (log_probs.exp() * log_probs).sum(-1).mean()


def _rank_graph(loss: Callable) -> Graph:
    """Rank 0's training step under loss_parallel, logits sharded along the vocab."""

    def step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
        with loss_parallel():
            value = loss(model(*inputs), *inputs)
            value.backward()
        return value

    case = Case(Head, _parallel_head, _inputs, loss=loss, distributed_step=step, mode="train", source=Path(THIS_FILE))
    return capture(case, 2, mode="train").ranks[0]


def _first_line(function: Callable) -> int:
    return inspect.getsourcelines(function)[1] + 1


def test_backward_ops_of_a_dtensor_op_are_placed_at_its_forward_line() -> None:
    """DTensor's loss_parallel runs cross entropy's backward in Python handlers after creating
    autograd nodes of its own: its ops still belong to the cross-entropy line, not to backward()."""
    rank = _rank_graph(_cross_entropy)
    one_hots = [n for n in rank.nodes if n.op == "scatter"]
    assert one_hots, "cross entropy's backward writes the one-hot of the labels"
    assert all((n.loc.line, n.loc.backward) == (_first_line(_cross_entropy), True) for n in one_hots)
    lines, start = inspect.getsourcelines(_rank_graph)
    backward_call = start + next(i for i, line in enumerate(lines) if "value.backward()" in line)
    assert not any(n.loc.line == backward_call for n in rank.nodes if n.loc is not None and n.op not in ("const", "leaf"))


def test_a_backward_step_that_emits_no_op_is_kept_at_its_forward_line() -> None:
    """Under loss_parallel, log_softmax's backward returns its gradient as is: no op, but the IR
    keeps a view at the log_softmax line, so a diagnosis can name the step."""
    rank = _rank_graph(_entropy_bonus)
    steps = [n for n in rank.nodes if n.loc is not None and n.loc.line == _first_line(_entropy_bonus) and n.loc.backward]
    assert [n.op for n in steps] == ["view"]
    assert steps[0].shape == rank[steps[0].inputs[0]].shape


# --- which frames are the user's ----------------------------------------------------------------


@contextlib.contextmanager
def _quietly() -> Iterator[None]:
    yield


@_quietly()  # a decorator made by contextlib: its wrapper frame is Python's, not the user's
def _doubled(x: torch.Tensor) -> torch.Tensor:
    return x * 2


class Helper(nn.Module):
    """A model whose op is issued in a helper that is neither `forward` nor in the case's folder,
    as a library's model issues most of its ops."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _doubled(x * self.weight).sum()


def _helper_sites(mode: str) -> set[tuple[str, int]]:
    case = Case(Helper, lambda rank, world_size: Helper(), lambda: (torch.randn(4),), loss=lambda out, x: out)
    graph = capture(case, 2, mode=mode).ranks[0]
    return {(n.loc.file, n.loc.line) for n in graph.nodes if n.op == "mul" and n.loc is not None and not n.loc.backward}


@pytest.mark.parametrize("mode", ["forward", "train"])  # the light tracer, make_fx
def test_an_op_is_located_at_the_line_that_issued_it_in_any_function(mode: str) -> None:
    helper_line = inspect.getsourcelines(_doubled)[1] + 2
    assert (THIS_FILE, helper_line) in _helper_sites(mode)


def test_user_code_is_every_library_but_torch_shardproof_and_python_itself() -> None:
    assert is_user_code(THIS_FILE)
    assert is_user_code(numpy.__file__)  # an installed library, as transformers or torchtitan are
    assert not is_user_code(torch.nn.functional.__file__)
    assert not is_user_code(contextlib.__file__)
    assert not is_user_code("<string>")  # a dataclass's generated __init__


def test_the_code_that_called_shardproof_is_no_site() -> None:
    """Ops shardproof's own program issues (the training step's copies of the parameters) have no
    user frame inside the trace; the caller of `capture` (this test, a console script) is not one."""
    graph = capture(Case(Helper, lambda rank, world_size: Helper(), lambda: (torch.randn(4),), loss=lambda out, x: out),
                    2, mode="train").ranks[0]  # this line is no op's site
    lines = {n.loc.line for n in graph.nodes if n.loc is not None and n.loc.file == THIS_FILE}
    caller = inspect.getsourcelines(test_the_code_that_called_shardproof_is_no_site)
    called_at = caller[1] + next(i for i, line in enumerate(caller[0]) if "no op's site" in line)
    assert lines and called_at not in lines and called_at - 1 not in lines


def _forwarding(fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)  # a wrapper's line

    return wrapper


class Wrapped(nn.Module):
    """A library module whose forward a framework wraps (torchtitan's parallelize wraps every one)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.forward = _forwarding(self.lin.forward)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum()  # the call


@pytest.mark.parametrize("mode", ["forward", "train"])  # the light tracer, make_fx
def test_an_op_issued_under_a_forwarding_wrapper_is_located_where_the_wrapper_was_called(mode: str) -> None:
    case = Case(Wrapped, lambda rank, world_size: Wrapped(), lambda: (torch.randn(3, 4),), loss=lambda out, x: out)
    graph = capture(case, 2, mode=mode).ranks[0]
    lines = {n.loc.code for n in graph.nodes if n.op == "matmul" and n.loc is not None and not n.loc.backward}
    assert lines == {"return self.lin(x).sum()  # the call"}
