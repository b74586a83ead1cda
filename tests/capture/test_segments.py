"""Numeric tests of the fixed-shape form of split sizes read off the routing (`capture/segments.py`).

Each rank's program is traced by make_fx with its `.tolist()` sizes unbacked, rewritten, and the
rewritten graph is run beside the program itself under a threaded group, on routings given as data:
random ones and the extremes (every pair to one expert, so all but one rank receive nothing).
What cannot be rewritten is refused at its op."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardproof.capture.segments import Densifier
from shardproof.oracle import _run_ranks

EXPERTS, TOP_K, HIDDEN, TOKENS = 8, 2, 4, 6  # tokens per rank


def dispatch(x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor, in_token_order: bool = True) -> torch.Tensor:
    """torchtitan's all_to_all token dispatch and combine (tests/cases/moe-a2a-tolist_fixed.py), the
    routing given; `in_token_order=False`: the results summed as if they came back in token order."""
    n, group = dist.get_world_size(), dist.group.WORLD
    local = EXPERTS // n
    order = torch.argsort(chosen.view(-1), stable=True)
    routed = x[order // TOP_K]
    counts = torch.zeros(EXPERTS, dtype=torch.long).scatter_add(0, chosen.view(-1), torch.ones_like(chosen.view(-1)))
    counts_here = funcol.all_to_all_single(counts, None, None, group)
    input_splits = counts.view(n, -1).sum(1).tolist()
    output_splits = counts_here.view(n, -1).sum(1).tolist()
    received = funcol.all_to_all_single_autograd(routed, output_splits, input_splits, group)
    segments = list(received.split(counts_here.tolist()))
    by_expert = [segments[j * local + e] for e in range(local) for j in range(n)]
    grouped = torch.cat(by_expert).split(counts_here.view(n, local).sum(0).tolist())
    outputs = torch.cat([rows @ experts[e] for e, rows in enumerate(grouped)])
    done = list(outputs.split(counts_here.view(n, local).t().reshape(-1).tolist()))
    rank_major = torch.cat([done[e * n + j] for j in range(n) for e in range(local)])
    returned = funcol.all_to_all_single_autograd(rank_major, input_splits, output_splits, group)
    weighted = returned * gates.view(-1)[order].unsqueeze(1)
    if in_token_order:
        return torch.zeros_like(x).index_add(0, order // TOP_K, weighted)
    return weighted.view(-1, TOP_K, HIDDEN).sum(1)


def routings(world: int) -> list[torch.Tensor]:
    """Per rank (tokens, k) expert ids: random, everything to the last expert, to expert 0."""
    g = torch.Generator().manual_seed(world)
    drawn = [torch.randint(0, EXPERTS, (TOKENS, TOP_K), generator=g) for _ in range(world)]
    return [drawn, [torch.full((TOKENS, TOP_K), EXPERTS - 1)] * world, [torch.zeros(TOKENS, TOP_K, dtype=torch.long)] * world]


@contextlib.contextmanager
def fake_group(rank: int, world: int) -> Iterator[None]:
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Refused(Exception):
    pass


def rewritten(fn: Callable, args: tuple, rank: int, world: int) -> fx.GraphModule:
    """`fn` traced on rank `rank` with its sizes unbacked, rewritten in fixed-shape form."""
    with fake_group(rank, world), torch._dynamo.config.patch(capture_scalar_outputs=True):
        gm = make_fx(fn, tracing_mode="fake")(*args)
        Densifier(gm.graph, rank, world, lambda node, needs: Refused(f"{node.target}: {needs}")).run()
    gm.graph.lint()
    gm.recompile()
    assert not any(n.target is torch.ops.aten._local_scalar_dense.default for n in gm.graph.nodes)
    return gm


def rank_inputs(world: int, chosen: list[torch.Tensor]) -> list[tuple]:
    g = torch.Generator().manual_seed(7)
    experts = torch.randn(EXPERTS, HIDDEN, HIDDEN, generator=g, dtype=torch.float64)
    local = EXPERTS // world
    return [(torch.randn(TOKENS, HIDDEN, generator=g, dtype=torch.float64), chosen[r],
             torch.rand(TOKENS, TOP_K, generator=g, dtype=torch.float64), experts[r * local : (r + 1) * local])
            for r in range(world)]


@pytest.mark.parametrize(("world", "in_token_order"), [(1, True), (2, True), (2, False), (4, True)])
def test_the_fixed_shape_form_computes_what_the_dispatcher_does_for_every_routing_tried(world: int, in_token_order: bool) -> None:
    """Counts exchanged, a variable all_to_all out and back, segments regrouped by expert, a GEMM
    per expert, the unsort by index_add (or, in the twin, the sorted rows summed as they are): the
    rewritten graph of each rank agrees with the program run as written."""
    def program(*args: torch.Tensor) -> torch.Tensor:
        return dispatch(*args, in_token_order=in_token_order)

    first = rank_inputs(world, routings(world)[0])
    graphs = [rewritten(program, first[r], r, world) for r in range(world)]  # one trace for every routing
    for chosen in routings(world):
        inputs = rank_inputs(world, chosen)
        runs, _ = _run_ranks(lambda r: (program(*inputs[r]), graphs[r](*inputs[r])), world)
        for written, dense in runs:
            torch.testing.assert_close(dense, written)


def test_the_sorted_segments_are_masks_of_the_pairs_in_their_own_order() -> None:
    """The law under the split: rows sorted by a stable argsort of k, split by k's counts, give for
    each key e the rows with k == e in their first order (a stable sort keeps equal keys' order)."""
    g = torch.Generator().manual_seed(0)
    for keys in (torch.randint(0, 5, (40,), generator=g), torch.zeros(40, dtype=torch.long), torch.arange(40) % 5):
        rows = torch.randn(40, 3, generator=g)
        counts = torch.zeros(5, dtype=torch.long).scatter_add(0, keys, torch.ones_like(keys))
        pieces = rows[torch.argsort(keys, stable=True)].split(counts.tolist())
        for e, piece in enumerate(pieces):
            torch.testing.assert_close(piece, rows[keys == e])


def test_index_add_of_rows_permuted_alike_is_index_add_of_the_rows() -> None:
    """index_add(base, 0, ids[p], rows[p]) = index_add(base, 0, ids, rows) for a permutation p."""
    g = torch.Generator().manual_seed(1)
    ids, rows = torch.randint(0, 4, (12,), generator=g), torch.randn(12, 3, generator=g, dtype=torch.float64)
    p = torch.randperm(12, generator=g)
    base = torch.randn(4, 3, generator=g, dtype=torch.float64)
    torch.testing.assert_close(base.index_add(0, ids[p], rows[p]), base.index_add(0, ids, rows))


def mismatched(x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Receive sizes that are this rank's own send sizes (moe-split-mismatch's bug, read off counts)."""
    order = torch.argsort(chosen.view(-1), stable=True)
    counts = torch.zeros(EXPERTS, dtype=torch.long).scatter_add(0, chosen.view(-1), torch.ones_like(chosen.view(-1)))
    splits = counts.view(dist.get_world_size(), -1).sum(1).tolist()
    received = funcol.all_to_all_single(x[order // TOP_K], splits, splits, dist.group.WORLD)
    return funcol.all_to_all_single(received, splits, splits, dist.group.WORLD)[: x.shape[0]]


def unstable(x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """An unstable sort: equal keys in no known order."""
    order = torch.argsort(chosen.view(-1))
    counts = torch.zeros(EXPERTS, dtype=torch.long).scatter_add(0, chosen.view(-1), torch.ones_like(chosen.view(-1)))
    return torch.cat([rows.sum(0, keepdim=True) for rows in x[order // TOP_K].split(counts.tolist())])


def sized(x: torch.Tensor, chosen: torch.Tensor, gates: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A count used as a tensor's size."""
    counts = torch.zeros(EXPERTS, dtype=torch.long).scatter_add(0, chosen.view(-1), torch.ones_like(chosen.view(-1)))
    return torch.zeros(counts[0].item(), HIDDEN).sum(0) + x[0]


@pytest.mark.parametrize(("program", "needs"), [
    (mismatched, "receive sizes that are each peer's count"), (unstable, "a split of segments"), (sized, "a use of"),
])
def test_what_has_no_fixed_shape_form_is_refused(program: Callable, needs: str) -> None:
    inputs = rank_inputs(2, routings(2)[0])[0]
    with pytest.raises(Refused, match=needs):
        rewritten(program, inputs, 0, 2)
