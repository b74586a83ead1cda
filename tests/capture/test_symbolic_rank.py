"""One trace with a symbolic rank gives every rank it covers the graph that rank's own trace gives
(op for op, with the same lines); a rank whose program differs gets a trace of its own."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof.capture import torch_capture
from shardproof.case import Case, load_case
from shardproof.ir.graph import Graph
from shardproof.partition.templates import Template

EXAMPLES = Path(__file__).parents[2] / "examples"


def by_rank(case: Case, world_size: int, mode: str = "forward") -> tuple[int, list[Graph | None], list[Graph]]:
    """(classes found, each rank's graph from its class or None, each rank's own trace); what a
    class says of its ranks' parameters is what each one's own run says."""
    with torch_capture._session(case, world_size, mode) as session:
        bound = []
        if session.program.bound:  # a training step's reference gradients
            reference = torch_capture._trace_reference(session, True, lambda _: None)
            bound = [torch_capture._placeholder(reference, i) for i in session.program.bound]
        classes = torch_capture._RankClasses(session, True, bound)
        symbolic = [classes.graph(rank) for rank in range(world_size)]
        own = [torch_capture._trace_rank(session, rank, bound, memo=True) for rank in range(world_size)]
    for mine, theirs in zip(symbolic, own):
        assert mine is None or mine[1] == theirs[1]
    return len(classes.found), [None if found is None else found[0] for found in symbolic], [graph for graph, _ in own]


def numbered(graph: Graph, table: dict) -> list[int]:
    """Value numbers of the outputs: equal numbers, equal programs (ops, attrs, shapes, lines; not
    the line that chose a rank, `Location.rank_chosen`, which only a symbolic rank remembers)."""
    numbers: list[int] = []
    for node in graph.nodes:
        attrs = node.attrs
        if node.op == "call":
            attrs = (tuple(numbered(attrs[0].graph, table)), *attrs[1:]) if isinstance(attrs[0], Template) else attrs
        loc = node.loc and dataclasses.replace(node.loc, rank_chosen=None)
        key = (node.op, repr(attrs), node.shape, node.dtype, loc, tuple(numbers[i] for i in node.inputs))
        numbers.append(table.setdefault(key, len(table)))
    return [numbers[o] for o in graph.outputs]


def assert_same_programs(symbolic: list[Graph | None], own: list[Graph]) -> None:
    for rank, (mine, theirs) in enumerate(zip(symbolic, own)):
        assert mine is not None, f"rank {rank} was traced on its own"
        table: dict = {}
        assert numbered(mine, table) == numbered(theirs, table), f"rank {rank}"
        assert mine.rank == rank


@pytest.mark.parametrize("example, world_size", [("llama_tp.py", 4), ("llama_tp.py", 8), ("mlp_tp.py", 4)])
def test_one_trace_stands_for_every_rank_of_the_examples(example: str, world_size: int) -> None:
    found, symbolic, own = by_rank(load_case(EXAMPLES / example), world_size)
    assert found == 1
    assert_same_programs(symbolic, own)


@pytest.mark.parametrize("world_size", [2, 8])
def test_one_trace_stands_for_every_rank_of_a_training_step(world_size: int) -> None:
    """The loader over the parameters and over the reference gradients, the forward and the
    backward with Megatron's mappings (the logits' gather keeps `grad.chunk(world_size)[rank]`)."""
    found, symbolic, own = by_rank(load_case(EXAMPLES / "llama_tp.py"), world_size, "train")
    assert found == 1
    assert_same_programs(symbolic, own)


def test_one_trace_stands_for_every_rank_of_transformers_tp() -> None:
    """A mesh made in the rank's program (a 4-D one with one wide dim, and its TP slice), DTensor
    placeholders sharded at the symbolic coordinate, the loader's even shard offsets."""
    pytest.importorskip("transformers", minversion="5", reason="needs the hf extra: pip install 'shardproof[hf]'")
    from shardproof.integrations import transformers as integration
    found, symbolic, own = by_rank(integration.transformers_case(integration.tiny_config("llama"), world_size=4), 4)
    assert found == 1
    assert_same_programs(symbolic, own)


