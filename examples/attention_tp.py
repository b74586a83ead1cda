"""Case: causal self-attention with a fused QKV projection, tensor parallel over heads (vLLM style).

The reference projects x with one Linear whose output rows are [q heads | k heads | v heads] and
splits q, k, v from it. Grouped-query attention: q head h attends with kv head
h // (n_heads / n_kv_heads).

Each rank holds n_heads / world_size q heads. With at least as many kv heads as ranks it holds
n_kv_heads / world_size of them; with fewer, kv heads are replicated and rank r holds kv head
r // (world_size / n_kv_heads), the one its q heads attend with (vLLM's num_kv_head_replicas).
`shard_state` builds the rank's fused weight and bias the way QKVParallelLinear's weight loader
does: cat(its q rows, its k rows, its v rows). The output projection is row parallel and
all-reduced.

`--preset NAME` sets CONFIG to one of PRESETS: MHA, GQA and MQA layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class AttentionConfig:
    hidden: int = 32
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 4
    seq: int = 6
    batch: int = 2


CONFIG = AttentionConfig()
PRESETS = {
    "gqa-kv2": AttentionConfig(),
    "mha": AttentionConfig(n_kv_heads=8),
    "mqa": AttentionConfig(n_kv_heads=1),
    "gqa-kv8": AttentionConfig(n_heads=16, n_kv_heads=8),
}
WORLD_SIZE = 2
OUTPUT = "replicate"


# --------------------------------------------------------------------------------------------
# attention maths, shared by the reference and every rank


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(batch, seq, heads * head_dim) -> (batch, heads, seq, head_dim)."""
    batch, seq, _ = x.shape
    return x.view(batch, seq, -1, head_dim).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)."""
    batch, heads, seq, head_dim = x.shape
    return x.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v; each kv head serves a contiguous group of q heads."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    seq = q.shape[2]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v)


def attend(qkv: torch.Tensor, n_q: int, n_kv: int, head_dim: int) -> torch.Tensor:
    """Split a fused [q | k | v] projection into heads and attend: (batch, seq, n_q * head_dim)."""
    q, k, v = qkv.split([n_q * head_dim, n_kv * head_dim, n_kv * head_dim], dim=-1)
    return merge_heads(causal_attention(*(split_heads(t, head_dim) for t in (q, k, v))))


# --------------------------------------------------------------------------------------------
# the reference


class Attention(nn.Module):
    def __init__(self, config: AttentionConfig):
        super().__init__()
        self.config = config
        qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden, qkv_rows)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        return self.o_proj(attend(self.qkv_proj(x), c.n_heads, c.n_kv_heads, c.head_dim))


# --------------------------------------------------------------------------------------------
# head bookkeeping shared by the parallel model and shard_state


def local_heads(config: AttentionConfig, rank: int, world_size: int) -> tuple[range, range]:
    """The q heads and the kv heads rank `rank` holds."""
    _check(config, world_size)
    n_q = config.n_heads // world_size
    q_heads = range(rank * n_q, (rank + 1) * n_q)
    if config.n_kv_heads >= world_size:
        n_kv = config.n_kv_heads // world_size
        return q_heads, range(rank * n_kv, (rank + 1) * n_kv)
    kv_head = rank // (world_size // config.n_kv_heads)
    return q_heads, range(kv_head, kv_head + 1)


def _check(config: AttentionConfig, world_size: int) -> None:
    if config.n_heads % config.n_kv_heads:
        raise ValueError(f"n_heads={config.n_heads} is not divisible by n_kv_heads={config.n_kv_heads}")
    if config.n_heads % world_size:
        raise ValueError(f"n_heads={config.n_heads} is not divisible by world_size={world_size}")
    if config.n_kv_heads % world_size and world_size % config.n_kv_heads:
        raise ValueError(f"n_kv_heads={config.n_kv_heads} and world_size={world_size} do not divide one another")


# --------------------------------------------------------------------------------------------
# parallel layers


class ColumnParallelLinear(nn.Module):
    """This rank's rows of a Linear: the output stays sharded along its last dim."""

    def __init__(self, in_features: int, local_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_out, in_features))
        self.bias = nn.Parameter(torch.empty(local_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused projection for this rank's heads; its rows are [local q | local k | local v]."""

    def __init__(self, hidden: int, n_q: int, n_kv: int, head_dim: int):
        super().__init__(hidden, (n_q + 2 * n_kv) * head_dim)


class RowParallelLinear(nn.Module):
    """This rank's input columns of a Linear: partial products, summed over ranks by all_reduce."""

    def __init__(self, local_in: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y


class ParallelAttention(nn.Module):
    """One rank's attention over its own heads; parameter names match the reference's."""

    def __init__(self, config: AttentionConfig, rank: int, world_size: int):
        super().__init__()
        q_heads, kv_heads = local_heads(config, rank, world_size)
        self.n_q, self.n_kv, self.head_dim = len(q_heads), len(kv_heads), config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden, self.n_q, self.n_kv, config.head_dim)
        self.o_proj = RowParallelLinear(self.n_q * config.head_dim, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o_proj(attend(self.qkv_proj(x), self.n_q, self.n_kv, self.head_dim))


# --------------------------------------------------------------------------------------------
# the case


def reference() -> nn.Module:
    return Attention(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    return ParallelAttention(CONFIG, rank, world_size)


def inputs() -> tuple:
    return (torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.hidden),)


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    """The checkpoint loader: this rank's tensors, cut from the reference's with slicing and cat."""
    q_heads, kv_heads = local_heads(CONFIG, rank, world_size)
    d = CONFIG.head_dim
    return {
        "qkv_proj.weight": _fused_qkv_shard(ref_state["qkv_proj.weight"], q_heads, kv_heads),
        "qkv_proj.bias": _fused_qkv_shard(ref_state["qkv_proj.bias"], q_heads, kv_heads),
        "o_proj.weight": ref_state["o_proj.weight"][:, q_heads.start * d : q_heads.stop * d],
    }


def _fused_qkv_shard(fused: torch.Tensor, q_heads: range, kv_heads: range) -> torch.Tensor:
    """QKVParallelLinear.weight_loader: the rows of this rank's q heads, then its k heads, then its v heads."""
    c = CONFIG
    d = c.head_dim
    q, k, v = fused.split([c.n_heads * d, c.n_kv_heads * d, c.n_kv_heads * d], dim=0)
    rows = [(q, q_heads), (k, kv_heads), (v, kv_heads)]
    return torch.cat([part[heads.start * d : heads.stop * d] for part, heads in rows], dim=0)
