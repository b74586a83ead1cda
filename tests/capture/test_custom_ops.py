"""Custom ops written in Python are traced through their implementation (capture/custom_ops.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.capture.torch_capture import capture
from shardproof.case import Case
from shardproof.oracle import run_numeric

IN, OUT = 8, 3


@torch.library.custom_op("shardproof_test::own_columns", mutates_args=())
def own_columns(x: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """A library's shard cut, hidden behind an op name (spmd_types cuts its shards so)."""
    return torch.chunk(x, world_size, dim=-1)[rank].clone()


@own_columns.register_fake
def _own_columns_fake(x: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // world_size))


class RowParallel(nn.Module):
    def __init__(self, world_size: int = 1) -> None:
        super().__init__()
        self.down = nn.Linear(IN // world_size, OUT, bias=False)
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return self.down(x)
        out = self.down(own_columns(x, self.world_size, dist.get_rank()))
        dist.all_reduce(out)
        return out


def _case(own: bool) -> Case:
    def loader(ref_state: dict, rank: int, world_size: int) -> dict:
        return {"down.weight": own_columns(ref_state["down.weight"], world_size, rank if own else 0)}

    return Case(RowParallel, lambda rank, world_size: RowParallel(world_size), lambda: (torch.randn(5, IN),),
                shard_state=loader, loss=lambda out, x: out.square().sum())


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_python_custom_op_enters_the_graph_as_the_ops_it_runs(mode: str) -> None:
    graph = capture(_case(True), 2, mode=mode).ranks[1]
    assert not any("own_columns" in n.op for n in graph.nodes)
    assert any(n.op == "slice" for n in graph.nodes)


def test_a_shard_cut_by_a_custom_op_is_proven_and_a_wrong_one_found() -> None:
    assert verify(_case(True), world_size=2).verdict == "equivalent"
    assert run_numeric(_case(True), 2).agree
    report = verify(_case(False), world_size=2)  # every rank cuts shard 0 of the weight
    assert report.verdict == "discrepancy" and "overlapping shards" in report.diagnosis
    assert not run_numeric(_case(False), 2).agree


_LIB = torch.library.Library("shardproof_test_lib", "DEF")
_LIB.define("copy_columns(Tensor x, int world_size, int rank, *, Tensor(a!) out) -> ()")


@torch.library.impl(_LIB, "copy_columns", "CPU")
@torch.library.impl(_LIB, "copy_columns", "Meta")
def _copy_columns(x: torch.Tensor, world_size: int, rank: int, out: torch.Tensor) -> None:
    """An op declared with `torch.library.Library`, writing into `out=` (FSDP2's copy-out ops are so)."""
    out.copy_(torch.chunk(x, world_size, dim=-1)[rank])


class _CopiedRowParallel(RowParallel):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mine = x.new_empty((*x.shape[:-1], x.shape[-1] // self.world_size))
        torch.ops.shardproof_test_lib.copy_columns(x, self.world_size, dist.get_rank(), out=mine)
        out = self.down(mine)
        dist.all_reduce(out)
        return out


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_library_op_with_a_python_cpu_kernel_is_traced_through_it(mode: str) -> None:
    case = Case(RowParallel, lambda rank, world_size: _CopiedRowParallel(world_size), lambda: (torch.randn(5, IN),),
                loss=lambda out, x: out.square().sum())
    graph = capture(case, 2, mode=mode).ranks[1]
    assert not any("copy_columns" in n.op for n in graph.nodes)
    assert verify(case, world_size=2, train=mode == "train").verdict == "equivalent"
    assert run_numeric(case, 2, mode=mode).agree
