"""Expert parallelism, DeepSeek-style: a top-k router (softmax or sigmoid gates), one shared expert
and routed experts sharded over the EP group, tokens dispatched to their experts' ranks and the
results combined back with `all_to_all_single`.

Reference: one MoE layer on every token, each routed expert applied densely and weighted by its
gate (zero for the tokens not routed to it), plus the shared expert. Distributed: the tokens are
split over the ranks (each rank its batch rows); rank r holds routed experts
[r * E / n, (r + 1) * E / n) and a copy of the router and the shared expert. Dispatch sends every
rank each of this rank's tokens with the gates of that rank's experts (one all_to_all of tokens,
one of gates, equal splits: a fixed-size buffer per peer, as DeepEP's low-latency mode keeps);
the expert's rank applies its experts to what it received, and the inverse all_to_all returns
each token's weighted expert outputs to the token's rank, where they are summed over ranks.

What is proven holds for every routing: the routing is data (gates, zero where a token is not
routed), not the program's shape, so one proof covers every choice the router can make. Training
(`--train`): expert weights get every token's gradient through the inverse all_to_all (no
reduction: each expert lives on one rank); the router and the shared expert, copies on every rank,
have their gradients summed over ranks.

`--preset deepseek-v3` has one DeepSeek-V3 MoE layer's shapes (hidden 7168, 256 routed experts of
2048, one shared, top-8, sigmoid gates) for bench/.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    hidden: int
    expert_hidden: int
    experts: int
    top_k: int
    gate: str  # "softmax" (Mixtral, Qwen3-MoE) or "sigmoid" (DeepSeek-V3: normalised over the chosen, scaled)
    tokens: int  # per batch row
    batch: int
    scaling: float = 1.0


SMALL = MoEConfig(hidden=16, expert_hidden=8, experts=16, top_k=2, gate="softmax", tokens=4, batch=8)
PRESETS = {
    "small": SMALL,
    "small-sigmoid": MoEConfig(hidden=16, expert_hidden=8, experts=16, top_k=3, gate="sigmoid", tokens=4, batch=8, scaling=2.5),
    "deepseek-v3": MoEConfig(hidden=7168, expert_hidden=2048, experts=256, top_k=8, gate="sigmoid", tokens=16, batch=8,
                             scaling=2.5),
}
CONFIG = SMALL
WORLD_SIZE = 2
OUTPUT = ("shard", 0)


class Expert(nn.Module):
    """A SwiGLU feed-forward block."""

    def __init__(self, c: MoEConfig, hidden: int | None = None):
        super().__init__()
        inner = hidden or c.expert_hidden
        self.gate_proj = nn.Linear(c.hidden, inner, bias=False)
        self.up_proj = nn.Linear(c.hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, c.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Gates of the top-k experts per token, scattered into a dense (tokens, experts) matrix:
    zero where a token is not routed."""

    def __init__(self, c: MoEConfig):
        super().__init__()
        self.c = c
        self.weight = nn.Parameter(torch.empty(c.experts, c.hidden))
        nn.init.normal_(self.weight, std=c.hidden ** -0.5)
        self.register_buffer("bias", torch.linspace(-0.1, 0.1, c.experts))  # DeepSeek-V3's load-balancing bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x, self.weight)
        if self.c.gate == "softmax":
            gates, chosen = torch.softmax(logits, dim=-1).topk(self.c.top_k, dim=-1)
        else:  # the bias steers the choice only; the chosen gates are normalised and scaled
            scores = torch.sigmoid(logits)
            chosen = (scores + self.bias).topk(self.c.top_k, dim=-1).indices
            gates = scores.gather(-1, chosen)
            gates = gates / gates.sum(-1, keepdim=True) * self.c.scaling
        return torch.zeros_like(logits).scatter(-1, chosen, gates)


class MoE(nn.Module):
    def __init__(self, c: MoEConfig):
        super().__init__()
        self.router = Router(c)
        self.shared = Expert(c)
        self.experts = nn.ModuleList(Expert(c) for _ in range(c.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        gates = self.router(tokens)
        out = self.shared(tokens)
        for e, expert in enumerate(self.experts):
            out = out + gates[:, e : e + 1] * expert(tokens)
        return out.view(b, s, h)


def exchange(t: torch.Tensor) -> torch.Tensor:
    """all_to_all_single with equal splits along dim 0, differentiable (its backward is itself)."""
    return funcol.all_to_all_single_autograd(t, None, None, dist.group.WORLD)


class ExpertParallelMoE(nn.Module):
    def __init__(self, c: MoEConfig, rank: int, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.local = c.experts // world_size
        self.router = Router(c)
        self.shared = Expert(c)
        first = rank * self.local  # named by their global index, as in the reference
        self.experts = nn.ModuleDict({str(first + e): Expert(c) for e in range(self.local)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        gates = self.router(tokens)  # (tokens, experts): the columns of rank p's experts go to rank p
        n, t = self.world_size, tokens.shape[0]
        # dispatch: piece p of each buffer goes to rank p: all of this rank's tokens, the gates of p's experts
        sent_tokens = torch.cat([tokens] * n)
        sent_gates = gates.view(t, n, self.local).transpose(0, 1).contiguous()  # (ranks, tokens, local experts)
        received = exchange(sent_tokens)  # piece j: rank j's tokens
        weights = exchange(sent_gates).reshape(n * t, self.local)  # and their gates of this rank's experts
        partial = torch.zeros_like(received)
        for e, expert in enumerate(self.experts.values()):
            partial = partial + weights[:, e : e + 1] * expert(received)
        # combine: piece j of the results goes back to rank j; each token sums its experts over ranks
        returned = sum(exchange(partial).split(t))
        return (self.shared(tokens) + returned).view(b, s, h)


def _check(c: MoEConfig, world_size: int) -> None:
    if c.experts % world_size or c.batch % world_size:
        raise ValueError(f"{c.experts} experts and a batch of {c.batch} must divide over {world_size} ranks")


def reference() -> nn.Module:
    return MoE(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    _check(CONFIG, world_size)
    return ExpertParallelMoE(CONFIG, rank, world_size)


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.tokens, CONFIG.hidden),)


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    return full.chunk(world_size, dim=0)[rank]


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    """Router and shared expert copied; of the routed experts, [rank * E / n, (rank + 1) * E / n)."""
    local = CONFIG.experts // world_size
    mine = range(rank * local, (rank + 1) * local)
    return {k: v for k, v in ref_state.items() if not k.startswith("experts.") or int(k.split(".")[1]) in mine}


def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """The mean over all tokens: each rank's share is its tokens' sum over the global count; the
    copies (router, shared expert) have their gradients summed over ranks, the experts not."""
    (x,) = inputs
    share = model(x).pow(2).sum() / (x.numel() * world_size)
    share.backward()
    for name, param in model.named_parameters():
        if not name.startswith("experts."):
            dist.all_reduce(param.grad)
    total = share.detach().clone()
    dist.all_reduce(total)
    return total
