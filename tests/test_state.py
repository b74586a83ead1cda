"""The default loader (no `shard_state`): each rank's tensor cut from the reference's by the shape
rule the graph importers share, checked against torch's own chunking."""

from __future__ import annotations

import pytest
import torch

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
