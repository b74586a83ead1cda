"""The numeric oracle on hand-written cases: correct TP agrees, a missing all-reduce does not."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from shardproof import verify
from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.oracle import run_numeric

HIDDEN, FFN = 8, 16


class Mlp(nn.Module):
    def __init__(self, ffn: int = FFN, reduce: bool = False):
        super().__init__()
        self.up = nn.Linear(HIDDEN, ffn)
        self.down = nn.Linear(ffn, HIDDEN, bias=False)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x)))
        if self.reduce:
            dist.all_reduce(y)
        return y


def _inputs() -> tuple:
    return (torch.randn(2, 3, HIDDEN),)


def _megatron_case(reduce: bool) -> Case:
    return Case(reference=Mlp, distributed=lambda rank, n: Mlp(FFN // n, reduce), inputs=_inputs)


def _dtensor_mlp(rank: int, n: int) -> nn.Module:
    mesh = init_device_mesh("cpu", (n,))
    return parallelize_module(Mlp(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_megatron_mlp_agrees(world_size: int) -> None:
    result = run_numeric(_megatron_case(reduce=True), world_size)
    assert result.agree, result.detail
    assert result.max_abs_error < 1e-12
    assert not dist.is_initialized()


@pytest.mark.parametrize("world_size", [2, 4])
def test_missing_all_reduce_disagrees(world_size: int) -> None:
    result = run_numeric(_megatron_case(reduce=False), world_size)
    assert not result.agree
    assert result.detail.startswith("rank ")


@pytest.mark.parametrize("world_size", [2, 4])
def test_dtensor_mlp_agrees(world_size: int) -> None:
    case = Case(reference=Mlp, distributed=_dtensor_mlp, inputs=_inputs)
    result = run_numeric(case, world_size)
    assert result.agree, result.detail


def test_shard_layout_and_shape_mismatch() -> None:
    """A column-parallel layer without gather: its shards concatenate to the reference output."""
    ref = lambda: nn.Linear(HIDDEN, FFN)  # noqa: E731
    sharded = Case(reference=ref, distributed=lambda r, n: nn.Linear(HIDDEN, FFN // n), inputs=_inputs,
                   shard_state=lambda s, r, n: {k: v.chunk(n, 0)[r] for k, v in s.items()}, output=("shard", -1))
    assert run_numeric(sharded, 4).agree
    replicated = dataclasses.replace(sharded, output=("replicate",))
    result = run_numeric(replicated, 4)
    assert not result.agree and "shape" in result.detail


class _RowwiseIdentity(nn.Module):
    """Each rank returns its own rows of the input, here picked by the zigzag layout."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2 * x


def _zigzag_rows(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    chunks = full.chunk(2 * world_size, 0)
    return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]])


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zigzag_output_layout(world_size: int) -> None:
    """Under ("shard", 0, "zigzag") rank r holds chunks r and 2W-1-r of 2W; read in rank order, it does not."""
    inputs = lambda: (torch.randn(16, 3),)  # noqa: E731
    zigzag = Case(reference=_RowwiseIdentity, distributed=lambda r, n: _RowwiseIdentity(), inputs=inputs,
                  shard_input=_zigzag_rows, output=("shard", 0, "zigzag"))
    assert run_numeric(zigzag, world_size).agree
    assert verify(zigzag, world_size=world_size).verdict == "equivalent"
    in_rank_order = dataclasses.replace(zigzag, output=("shard", 0))
    assert run_numeric(in_rank_order, world_size).agree == (world_size == 1)
    assert (verify(in_rank_order, world_size=world_size).verdict == "equivalent") == (world_size == 1)


