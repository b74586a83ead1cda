"""Training with repeated layers: each kind of layer call proven once forward and once backward,
and a bug in one layer's backward, or on one rank only, still found (the oracle agrees)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardproof import verify
from shardproof.capture.torch_capture import capture
from shardproof.case import Case, load_case
from shardproof.prove import prove

HIDDEN, FFN, DEPTH, BAD_LAYER, BAD_RANK = 8, 16, 4, 2, 1  # BAD_LAYER: layer 3 of 4
MEGATRON = load_case(Path(__file__).parents[2] / "examples" / "llama_tp.py").module  # its autograd mappings


class _GatherFromTensorParallel(torch.autograd.Function):
    """All-gather along the last dim; the backward keeps a slice of the gradient: this rank's,
    or the next rank's on rank `wrong_on`."""

    @staticmethod
    def forward(ctx, x, wrong_on):
        ctx.wrong_on = wrong_on
        gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, x.contiguous())
        return torch.cat(gathered, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        index = (rank + 1) % world_size if rank == ctx.wrong_on else rank
        return grad.chunk(world_size, dim=-1)[index].contiguous(), None


class Block(nn.Module):
    def __init__(self, ffn: int = FFN) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(self.norm(x))))


class ParallelBlock(Block):
    """`up` column-parallel and gathered, `down` replicated; `reduce_input_grad` off: the
    backward all-reduce of the norm's output gradient (Megatron's copy to the tensor-parallel
    region) is missing; `wrong_on`: the rank whose gathered gradient is sliced wrong."""

    def __init__(self, world_size: int, reduce_input_grad: bool = True, wrong_on: int | None = None) -> None:
        super().__init__(FFN // world_size)
        self.reduce_input_grad, self.wrong_on = reduce_input_grad, wrong_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        if self.reduce_input_grad:
            h = MEGATRON.copy_to_tensor_parallel_region(h)
        up = _GatherFromTensorParallel.apply(self.up(h), self.wrong_on)
        return x + self.down(F.silu(up))


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _shard(ref_state: dict, rank: int, world_size: int) -> dict:
    return {
        name: tensor.chunk(world_size, 0)[rank] if ".up." in name else tensor for name, tensor in ref_state.items()
    }


def _case(**bad_layer) -> Case:
    def distributed(rank: int, world_size: int) -> nn.Module:
        return Stack([ParallelBlock(world_size, **(bad_layer if i == BAD_LAYER else {})) for i in range(DEPTH)])

    return Case(
        lambda: Stack([Block() for _ in range(DEPTH)]),
        distributed,
        lambda: (torch.randn(2, 3, HIDDEN),),
        shard_state=_shard,
        loss=lambda output, x: output.pow(2).mean(),
        source=None,
    )


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["train", "step"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_repeated_layers_train_equivalent_with_one_proof_forward_and_one_backward(
    world_size: int, mode: str, checked_step
) -> None:
    assert checked_step(_case(), world_size, mode, backend="none").verdict == "equivalent"
    proof = prove(capture(_case(), world_size, mode="train"))
    assert proof.verdict == "equivalent"
    kinds = 2  # the first layer (its input needs no gradient), the others
    assert proof.calls is not None and proof.calls.proven == 2 * kinds, "each kind proven once forward, once backward"
    assert proof.calls.reused == 2 * (DEPTH - kinds)


def _as_without_memoization(checked_step, case: Case, world_size: int):
    """The verdict, checked against the numbers, whose culprit is the one a trace without memoization names."""
    report = checked_step(case, world_size, backend="none")
    plain = verify(case, world_size=world_size, train=True, backend="none", memo=False)
    site = lambda s: (s.file, s.line, s.op, s.rank)  # noqa: E731 - node names differ between the two traces
    assert (report.verdict, site(report.distributed[0])) == (plain.verdict, site(plain.distributed[0]))
    return report


@pytest.mark.slow
def test_a_missing_backward_all_reduce_in_one_layer_is_found_in_that_layer(checked_step) -> None:
    report = _as_without_memoization(checked_step, _case(reduce_input_grad=False), 2)
    assert report.verdict == "discrepancy"
    assert "missing reduction" in report.diagnosis
    assert f"blocks.{BAD_LAYER}." in report.diagnosis, "confirmed on the bad layer's gradients"
    assert any(s.op.endswith("in the backward") for s in report.distributed)


@pytest.mark.slow
def test_a_wrong_gradient_slice_on_one_rank_in_one_layer_is_found_on_that_rank(checked_step) -> None:
    report = _as_without_memoization(checked_step, _case(wrong_on=BAD_RANK), 4)
    assert report.verdict == "discrepancy"
    assert {s.rank for s in report.distributed} == {BAD_RANK}
    assert f"blocks.{BAD_LAYER}." in report.diagnosis, "confirmed on the bad layer's gradients"
