"""moe-a2a-tolist: expert-parallel dispatch and combine whose split sizes are read off the routing.

Origin: torchtitan's `AllToAllTokenDispatcher` (Megatron's and DeepSpeed's alltoall token
dispatchers do the same), written here in its style. Each rank routes its tokens top-k, sorts the
(token, choice) pairs by expert (a stable argsort), counts them per expert, exchanges the counts
(an all_to_all of fixed size), reads the split sizes off them (`.tolist()`), and sends each
expert's rows to the expert's rank (`all_to_all_single` with those splits). The receiver reorders
what it got from rank-major to expert-major, applies each local expert to its segment (the
grouped GEMM in torchtitan's for-loop form, `split` by the counts), undoes the reorder, and sends
the results back by the inverse all_to_all (split lists swapped); the sender weighs each pair's
result by its gate and adds it to the pair's token, undoing the sort. The buggy twin sums each
token's k results as if they came back in token order: they come back sorted by expert.

Reference: every expert applied densely to every token, weighted by its gate (zero where the
token is not routed there). Not proven yet (see the README's "Known gaps"): the counts are traced
as unbacked sizes and the exchange rewritten into fixed buffers (capture/segments.py), but no rule
yet relates its masks to the reference's gate matrix. The numeric oracle agrees at 1, 2 and 4
ranks; the twin disagrees there.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

HIDDEN = 8
EXPERTS = 8
TOP_K = 2
TOKENS = 16  # in all, split over the ranks

WORLD_SIZE = 2
OUTPUT = ("shard", 0)


class Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, HIDDEN) * HIDDEN ** -0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The top-k gates (softmax) and the experts they choose, (tokens, k) each."""
        return torch.softmax(x @ self.weight.t(), dim=-1).topk(TOP_K, dim=-1)


class MoE(nn.Module):
    """The reference: each expert on every token, weighted by its gate."""

    def __init__(self):
        super().__init__()
        self.router = Router()
        self.experts = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) * HIDDEN ** -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates, chosen = self.router(x)
        dense = torch.zeros(x.shape[0], EXPERTS).scatter(1, chosen, gates)
        return torch.einsum("te,ted->td", dense, torch.einsum("th,ehd->ted", x, self.experts))


class ExpertParallelMoE(nn.Module):
    """Experts [rank * E / n, (rank + 1) * E / n) on this rank; the router copied."""

    def __init__(self, rank: int, world_size: int):
        super().__init__()
        self.world_size, self.local = world_size, EXPERTS // world_size
        self.router = Router()
        self.experts = nn.Parameter(torch.empty(self.local, HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, group = self.world_size, dist.group.WORLD
        gates, chosen = self.router(x)
        # dispatch: (token, choice) pairs sorted by expert, so by the expert's rank
        order = torch.argsort(chosen.view(-1), stable=True)
        routed = x[order // TOP_K]
        counts = torch.zeros(EXPERTS, dtype=torch.long).scatter_add(0, chosen.view(-1), torch.ones_like(chosen.view(-1)))
        counts_here = funcol.all_to_all_single(counts, None, None, group)  # (rank j, local expert): j's pairs
        input_splits = counts.view(n, -1).sum(1).tolist()
        output_splits = counts_here.view(n, -1).sum(1).tolist()
        received = funcol.all_to_all_single_autograd(routed, output_splits, input_splits, group)
        # rank-major (rank j, local expert e) segments to expert-major (e, j), as torchtitan's _permute
        segments = list(received.split(counts_here.tolist()))
        by_expert = [segments[j * self.local + e] for e in range(self.local) for j in range(n)]
        grouped = torch.cat(by_expert).split(counts_here.view(n, self.local).sum(0).tolist())
        outputs = torch.cat([rows @ self.experts[e] for e, rows in enumerate(grouped)])
        # back to rank-major, then to the senders (split lists swapped)
        done = list(outputs.split(counts_here.view(n, self.local).t().reshape(-1).tolist()))
        rank_major = torch.cat([done[e * n + j] for j in range(n) for e in range(self.local)])
        returned = funcol.all_to_all_single_autograd(rank_major, input_splits, output_splits, group)
        # combine: each pair's result weighted by its gate, added to its token
        weighted = returned * gates.view(-1)[order].unsqueeze(1)
        return weighted.view(-1, TOP_K, HIDDEN).sum(1)  # BUG(layout): the results come back sorted by expert, not by token


def reference() -> nn.Module:
    return MoE()


def distributed(rank: int, world_size: int) -> nn.Module:
    return ExpertParallelMoE(rank, world_size)


def inputs() -> tuple:
    return (torch.randn(TOKENS, HIDDEN),)


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size)[rank]


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    local = EXPERTS // world_size
    return {"router.weight": ref_state["router.weight"], "experts": ref_state["experts"][rank * local : (rank + 1) * local]}
