"""all_to_all (`all_to_all_single`, ir/all_to_all.py): output piece j on rank r is input piece r on
rank j; the inverse all_to_all puts every row back. Each rule's terms are evaluated against torch's
threaded process group (the oracle), and every verification also runs numerically and agrees.
Split sizes that do not pair up are unusable input (a real run fails or hangs), named at the call."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from shardproof.case import Case, normalize_output
from shardproof.ir.graph import Graph
from shardproof.oracle import _run_ranks
from shardproof.relations.evaluate import evaluate
from shardproof.relations.execute import CollectiveMismatch, execute

HIDDEN = 8


def _uneven(rank: int, world_size: int) -> list[int]:
    """Rank `rank`'s input splits: 2 rows to every other rank, 1 to the rest (3W/2 rows in all)."""
    return [1 + (rank + j) % 2 for j in range(world_size)]


def _rank_graph(rank: int, world_size: int, splits) -> Graph:
    graph = Graph(rank=rank)
    sent = splits(rank, world_size)
    x = graph.add("leaf", (), (f"x:{rank}",), (sum(sent), 3), "float32", "x")
    received = tuple(splits(j, world_size)[rank] for j in range(world_size))
    out = graph.add("all_to_all", (x,), (received, tuple(sent), tuple(range(world_size))), (sum(received), 3), "float32", "y")
    back = graph.add("all_to_all", (out,), (tuple(sent), received, tuple(range(world_size))), (sum(sent), 3), "float32", "z")
    graph.outputs = [out, back]
    return graph


def _threaded(world_size: int, xs: list[torch.Tensor], splits) -> list[torch.Tensor]:
    """What torch's all_to_all_single gives each rank, run by the oracle's threaded group."""
    def body(rank: int) -> torch.Tensor:
        received = [splits(j, world_size)[rank] for j in range(world_size)]
        out = xs[rank].new_empty(sum(received), xs[rank].shape[1])
        dist.all_to_all_single(out, xs[rank], received, splits(rank, world_size))
        return out

    results, hung = _run_ranks(body, world_size)
    assert not hung
    return results


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("splits", [lambda r, n: [1] * n, _uneven], ids=["even", "uneven"])
def test_received_pieces_are_the_sent_pieces_and_the_inverse_puts_them_back(world_size: int, splits) -> None:
    graphs = [_rank_graph(r, world_size, splits) for r in range(world_size)]
    run = execute(Graph(), graphs)
    xs = [torch.randn(sum(splits(r, world_size)), 3, dtype=torch.float64) for r in range(world_size)]
    leaves = {f"x:{r}": x for r, x in enumerate(xs)}
    expected = _threaded(world_size, xs, splits)
    for r, graph in enumerate(graphs):
        out, back = (run.ranks[r][o] for o in graph.outputs)
        torch.testing.assert_close(evaluate(run.rules.u, out, leaves), expected[r], rtol=0, atol=0)
        assert back == run.rules.leaf(f"x:{r}", (sum(splits(r, world_size)), 3), "float32")  # the identity, proven


def test_splits_that_do_not_pair_up_are_a_mismatch_naming_both_ranks() -> None:
    """Rank 1 expects 1 row from rank 0, which sends it 2: a real run fails or reads the wrong rows."""
    graphs = [_rank_graph(r, 2, _uneven) for r in range(2)]
    node = graphs[1].nodes[1]
    graphs[1].nodes[1] = dataclasses.replace(node, attrs=((1, 2), node.attrs[1], node.attrs[2]), shape=(3, 3))
    with pytest.raises(CollectiveMismatch, match=r"rank 1 calls all_to_all over ranks \[0, 1\] expecting 1 row\(s\) from "
                                                 r"rank 0 \(output splits \[1, 2\]\), but rank 0 sends it 2"):
        execute(Graph(), graphs)


# --- programs: tokens sharded on entry and exit, columns in the middle (Ulysses' switch) ----------
class _ColumnSoftmax(nn.Module):
    """A softmax over all tokens, column by column: a rank needs every token of its columns."""

    def __init__(self) -> None:
        super().__init__()
        self.into, self.out = nn.Linear(HIDDEN, HIDDEN, bias=False), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mixed(self.into(x)))

    def mixed(self, h: torch.Tensor) -> torch.Tensor:
        return torch.softmax(h, dim=0)


class _Switched(_ColumnSoftmax):
    """Rank r holds tokens chunk r; an all_to_all gives it columns r of every token, the inverse
    gives the tokens back. `exchange(t)` is one of the all_to_all spellings, `bug` a wrong view."""

    def __init__(self, world_size: int, exchange, bug: bool = False) -> None:
        super().__init__()
        self.world_size, self.exchange, self.bug = world_size, exchange, bug

    def mixed(self, h: torch.Tensor) -> torch.Tensor:
        tokens, n = h.shape[0], self.world_size
        pieces = h.view(tokens, n, HIDDEN // n)
        pieces = pieces.reshape(n, tokens, HIDDEN // n) if self.bug else pieces.transpose(0, 1).contiguous()
        columns = self.exchange(pieces).reshape(n * tokens, HIDDEN // n)  # every token, columns r
        mixed = torch.softmax(columns, dim=0).reshape(n, tokens, HIDDEN // n)
        return self.exchange(mixed).transpose(0, 1).reshape(tokens, HIDDEN)


def _in_place(t: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(t)
    dist.all_to_all_single(out, t)
    return out


def _functional(t: torch.Tensor) -> torch.Tensor:
    return funcol.all_to_all_single_autograd(t, None, None, dist.group.WORLD)


def _case(exchange, world_size: int, bug: bool = False, train: bool = False) -> Case:
    return Case(_ColumnSoftmax, lambda r, n: _Switched(n, exchange, bug), lambda: (torch.randn(4 * world_size, HIDDEN),),
                world_size, None, lambda i, x, r, n: x.chunk(n)[r], normalize_output(("shard", 0)),
                loss=_loss if train else None, distributed_step=_step if train else None, mode="train" if train else "forward")


def _loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).sum()


def _step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """Each rank's share of the loss over its tokens; the weights' gradients summed over ranks."""
    local = _loss(model(*inputs), *inputs)
    local.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad)
    total = local.detach().clone()
    dist.all_reduce(total)
    return total


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("exchange", [_in_place, _functional], ids=["all_to_all_single", "funcol"])
def test_tokens_to_columns_and_back_is_proven(exchange, world_size: int, checked) -> None:
    assert checked(_case(exchange, world_size), world_size).verdict == "equivalent"


def test_training_through_the_functional_all_to_all_is_proven(checked) -> None:
    """The backward of an all_to_all is the inverse all_to_all (the split lists swapped)."""
    assert checked(_case(_functional, 2, train=True), 2).verdict == "equivalent"


def test_pieces_cut_along_the_wrong_dim_are_a_discrepancy(checked) -> None:
    assert checked(_case(_in_place, 2, bug=True), 2).verdict == "discrepancy"
