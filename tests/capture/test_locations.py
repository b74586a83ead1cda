"""Source locations of backward ops: autograd's ops are placed at the forward line they differentiate."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

from shardproof.capture.torch_capture import capture
from shardproof.case import Case

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


def _loss(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def _step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    with loss_parallel():
        value = _loss(model(*inputs), *inputs)
        value.backward()
    return value


def test_backward_ops_of_a_dtensor_op_are_placed_at_its_forward_line() -> None:
    """DTensor's loss_parallel runs cross entropy's backward in Python handlers after creating
    autograd nodes of its own: its ops still belong to the cross-entropy line, not to backward()."""
    functions = [Head.forward, _parallel_head, _inputs, _loss, _step]
    case = Case(Head, _parallel_head, _inputs, loss=_loss, distributed_step=_step, mode="train",
                source=Path(THIS_FILE), source_functions=functions)
    rank = capture(case, 2, mode="train").ranks[0]
    loss_line = inspect.getsourcelines(_loss)[1] + 1
    backward_call = inspect.getsourcelines(_step)[1] + 3
    one_hots = [n for n in rank.nodes if n.op == "scatter"]
    assert one_hots, "cross entropy's backward writes the one-hot of the labels"
    assert all((n.loc.line, n.loc.backward) == (loss_line, True) for n in one_hots)
    assert not any(n.loc is not None and n.loc.line == backward_call for n in rank.nodes if n.op not in ("const", "leaf"))


def _entropy_bonus_loss(logits: torch.Tensor, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    log_probs = F.log_softmax(logits, dim=-1)
    return F.nll_loss(log_probs, labels) + (log_probs.exp() * log_probs).sum(-1).mean()


def _entropy_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    with loss_parallel():
        value = _entropy_bonus_loss(model(*inputs), *inputs)
        value.backward()
    return value


def test_a_backward_step_that_emits_no_op_is_kept_at_its_forward_line() -> None:
    """Under loss_parallel, log_softmax's backward returns its gradient as is: no op, but the IR
    keeps a view at the log_softmax line, so a diagnosis can name the step."""
    functions = [Head.forward, _parallel_head, _inputs, _entropy_bonus_loss, _entropy_step]
    case = Case(Head, _parallel_head, _inputs, loss=_entropy_bonus_loss, distributed_step=_entropy_step,
                mode="train", source=Path(THIS_FILE), source_functions=functions)
    rank = capture(case, 2, mode="train").ranks[0]
    line = inspect.getsourcelines(_entropy_bonus_loss)[1] + 1
    steps = [n for n in rank.nodes if n.loc is not None and n.loc.line == line and n.loc.backward]
    assert [n.op for n in steps] == ["view"]
    assert steps[0].shape == rank[steps[0].inputs[0]].shape
