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

`--preset small-etp` puts expert tensor parallelism inside EP (`expert_tp` ranks per TP group, an
(ep, tp) grid): each expert's hidden is split over the TP group, whose tokens are gathered before
the layer and whose partial sums are reduce-scattered back after it.

`--preset deepseek-v3` has one DeepSeek-V3 MoE layer's shapes (hidden 7168, 256 routed experts of
2048, one shared, top-8, sigmoid gates) for bench/.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    expert_tp: int = 1  # ranks per expert-tensor-parallel group (ETP): experts' hidden split over them


SMALL = MoEConfig(hidden=16, expert_hidden=8, experts=16, top_k=2, gate="softmax", tokens=4, batch=8)
PRESETS = {
    "small": SMALL,
    "small-sigmoid": MoEConfig(hidden=16, expert_hidden=8, experts=16, top_k=3, gate="sigmoid", tokens=4, batch=8, scaling=2.5),
    "small-etp": replace(SMALL, expert_tp=2),
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


@dataclass(frozen=True)
class Grid:
    """This rank's place in the (ep, tp) grid: TP groups are consecutive ranks, EP groups one rank of each."""

    ep: int
    tp: int
    ep_rank: int
    tp_rank: int
    ep_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup


def initialize_expert_parallel(c: MoEConfig, rank: int, world_size: int) -> Grid:
    tp = min(c.expert_tp, world_size)
    ep = world_size // tp  # every rank creates every group, in the same order
    tp_groups = [dist.new_group(list(range(d * tp, (d + 1) * tp))) for d in range(ep)]
    ep_groups = [dist.new_group(list(range(t, world_size, tp))) for t in range(tp)]
    return Grid(ep, tp, rank // tp, rank % tp, ep_groups[rank % tp], tp_groups[rank // tp])


def exchange(t: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """all_to_all_single with equal splits along dim 0 over `group` (all ranks if None), differentiable
    (its backward is itself)."""
    return funcol.all_to_all_single_autograd(t, None, None, group or dist.group.WORLD)


class ExpertParallelMoE(nn.Module):
    """Routed experts over the EP group, each expert's (and the shared expert's) hidden split over
    the TP group; the TP group's tokens are gathered before the layer and the partial sums
    reduce-scattered back to their ranks after it (Megatron's ETP with sequence parallelism)."""

    def __init__(self, c: MoEConfig, rank: int, world_size: int):
        super().__init__()
        self.grid = initialize_expert_parallel(c, rank, world_size)
        self.local = c.experts // self.grid.ep
        inner = c.expert_hidden // self.grid.tp
        self.router = Router(c)
        self.shared = Expert(c, inner)
        first = self.grid.ep_rank * self.local  # named by their global index, as in the reference
        self.experts = nn.ModuleDict({str(first + e): Expert(c, inner) for e in range(self.local)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        grid = self.grid
        tokens = funcol.all_gather_single_autograd(x.reshape(b * s, h), 0, grid.tp_group)  # the TP group's tokens
        gates = self.router(tokens)  # (tokens, experts): the columns of EP rank p's experts go to it
        n, t = grid.ep, tokens.shape[0]
        # dispatch: piece p of each buffer goes to EP rank p: all these tokens, the gates of p's experts
        sent_tokens = torch.cat([tokens] * n)
        sent_gates = gates.view(t, n, self.local).transpose(0, 1).contiguous()  # (ranks, tokens, local experts)
        received = exchange(sent_tokens, grid.ep_group)  # piece j: EP rank j's tokens
        weights = exchange(sent_gates, grid.ep_group).reshape(n * t, self.local)  # and their gates of this rank's experts
        partial = torch.zeros_like(received)
        for e, expert in enumerate(self.experts.values()):
            partial = partial + weights[:, e : e + 1] * expert(received)
        # combine: piece j of the results goes back to EP rank j; each token sums its experts over ranks
        returned = sum(exchange(partial, grid.ep_group).split(t))
        hidden_share = self.shared(tokens) + returned  # this TP rank's share of the expert hidden
        return funcol.reduce_scatter_single_autograd(hidden_share, "sum", 0, grid.tp_group).view(b, s, h)


def _check(c: MoEConfig, world_size: int) -> None:
    tp = min(c.expert_tp, world_size)
    if world_size % tp or c.expert_hidden % tp:
        raise ValueError(f"expert_tp={tp} must divide world_size={world_size} and expert_hidden={c.expert_hidden}")
    if c.experts % (world_size // tp) or c.batch % world_size:
        raise ValueError(f"{c.experts} experts must divide over {world_size // tp} EP ranks and a batch of {c.batch} "
                         f"over {world_size} ranks")


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
    """Router copied; of the routed experts, EP rank p's [p * E / ep, (p + 1) * E / ep); every expert's
    hidden (gate and up rows, down columns) cut into TP rank t's block."""
    tp = min(CONFIG.expert_tp, world_size)
    ep_rank, tp_rank = rank // tp, rank % tp
    local = CONFIG.experts // (world_size // tp)
    mine = range(ep_rank * local, (ep_rank + 1) * local)
    state = {}
    for name, value in ref_state.items():
        if name.startswith("experts.") and int(name.split(".")[1]) not in mine:
            continue
        if not name.startswith("router."):
            value = value.chunk(tp, dim=1 if name.endswith("down_proj.weight") else 0)[tp_rank]
        state[name] = value
    return state


def loss(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """The mean over all tokens: each rank's share is its tokens' sum over the global count. The
    router's copies have their gradients summed over all ranks (each TP rank's holds its share of the
    hidden's), the shared expert's over the EP group (data-parallel copies of a TP shard), the routed
    experts' not (each block lives on one rank)."""
    (x,) = inputs
    share = model(x).pow(2).sum() / (x.numel() * world_size)
    share.backward()
    for name, param in model.named_parameters():
        if name.startswith("router."):
            dist.all_reduce(param.grad)
        elif name.startswith("shared."):
            dist.all_reduce(param.grad, group=model.grid.ep_group)
    total = share.detach().clone()
    dist.all_reduce(total)
    return total
