"""Capture of what framework code does around a model (transformers' loader and cache are the
example): DTensor shard offsets asked for in a loader, `state_dict()` reads of the model's own
tensors, an empty tensor a cache starts from, and fused attention in a training step. Each case is
proven and its numbers agree."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from shardproof import verify
from shardproof.case import Case
from shardproof.oracle import run_numeric

HIDDEN, FFN, HEADS = 8, 16, 4


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _parallel_mlp(rank: int, world_size: int) -> nn.Module:
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    return parallelize_module(Mlp(), init_device_mesh("cpu", (world_size,)), plan)


def _loader_asking_dtensor_offsets(model_of):
    """A checkpoint loader that reads the model's state dict (as `from_pretrained` does) and cuts
    each shard where DTensor says it starts."""

    def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
        model = model_of()
        assert set(model.state_dict()) == set(ref_state)
        shards = {}
        for name, held in model.state_dict(keep_vars=True).items():
            shape, offset = compute_local_shape_and_global_offset(held.shape, held.device_mesh, held.placements)
            shards[name] = ref_state[name][tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        return shards

    return shard_state


def _case() -> Case:
    built = threading.local()  # the model this rank built (the numeric oracle runs ranks as threads)

    def distributed(rank: int, world_size: int) -> nn.Module:
        built.model = _parallel_mlp(rank, world_size)
        assert all(isinstance(p, DTensor) for p in built.model.parameters())
        return built.model

    return Case(Mlp, distributed, lambda: (torch.randn(3, HIDDEN),), shard_state=_loader_asking_dtensor_offsets(
        lambda: built.model), loss=lambda out, x: out.pow(2).mean())


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_a_loader_asking_dtensor_for_shard_offsets_and_the_state_dict_is_traced(mode: str) -> None:
    """The offsets are metadata (computed for real, not faked); the state dict's reads of the
    model's own tensors compute nothing the program uses (dropped before lowering)."""
    report = verify(_case(), world_size=2, train=mode == "train")
    assert report.verdict == "equivalent", report.diagnosis
    assert run_numeric(_case(), 2, mode=mode).agree


class GrowingCache(nn.Module):
    """Keys appended to a cache that starts as an empty tensor (transformers' DynamicLayer)."""

    def __init__(self) -> None:
        super().__init__()
        self.k = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cache = torch.tensor([], dtype=x.dtype, device=x.device)
        return torch.cat([cache, self.k(x)], dim=-1)


def test_an_empty_tensor_made_in_the_program_is_a_constant_with_no_values() -> None:
    plan = {"k": ColwiseParallel(output_layouts=torch.distributed.tensor.Replicate())}
    case = Case(GrowingCache, lambda rank, n: parallelize_module(GrowingCache(), init_device_mesh("cpu", (n,)), plan),
                lambda: (torch.randn(3, HIDDEN),))
    assert verify(case, world_size=2).verdict == "equivalent"
    assert run_numeric(case, 2).agree


class Attention(nn.Module):
    """Multi-head self-attention by `scaled_dot_product_attention`, heads split by TP."""

    def __init__(self, heads: int = HEADS) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(3))
        self.out = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (p(x).unflatten(-1, (-1, HIDDEN // HEADS)).transpose(1, 2) for p in self.qkv)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


def _parallel_attention(rank: int, world_size: int) -> nn.Module:
    plan = {**{f"qkv.{i}": ColwiseParallel() for i in range(3)}, "out": RowwiseParallel()}
    return parallelize_module(Attention(), init_device_mesh("cpu", (world_size,)), plan)


def test_fused_attention_is_differentiated_by_its_math_path() -> None:
    """The CPU flash kernel's backward is one op over all heads; by the math path a rank's
    gradient is its heads' share of the reference's."""
    case = Case(Attention, _parallel_attention, lambda: (torch.randn(2, 5, HIDDEN),),
                loss=lambda out, x: out.pow(2).mean())
    report = verify(case, world_size=2, train=True)
    assert report.verdict == "equivalent", report.diagnosis
    assert run_numeric(case, 2, mode="train").agree