def test_a_mesh_scattering_its_parameters_is_traced_at_each_rank() -> None:
    """distribute_tensor's scatter (pad sizes indexed by the coordinate) pins the rank: each
    class holds at its own rank alone, with that rank's program."""
    found, symbolic, own = by_rank(load_case(EXAMPLES / "llama_dtensor.py"), 4)
    assert found == 2
    traced = [rank for rank, graph in enumerate(symbolic) if graph is not None]
    assert traced == [0, 1]
    assert_same_programs([symbolic[r] for r in traced], [own[r] for r in traced])


def test_kv_heads_shared_by_ranks_are_floor_quotients_of_the_rank() -> None:
    case = load_case(EXAMPLES / "llama_tp.py")
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, n_heads=8, n_kv_heads=2)
    found, symbolic, own = by_rank(case, 8)  # kv head rank // 4
    assert found == 1
    assert_same_programs(symbolic, own)


class _Sliced(nn.Module):
    """A layer whose rank-dependent parts are the ones the symbolic trace keeps: a slice of its
    input at the rank's offset (from `dist.get_rank()`), a mask against the rank as a scalar."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, width))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rank = dist.get_rank()
        part = x[:, rank * self.width : (rank + 1) * self.width]
        mask = (part > rank) | (rank * 2 <= part)
        out = torch.where(mask, part, part - rank) @ self.weight
        return torch.cat([out, x.narrow(1, rank * 2, 2)], dim=1)


def _case(distributed: Callable[[int, int], nn.Module], loader: Callable[..., dict], world_size: int = 4) -> Case:
    return Case(lambda: _Sliced(8), distributed, lambda: (torch.randn(3, 8 * world_size),), world_size,
                shard_state=loader)  # fmt: skip


def _shard(state: dict, rank: Any, world_size: int) -> dict:
    return {"weight": state["weight"]}


def test_slices_masks_and_narrow_at_the_rank_stay_symbolic() -> None:
    found, symbolic, own = by_rank(_case(lambda rank, ws: _Sliced(8), _shard), 4)
    assert found == 1
    assert_same_programs(symbolic, own)


def test_a_bug_on_one_rank_gets_a_trace_of_its_own() -> None:
    def loader(state: dict, rank: Any, world_size: int) -> dict:
        weight = state["weight"]
        return {"weight": weight[:, 1:] if rank == 2 else weight[:, : weight.shape[1] - 1]}

    def distributed(rank: Any, world_size: int) -> nn.Module:
        model = _Sliced(8)
        model.weight = nn.Parameter(torch.empty(8, 7))
        return model

    case = _case(distributed, loader)
    case.reference = lambda: _Sliced(8)
    found, symbolic, own = by_rank(case, 4)
    assert found == 2, "ranks 0, 1 and 3 share one trace, rank 2 has its own"
    assert_same_programs(symbolic, own)


@pytest.mark.parametrize(
    "pick",
    [
        lambda rank: [0, 3, 1, 2][rank],  # a list index: the value is pinned
        lambda rank: int(f"{rank}"),  # text
        lambda rank: len(range(rank)),
        lambda rank: {1: 3, 3: 1}.get(rank, rank),  # a dict lookup: a miss compares nothing, the hash pins
    ],
)
def test_a_rank_used_as_a_plain_int_is_traced_rank_by_rank(pick: Callable[[Any], int]) -> None:
    def loader(state: dict, rank: Any, world_size: int) -> dict:
        start = pick(rank) * 2
        return {"weight": torch.cat([state["weight"][:, start : start + 2]] * 4, dim=1)}

    found, symbolic, own = by_rank(_case(lambda rank, ws: _Sliced(8), loader), 4)
    assert found == 2, "each rank pinned: tracing symbolically stops after two classes of one rank"
    assert symbolic[2:] == [None, None]
    assert_same_programs(symbolic[:2], own[:2])


@pytest.mark.parametrize("world_size, classes", [(4, 1), (3, 2)])
def test_the_piece_at_the_rank_is_a_slice_where_the_pieces_are_equal(world_size: int, classes: int) -> None:
    """8 columns in 4 pieces of 2: the piece at the rank is a slice at a symbolic offset. In 3
    pieces (3, 3, 2) it is not: the index is pinned, each rank traced on its own."""

    def loader(state: dict, rank: Any, world_size: int) -> dict:
        weight = state["weight"]
        part = weight.chunk(world_size, dim=1)[rank]
        return {"weight": torch.cat([part, weight], dim=1)[:, :8]}

    found, symbolic, own = by_rank(_case(lambda rank, ws: _Sliced(8), loader, world_size), world_size)
    assert found == classes
    traced = [rank for rank, graph in enumerate(symbolic) if graph is not None]
    assert traced == ([0, 1, 2, 3] if classes == 1 else [0, 1])
    assert_same_programs([symbolic[r] for r in traced], [own[r] for r in traced])


class _Cut(nn.Module):
    """The rank's columns of an activation, read by a slice (`in_place=False`) or written into a
    slice of a buffer (`in_place=True`): either way the backward takes the rank's offsets."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.full = nn.Parameter(torch.empty(8, 8))
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, rank = x @ self.full, dist.get_rank()
        if not self.in_place:
            return h[:, rank * 2 : rank * 2 + 2]
        buffer = torch.zeros_like(h)
        buffer[:, rank * 2 : rank * 2 + 2].copy_(h[:, :2])
        return buffer