def test_rank_dependent_collectives_report_a_hang() -> None:
    class OnlyRankZeroReduces(Mlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = super().forward(x)
            if dist.get_rank() == 0:
                dist.all_reduce(y)
            return y

    case = Case(reference=Mlp, distributed=lambda r, n: OnlyRankZeroReduces(FFN // n), inputs=_inputs)
    result = run_numeric(case, 2)
    assert not result.agree and "never finished" in result.detail
    assert run_numeric(_megatron_case(reduce=True), 2).agree  # the oracle recovers


def test_rank_exception_propagates_and_leaves_no_threads() -> None:
    before = threading.active_count()

    def broken(rank: int, n: int) -> nn.Module:
        if rank == 1:
            raise ValueError("bad rank")
        return Mlp(FFN // n, reduce=True)

    with pytest.raises(CaseError, match=r"raises on rank 1 at test_oracle.py:\d+ \(`raise ValueError\(\"bad rank\"\)`\): ValueError: bad rank"):
        run_numeric(Case(reference=Mlp, distributed=broken, inputs=_inputs), 2)
    assert threading.active_count() == before
    assert not dist.is_initialized()
    assert torch.get_default_dtype() == torch.float32


def test_seeded_and_deterministic() -> None:
    case = _megatron_case(reduce=True)
    assert run_numeric(case, 2, seed=3).max_abs_error == run_numeric(case, 2, seed=3).max_abs_error


class HalfPrecisionMlp(Mlp):
    """A bf16 model fed bf16 activations whose output is cast back: the arithmetic is the reference's."""

    def __init__(self) -> None:
        super().__init__()
        self.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(torch.bfloat16)).float()


def test_float_casts_are_the_identity() -> None:
    """The prover reads casts between float dtypes as the identity; the oracle runs them in float64."""
    case = Case(reference=Mlp, distributed=lambda rank, n: HalfPrecisionMlp(), inputs=_inputs)
    result = run_numeric(case, 2)
    assert result.agree, result.detail
    assert result.max_abs_error < 1e-12


class _WideGather(nn.Module):
    """Every rank's `up(x)` gathered into a buffer twice as wide: in memory order, as NCCL fills it."""

    def __init__(self, distributed: bool):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.distributed = distributed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.up(x)
        if not self.distributed:
            return torch.cat([y, y]).view(y.shape[0], -1)
        out = torch.empty(y.shape[0], 2 * y.shape[1])
        dist.all_gather_into_tensor(out, y)
        return out


def test_all_gather_into_a_buffer_of_another_shape_fills_flat_memory() -> None:
    case = Case(reference=lambda: _WideGather(False), distributed=lambda rank, n: _WideGather(True),
                inputs=lambda: (torch.randn(3, HIDDEN),))
    result = run_numeric(case, 2)
    assert result.agree, result.detail


class _SummedRows(nn.Module):
    """The sum of `up(x)` over the rows, flat; a rank sums its own rows into a flat buffer and
    reduce-scatters it in place (its output a chunk of its input, as Megatron's gradient buffers)."""

    def __init__(self, distributed: bool):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN)
        self.distributed = distributed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = self.up(x).sum(0)
        if not self.distributed:
            return buffer
        chunk = buffer.numel() // dist.get_world_size()
        mine = buffer[dist.get_rank() * chunk : (dist.get_rank() + 1) * chunk]
        dist.reduce_scatter_tensor(mine, buffer)
        return mine


@pytest.mark.parametrize("world_size", [2, 4])
def test_a_reduce_scatter_in_place_reads_every_input_before_writing(world_size: int) -> None:
    case = Case(reference=lambda: _SummedRows(False), distributed=lambda rank, n: _SummedRows(True),
                inputs=lambda: (torch.randn(8, HIDDEN),), shard_input=lambda i, full, rank, n: full.chunk(n)[rank],
                output=("shard", 0))
    result = run_numeric(case, world_size)
    assert result.agree, result.detail
    assert verify(case, world_size=world_size).verdict == "equivalent"


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.out(x)


def _vocab_sharded_head(rank: int, n: int) -> nn.Module:
    plan = {"out": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(_Head(), init_device_mesh("cpu", (n,)), plan)


def _cross_entropy(logits: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits, labels)


def _loss_parallel_step(model: nn.Module, inputs: tuple, rank: int, n: int) -> torch.Tensor:
    with loss_parallel():
        loss = _cross_entropy(model(*inputs), *inputs)
        loss.backward()
    return loss


class _EmptyIsNaN(nn.Module):
    """The reference says 1 everywhere; a rank says where memory it allocated and never wrote is NaN."""

    def __init__(self, distributed: bool):
        super().__init__()
        self.distributed = distributed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.distributed:
            return torch.ones_like(x)
        return torch.cat([torch.isnan(torch.empty_like(x)), torch.isnan(x.new_empty(x.shape))]).view(2, *x.shape).all(0).to(x.dtype)


def test_memory_nothing_wrote_holds_nan_not_what_the_allocator_left() -> None:
    """So a read of it never agrees by chance (the allocator may hand back a freed tensor's memory,
    the reference's very values)."""
    case = Case(reference=lambda: _EmptyIsNaN(False), distributed=lambda rank, n: _EmptyIsNaN(True),
                inputs=lambda: (torch.randn(64, 16),))
    result = run_numeric(case, 2)
    assert result.agree, result.detail


@pytest.mark.parametrize("world_size", [2, 4])
def test_loss_parallel_runs_on_every_rank_thread(world_size: int) -> None:
    """loss_parallel() installs process-wide handlers: one rank leaving it must not remove them
    from the ranks still inside."""
    case = Case(reference=_Head, distributed=_vocab_sharded_head,
                inputs=lambda: (torch.randn(6, HIDDEN), torch.arange(6) * 5 % FFN),
                loss=_cross_entropy, distributed_step=_loss_parallel_step, mode="train")
    result = run_numeric(case, world_size)
    assert result.agree, result.detail


@pytest.mark.parametrize("a_shape, b_shape, ends", [
    ((8, 4), (3, 4, 8), [2, 2, 8]),  # row groups of a 2-D a, one matrix of b each (an MoE's experts)
    ((3, 8, 4), (4, 8), [4, 4, 8]),  # column groups of a 2-D b
    ((4, 8), (8, 4), [4, 8]),  # groups of the contracted dim, one product each
])
def test_grouped_mm_runs_in_float64_as_torch_runs_it_in_float32(a_shape: tuple, b_shape: tuple, ends: list) -> None:
    """torch's CPU `_grouped_mm` takes float32 at most; the oracle's float64 one agrees with it on
    every layout, uneven and empty groups included."""
    from shardproof.oracle import _grouped_mm

    a, b, offs = torch.randn(a_shape), torch.randn(b_shape), torch.tensor(ends, dtype=torch.int32)
    expected = torch._grouped_mm(a, b, offs=offs)
    assert torch.allclose(_grouped_mm(a.double(), b.double(), offs).float(), expected, atol=1e-5)


class FlexHeads(nn.Module):
    """FlexAttention (a higher-order op, compiled as torchtitan compiles it) over a rank's heads."""

    attend = staticmethod(torch.compile(flex_attention))

    def __init__(self, heads: int = 4, causal: bool = True):
        super().__init__()
        self.q = nn.Linear(HIDDEN, heads * 2, bias=False)
        self.heads, self.causal = heads, causal

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, 2).transpose(1, 2)
        mask = create_block_mask(lambda b, h, i, j: (i >= j) | (not self.causal), None, None, s, s, device="cpu")
        return FlexHeads.attend(q, q, q, block_mask=mask).transpose(1, 2).reshape(b, s, -1)


@pytest.mark.parametrize("causal", [True, False])
def test_flex_attention_runs_its_dense_math_in_float64(causal: bool) -> None:
    """Ranks holding half the heads agree with the reference; a rank masking differently does not."""
    case = Case(FlexHeads, lambda rank, n: FlexHeads(4 // n, causal or rank == 0), lambda: (torch.randn(1, 4, HIDDEN),),
                output=("shard", 2))
    assert run_numeric(case, 2).agree == causal


class GroupAware(nn.Module):
    """Code that reduces over its process group whatever its size, Megatron's way: on one device
    (the reference) a world of one, where the sum is the value itself."""

    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.mlp = Mlp(ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        dist.all_reduce(y)
        return y


def test_the_reference_runs_as_rank_0_of_a_world_of_one() -> None:
    case = Case(GroupAware, lambda rank, n: GroupAware(FFN // n), _inputs)
    assert run_numeric(case, 2).agree
    assert verify(case, world_size=2).verdict == "equivalent"
