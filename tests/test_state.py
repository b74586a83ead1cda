"""The default loader (no `shard_state`): each rank's tensor cut from the reference's by the shape
rule the graph importers share, checked against torch's own chunking."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.state import local_shards


def _case() -> Case:
    return Case(reference=lambda: torch.nn.Identity(), distributed=lambda r, n: torch.nn.Identity(), inputs=lambda: ())


def _model(**shapes: tuple[int, ...]) -> torch.nn.Module:
    model = torch.nn.Module()
    for name, shape in shapes.items():
        model.register_parameter(name, torch.nn.Parameter(torch.empty(shape)))
    return model


@pytest.mark.parametrize("world_size", [2, 4])
def test_equal_shapes_copy_and_one_smaller_dim_is_a_chunk(world_size: int) -> None:
    ref = {"w": torch.randn(8, 12), "b": torch.randn(12), "n": torch.randn(6)}
    model = _model(w=(8, 12 // world_size), b=(12 // world_size,), n=(6,))
    for rank in range(world_size):
        local = local_shards(_case(), ref, model, rank, world_size)
        assert torch.equal(local["w"], ref["w"].chunk(world_size, 1)[rank])
        assert torch.equal(local["b"], ref["b"].chunk(world_size, 0)[rank])
        assert local["n"] is ref["n"]


def test_a_tensor_no_rule_fits_names_itself_and_the_fix() -> None:
    model = _model(w=(3, 5))
    with pytest.raises(CaseError, match=r"cannot infer how `w` \(3, 5\) is cut from the reference \(8, 12\).*shard_state"):
        local_shards(_case(), {"w": torch.randn(8, 12)}, model, 0, 2)


@pytest.mark.parametrize(
    ("placements", "rows", "columns"),
    [
        # FSDP2 over a ColwiseParallel weight: the dp shard of the tp shard; rank (d, t) holds rows
        # t * 4 + d * 2 + [0, 2) of 8 (the table of _StridedShard's docstring)
        ((_StridedShard(0, split_factor=2), Shard(0)), lambda d, t: (t * 4 + d * 2, t * 4 + d * 2 + 2), lambda d, t: (0, 6)),
        # FSDP2 over a RowwiseParallel weight: tp cuts columns, dp rows
        ((Shard(0), Shard(1)), lambda d, t: (d * 4, d * 4 + 4), lambda d, t: (t * 3, t * 3 + 3)),
    ],
)
def test_dtensor_placements_on_a_2d_mesh_cut_as_dtensor_does(placements, rows, columns) -> None:
    """The default loader cuts a DTensor parameter by its placements mesh dim by mesh dim, a
    `_StridedShard` by its own split, into a contiguous local tensor (FSDP2 views it flat)."""
    full = torch.arange(48.0).reshape(8, 6)
    for rank in range(4):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
        try:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            d, t = mesh.get_coordinate()
            (r0, r1), (c0, c1) = rows(d, t), columns(d, t)
            held = DTensor.from_local(torch.empty(r1 - r0, c1 - c0), mesh, placements, run_check=False, shape=full.shape,
                                      stride=full.stride())
            model = torch.nn.Module()
            model.register_buffer("w", held)  # (nn.Parameter would keep the first fake group's mesh)
            local = local_shards(_case(), {"w": full}, model, rank, 4)["w"]
        finally:
            dist.destroy_process_group()
        assert local.is_contiguous()
        assert torch.equal(local, full[r0:r1, c0:c1])