@pytest.mark.parametrize("in_place", [False, True])
def test_a_symbolic_slice_differentiated_holds_at_its_rank_alone(in_place: bool) -> None:
    """Autograd's backward formulas take a slice's offsets as ints: where one runs, each rank is
    traced on its own (the loader's slices, never differentiated, stay symbolic: see above)."""
    case = Case(lambda: _Cut(in_place), lambda rank, ws: _Cut(in_place), lambda: (torch.randn(3, 8),), 4,
                loss=lambda out, x: out.pow(2).mean())  # fmt: skip
    found, symbolic, own = by_rank(case, 4, "train")
    assert found == 2
    assert symbolic[2:] == [None, None]
    assert_same_programs(symbolic[:2], own[:2])


def test_a_slice_python_clamps_at_some_ranks_is_traced_again_there() -> None:
    def loader(state: dict, rank: Any, world_size: int) -> dict:
        weight = state["weight"]
        part = weight[:, rank * 3 : rank * 3 + 4]  # past the end at rank 2: [6:10] of 8 columns
        return {"weight": torch.cat([part, part], dim=1)[:, :8]}

    found, symbolic, own = by_rank(_case(lambda rank, ws: _Sliced(8), loader, world_size=3), 3)
    assert found == 2
    assert_same_programs(symbolic, own)


def _sub_meshes(world_size: int) -> tuple[Any, Any]:
    """torchtitan's way to its meshes: the world unflattened into a data-parallel dim of one rank
    and a tensor-parallel dim of all of them, both sliced out."""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (1, world_size), ("dp", "tp"))
    return mesh["dp"], mesh["tp"]


