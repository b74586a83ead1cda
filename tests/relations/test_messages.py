"""Point-to-point messages (relations/messages.py): a recv is the tensor its channel's matching send
sent, proven and run numerically (the oracle's threaded group has send/recv, threaded_p2p.py); sends
and recvs that do not pair up are a discrepancy (`unmatched message`) at the send or recv, and the
oracle's run fails there too."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardproof import verify
from shardproof.case import Case, normalize_output
from shardproof.oracle import run_numeric

HIDDEN, FFN = 8, 16


def _reference() -> nn.Module:
    return nn.Sequential(nn.Linear(HIDDEN, FFN), nn.Tanh(), nn.Linear(FFN, HIDDEN))


def _inputs() -> tuple:
    return (torch.randn(3, HIDDEN),)


class _Column(nn.Module):
    """Rank r computes columns r of the hidden layer, `exchange` gives it everyone's."""

    def __init__(self, rank: int, world_size: int, exchange) -> None:
        super().__init__()
        self.rank, self.world_size, self.exchange = rank, world_size, exchange
        self.first = nn.Linear(HIDDEN, FFN // world_size)
        self.second = nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shard = torch.tanh(self.first(x))
        return self.second(torch.cat(self.exchange(shard, self.rank, self.world_size), dim=-1))


def _state(ref: dict, rank: int, world_size: int) -> dict:
    rows = FFN // world_size
    return {"first.weight": ref["0.weight"][rank * rows:(rank + 1) * rows], "first.bias": ref["0.bias"][rank * rows:(rank + 1) * rows],
            "second.weight": ref["2.weight"], "second.bias": ref["2.bias"]}


def _case(exchange, world_size: int) -> Case:
    return Case(_reference, lambda rank, n: _Column(rank, n, exchange), _inputs, world_size, _state, None,
                normalize_output("replicate"))


def _each_to_each(shard: torch.Tensor, rank: int, world_size: int, order=lambda peers: peers) -> list[torch.Tensor]:
    """Every rank sends its shard to every other with isend, and irecvs theirs (irecvs first)."""
    received = {peer: torch.empty_like(shard) for peer in range(world_size) if peer != rank}
    works = [dist.irecv(received[peer], src=peer) for peer in order(sorted(received))]
    works += [dist.isend(shard, dst=peer) for peer in sorted(received)]
    for work in works:
        work.wait()
    return [shard if peer == rank else received[peer] for peer in range(world_size)]


def _pipeline(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    """Blocking send/recv along a chain: rank r receives ranks 0..r-1's shards from rank r-1, adds
    its own, passes them on; the last rank sends everything back to the others."""
    got = []
    if rank > 0:
        for _ in range(rank):
            got.append(torch.empty_like(shard))
            dist.recv(got[-1], src=rank - 1)
    got.append(shard)
    if rank < world_size - 1:
        for piece in got:
            dist.send(piece, dst=rank + 1)
        rest = [torch.empty_like(shard) for _ in range(world_size - 1 - rank)]
        for piece in rest:
            dist.recv(piece, src=world_size - 1)
        return got + rest
    for peer in range(world_size - 1):
        for piece in got[peer + 1:]:
            dist.send(piece, dst=peer)
    return got


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("exchange", [_each_to_each, _pipeline], ids=["irecv-before-isend", "blocking-chain"])
def test_messages_pair_by_channel_order(exchange, world_size: int, checked) -> None:
    assert checked(_case(exchange, world_size), world_size).verdict == "equivalent"


def test_a_message_put_in_the_wrong_place_is_a_discrepancy(checked) -> None:
    swapped = lambda shard, rank, n: list(reversed(_each_to_each(shard, rank, n)))  # noqa: E731
    assert checked(_case(swapped, 2), 2).verdict == "discrepancy"


def test_recvs_in_another_order_than_the_sends_still_pair_per_channel(checked) -> None:
    """Channels are per peer: receiving from rank 3 before rank 1 changes nothing."""
    assert checked(_case(lambda s, r, n: _each_to_each(s, r, n, order=lambda p: p[::-1]), 4), 4).verdict == "equivalent"


def _recv_without_send(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    other = torch.empty_like(shard)
    if rank == 0:
        dist.recv(other, src=1)
    return [shard, other] if rank == 0 else [other, shard]


def _wrong_shape(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    if rank == 0:
        dist.send(shard, dst=1)
        return [shard, shard]
    other = torch.empty(shard.shape[0], shard.shape[1] + 1)
    dist.recv(other, src=0)
    return [other[:, :-1], shard]


def _never_received(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    if rank == 0:
        dist.send(shard, dst=1)
    return [shard, shard]


def _ring(shard: torch.Tensor, rank: int, world_size: int, wrap: bool = True) -> list[torch.Tensor]:
    """Each rank irecvs rank - 1's shard and isends its own to rank + 1 round a ring of two; without
    `wrap` the last rank sends past the end (the `% world_size` forgotten)."""
    other = torch.empty_like(shard)
    works = [dist.irecv(other, src=(rank - 1) % world_size),
             dist.isend(shard, dst=(rank + 1) % world_size if wrap else rank + 1)]
    for work in works:
        work.wait()
    return [shard, other] if rank == 0 else [other, shard]


def _past_the_last_rank(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    return _ring(shard, rank, world_size, wrap=False)


def _line(function, text: str) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


@pytest.mark.parametrize(("exchange", "words", "site"), [
    (_recv_without_send, "rank 0 waits to receive a tensor of shape (3, 8) from rank 1 (tag 0) at test_messages.py",
     (_recv_without_send, "dist.recv(other, src=1)")),
    (_wrong_shape, "rank 1 receives into a float32 tensor of shape (3, 9)", (_wrong_shape, "dist.recv(other, src=0)")),
    (_never_received, "rank 0 sends a tensor of shape (3, 8) to rank 1 (tag 0) at test_messages.py",
     (_never_received, "dist.send(shard, dst=1)")),
    (_past_the_last_rank, "rank 1 sends a tensor of shape (3, 8) to rank 2 at test_messages.py", (_ring, "dist.isend(shard")),
])
def test_unpaired_messages_are_a_discrepancy_at_the_send_or_recv(exchange, words: str, site: tuple) -> None:
    report = verify(_case(exchange, 2), world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "unmatched message", report.diagnosis
    assert words in report.diagnosis and report.distributed[0].line == _line(*site), report.distributed
    assert not _runs_alike(_case(exchange, 2), 2)


def _runs_alike(case: Case, world_size: int) -> bool:
    """The oracle's verdict: False when a rank hangs, fails or computes other numbers."""
    try:
        return run_numeric(case, world_size).agree
    except Exception:  # noqa: BLE001 - the program fails on some rank: it does not run alike
        return False


def test_the_ring_with_its_wrap_around_is_equivalent(checked) -> None:
    assert checked(_case(_ring, 2), 2).verdict == "equivalent"


def _neighbours(shard: torch.Tensor, rank: int, world_size: int, last_rank=lambda n: n - 1) -> list[torch.Tensor]:
    """A chain of stages: each sends its shard on to the next and back to the previous one."""
    first, last = rank == 0, rank == last_rank(world_size)
    other = torch.empty_like(shard)
    if not last:
        dist.send(shard, dst=rank + 1)
        dist.recv(other, src=rank + 1)
    if not first:
        dist.recv(other, src=rank - 1)
        dist.send(shard, dst=rank - 1)
    return [shard, other] if rank == 0 else [other, shard]


def _no_rank_last(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    return _neighbours(shard, rank, world_size, last_rank=lambda n: n)


def _two_ahead(shard: torch.Tensor, rank: int, world_size: int) -> list[torch.Tensor]:
    """The stages' roles right, the peer two ranks on."""
    other = torch.empty_like(shard)
    if rank < world_size - 1:
        dist.send(shard, dst=rank + 2)
    return [shard, other]


def test_a_stage_wrong_about_being_the_last_is_named_at_its_role_then_at_the_send(checked) -> None:
    """report/role_flow.py: the neighbour's rank is right; the comparison that made rank 1 a stage
    with a next one is the line to fix."""
    assert checked(_case(_neighbours, 2), 2).verdict == "equivalent"
    report = verify(_case(_no_rank_last, 2), world_size=2)
    assert report.verdict == "discrepancy" and report.kind == "unmatched message", report.diagnosis
    wanted = [_line(_neighbours, "first, last ="), _line(_neighbours, "dist.send(shard, dst=rank + 1)")]
    assert [s.line for s in report.distributed[:2]] == wanted, report.distributed
    assert not _runs_alike(_case(_no_rank_last, 2), 2)


def test_a_send_to_no_neighbour_is_named_at_the_send() -> None:
    report = verify(_case(_two_ahead, 2), world_size=2)
    assert report.kind == "unmatched message" and report.distributed[0].line == _line(_two_ahead, "dst=rank + 2")
    assert not _runs_alike(_case(_two_ahead, 2), 2)