class _RowParallel(nn.Module):
    """The rank's columns of the input times its columns of the weight, summed over the
    tensor-parallel mesh's group; made beside a data-parallel mesh of one rank."""

    def __init__(self, rank: Any, world_size: int, read_members: bool) -> None:
        super().__init__()
        dp, self.tp = _sub_meshes(world_size)
        assert tuple(dp.get_coordinate()) == (0,)
        if read_members:  # the data-parallel mesh's one member is this rank: reading it pins the rank
            assert dp.mesh.tolist() == [int(rank)]
        self.weight = nn.Parameter(torch.empty(3, 8 // world_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width, rank = self.weight.shape[1], self.tp.get_coordinate()[0]
        out = x[:, rank * width : (rank + 1) * width] @ self.weight.T
        dist.all_reduce(out, group=self.tp.get_group())
        return out


@pytest.mark.parametrize("read_members", [False, True])
def test_a_mesh_of_one_rank_cut_from_the_world_holds_at_every_rank(read_members: bool) -> None:
    """Its coordinate is 0 at every rank; reading which rank it holds is guarded."""
    case = Case(lambda: nn.Linear(8, 3, bias=False), lambda rank, ws: _RowParallel(rank, ws, read_members),
                lambda: (torch.randn(5, 8),), 4)  # fmt: skip
    found, symbolic, own = by_rank(case, 4)
    assert found == (2 if read_members else 1)
    traced = [rank for rank, graph in enumerate(symbolic) if graph is not None]
    assert traced == ([0, 1] if read_members else [0, 1, 2, 3])
    assert_same_programs([symbolic[r] for r in traced], [own[r] for r in traced])


@torch.library.custom_op("shardproof_test::rank_columns", mutates_args=())
def rank_columns(x: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """A library's shard cut behind an op name taking the rank as an int (spmd_types' cuts)."""
    return torch.chunk(x, world_size, dim=-1)[rank].clone()


@rank_columns.register_fake
def _rank_columns_fake(x: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], -(-x.shape[-1] // world_size)))


class _CutByOp(nn.Module):
    """Its weight's placeholder cut by the op as the model is built; its input cut by it as it runs."""

    def __init__(self, world_size: int, rank: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(rank_columns(torch.empty(3, 8), world_size, rank))
        self.world_size = world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rank_columns(x, self.world_size, dist.get_rank()) @ self.weight.T


@pytest.mark.parametrize("world_size, classes", [(4, 1), (3, 2)])
def test_a_custom_op_given_the_rank_runs_its_kernel_on_the_symbol(world_size: int, classes: int) -> None:
    """While recording, the op's kernel slices at a symbolic offset; while the model is built, its
    placeholder cut is alike at every rank (8 columns in 4). In 3 pieces (3, 3, 2) the cuts
    differ in shape: the rank is pinned, each rank traced on its own."""

    def loader(state: dict, rank: Any, world_size: int) -> dict:
        return {"weight": rank_columns(state["weight"], world_size, rank)}

    case = Case(lambda: nn.Linear(8, 3, bias=False), lambda rank, ws: _CutByOp(ws, rank),
                lambda: (torch.randn(5, 8),), world_size, shard_state=loader)  # fmt: skip
    found, symbolic, own = by_rank(case, world_size)
    assert found == classes
    traced = [rank for rank, graph in enumerate(symbolic) if graph is not None]
    assert traced == (list(range(world_size)) if classes == 1 else [0, 1])
    assert_same_programs([symbolic[r] for r in traced], [own[r] for r in traced])


class _NotOnMeta(_Sliced):
    """Code that refuses meta tensors (FlexAttention checks its inputs' device so)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_meta:
            raise ValueError("meta tensors are not supported")
        return super().forward(x)


def test_a_program_refusing_meta_tensors_is_traced_symbolically_on_fake_ones() -> None:
    case = Case(lambda: _NotOnMeta(8), lambda rank, ws: _NotOnMeta(8), lambda: (torch.randn(3, 32),), 4,
                shard_state=_shard)  # fmt: skip
    found, symbolic, own = by_rank(case, 4)
    assert found == 1
    assert_same_programs(symbolic, own)


def test_one_trace_stands_for_every_rank_of_torchtitan() -> None:
    """Its meshes (data-parallel dims of one rank unflattened from the world), its spmd_types
    custom ops cutting sequence-parallel shards at the rank, FlexAttention on fake tensors."""
    pytest.importorskip("torchtitan", reason="needs the titan extra: pip install 'shardproof[titan]'")
    from shardproof.integrations.torchtitan import tiny_config, torchtitan_case
    found, symbolic, own = by_rank(torchtitan_case(tiny_config("llama3", sequence_parallel=True), 4), 4)
    assert found == 1
    assert_same_programs(symbolic, own)
