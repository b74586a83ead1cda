"""Case: DeepSeek-V3, tensor parallel attention and expert parallel MoE over one group of ranks.

Reference: embedding, L x [RMSNorm, multi-head latent attention (MLA), residual, RMSNorm, MLP or
MoE, residual], final RMSNorm, lm_head. The first `dense_layers` layers have a SwiGLU MLP, the
others a MoE: a sigmoid top-k router (examples/moe_ep.py's), one shared expert and routed experts
whose weights are stacked, as grouped-GEMM kernels take them, each applied densely to every token
and weighted by its gate (zero where the token is not routed to it).

MLA (DeepSeek-V2/V3): queries through a low-rank projection (q_a_proj, RMSNorm, q_b_proj); keys
and values from one compressed latent (kv_a_proj_with_mqa: the latent and a rotary key shared by
all heads; RMSNorm; kv_b_proj: per head a key part without position and the value); each head's
query and key are its part without position followed by its rotary part.

Distributed, per rank of n, all on the default group (TP = EP = n):
  - vocab-parallel embedding and column-parallel lm_head, as examples/llama_tp.py;
  - MLA tensor parallel by heads: q_a_proj, kv_a_proj_with_mqa and their norms replicated,
    q_b_proj and kv_b_proj column-parallel (this rank's heads' rows), o_proj row-parallel and
    all-reduced (Megatron-LM's and vLLM's layout); the rotary key, shared by all heads, has its
    gradient all-reduced as a column-parallel layer's input has (without it, training reaches
    kv_a_proj_with_mqa with each rank's heads' share: a missing reduction shardproof reports);
  - dense MLP and shared expert tensor parallel: gate and up column-parallel, down row-parallel;
  - routed experts expert parallel: rank r holds experts [r * E / n, (r + 1) * E / n). Each rank
    routes its own rows of the (replicated) tokens, dispatches them and their gates with
    all_to_all (fixed-size buffers, as examples/moe_ep.py), applies its experts and combines the
    results back; the routed outputs are all-gathered over the ranks' rows and added to the
    shared expert's.
`shard_state` cuts each rank's tensors from the reference checkpoint by slicing only.

`--preset deepseek-v3` has DeepSeek-V3's shapes: 61 layers (3 dense), hidden 7168, 128 heads,
q rank 1536, kv rank 512, 256 routed experts of 2048 plus one shared, top-8; a batch of 8
sequences of 16 tokens, two rows per rank at 64 ranks. Not proven yet (`unknown`): one head per
rank (the rotary key, shared by the heads, is then not broadcast at all), one row of tokens per
rank, a batch of one sequence. Training (`--train`, `distributed_step`) is proven at 2, 4, 8 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llama_reference import LlamaConfig, RMSNorm, apply_rope, causal_attention, rotary_tables
from llama_tp import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tensor_parallel_region,
)
from moe_ep import MoEConfig, Router, exchange


@dataclass(frozen=True)
class DeepSeekConfig:
    vocab: int = 64
    hidden: int = 32
    n_layers: int = 3
    dense_layers: int = 1
    n_heads: int = 16
    q_lora_rank: int = 16
    kv_lora_rank: int = 8
    qk_nope_head_dim: int = 4
    qk_rope_head_dim: int = 4
    v_head_dim: int = 4
    ffn: int = 64
    expert_ffn: int = 16
    experts: int = 16
    top_k: int = 2
    routed_scaling: float = 2.5
    seq: int = 8
    batch: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def moe(self) -> MoEConfig:
        """The router's configuration (DeepSeek-V3: sigmoid gates, normalised over the chosen, scaled)."""
        return MoEConfig(self.hidden, self.expert_ffn, self.experts, self.top_k, "sigmoid", self.seq, self.batch,
                         self.routed_scaling)

    @property
    def rope(self) -> LlamaConfig:
        """The rotary part of a head, as llama_reference's tables read it."""
        return replace(LlamaConfig(), head_dim=self.qk_rope_head_dim, rope_theta=self.rope_theta)


SMALL = DeepSeekConfig()
PRESETS = {
    "small": SMALL,
    "deepseek-v3": DeepSeekConfig(
        vocab=129280, hidden=7168, n_layers=61, dense_layers=3, n_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, ffn=18432, expert_ffn=2048, experts=256, top_k=8,
        seq=16, batch=8,
    ),
}  # fmt: skip
CONFIG = SMALL
WORLD_SIZE = 2
OUTPUT = "replicate"

Linear = Callable[[int, int], nn.Module]  # (in features, out features) -> a projection


def linear(in_features: int, out_features: int) -> nn.Module:
    return nn.Linear(in_features, out_features, bias=False)


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


class MLA(nn.Module):
    """Multi-head latent attention over `heads` heads; `column` and `row` make the projections
    into and out of the heads (plain, or tensor parallel), `shared` maps the rotary key every head
    reads (under TP: identity forward, its gradient, a share per rank's heads, all-reduced)."""

    def __init__(self, c: DeepSeekConfig, heads: int, column: Linear = linear, row: Linear = linear,
                 shared: Callable[[torch.Tensor], torch.Tensor] = _same):
        super().__init__()
        self.c, self.heads, self.shared = c, heads, shared
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.q_a_proj = linear(c.hidden, c.q_lora_rank)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.norm_eps)
        self.q_b_proj = column(c.q_lora_rank, heads * qk)
        self.kv_a_proj_with_mqa = linear(c.hidden, c.kv_lora_rank + c.qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.kv_b_proj = column(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = row(heads * c.v_head_dim, c.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c, h = self.c, self.heads
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, h, -1).transpose(1, 2)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, h, -1).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        cos, sin = rotary_tables(c.rope, s, x.dtype, x.device)
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(self.shared(k_pe).view(b, 1, s, -1), cos, sin)
        query = torch.cat([q_nope, q_pe], dim=-1)
        key = torch.cat([k_nope, k_pe.expand(b, h, s, c.qk_rope_head_dim)], dim=-1)
        out = causal_attention(query, key, v).transpose(1, 2).reshape(b, s, h * c.v_head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU feed-forward block of `inner` hidden units (a rank's share, when tensor parallel)."""

    def __init__(self, hidden: int, inner: int, column: Linear = linear, row: Linear = linear):
        super().__init__()
        self.gate_proj = column(hidden, inner)
        self.up_proj = column(hidden, inner)
        self.down_proj = row(inner, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """`count` SwiGLU experts with their weights stacked along dim 0."""

    def __init__(self, count: int, hidden: int, inner: int):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.empty(count, inner, hidden))
        self.up_proj = nn.Parameter(torch.empty(count, inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(count, hidden, inner))
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, std=weight.shape[-1] ** -0.5)

    def forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `e` applied to every row of x."""
        return F.linear(F.silu(F.linear(x, self.gate_proj[e])) * F.linear(x, self.up_proj[e]), self.down_proj[e])


class MoE(nn.Module):
    def __init__(self, c: DeepSeekConfig):
        super().__init__()
        self.router = Router(c.moe)
        self.shared = MLP(c.hidden, c.expert_ffn)
        self.experts = Experts(c.experts, c.hidden, c.expert_ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        gates = self.router(tokens)
        out = self.shared(tokens)
        for e in range(gates.shape[-1]):
            out = out + gates[:, e : e + 1] * self.experts(e, tokens)
        return out.view(b, s, h)


class DecoderLayer(nn.Module):
    def __init__(self, c: DeepSeekConfig, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden, c.norm_eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(c.hidden, c.norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepSeekV3(nn.Module):
    """Embedding, decoder layers, final norm and lm_head: the reference's or a rank's parts."""

    def __init__(self, c: DeepSeekConfig, embed: nn.Module, layers: list[DecoderLayer], lm_head: nn.Module):
        super().__init__()
        self.embed_tokens = embed
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden, c.norm_eps)
        self.lm_head = lm_head

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# distributed


class _ScatterToRows(torch.autograd.Function):
    """This rank's rows of a replicated tensor; the gradient is all-gathered (every rank's rows)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0] // dist.get_world_size()
        return x.narrow(0, dist.get_rank() * rows, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return _gather_rows(grad)


class _GatherFromRows(torch.autograd.Function):
    """Every rank's rows, all-gathered; the gradient (the same on every rank) is cut to this rank's rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return _gather_rows(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        rows = grad.shape[0] // dist.get_world_size()
        return grad.narrow(0, dist.get_rank() * rows, rows).contiguous()


def _gather_rows(x: torch.Tensor) -> torch.Tensor:
    gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, x.contiguous())
    return torch.cat(gathered)


class ExpertParallelMoE(nn.Module):
    """Shared expert tensor parallel over all tokens; routed experts expert parallel over each
    rank's rows of them (see the module docstring)."""

    def __init__(self, c: DeepSeekConfig, world_size: int):
        super().__init__()
        self.world_size = world_size
        self.router = Router(c.moe)
        self.shared = MLP(c.hidden, c.expert_ffn // world_size, ColumnParallelLinear, RowParallelLinear)
        self.experts = Experts(c.experts // world_size, c.hidden, c.expert_ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        tokens = x.reshape(b * s, h)
        mine = _ScatterToRows.apply(tokens)
        gates = self.router(mine)  # (rows, experts): the columns of rank p's experts go to rank p
        n, t, local = self.world_size, mine.shape[0], self.experts.gate_proj.shape[0]
        received = exchange(torch.cat([mine] * n))  # piece j: rank j's rows
        weights = exchange(gates.view(t, n, local).transpose(0, 1).contiguous()).reshape(n * t, local)
        partial = torch.zeros_like(received)
        for e in range(local):
            partial = partial + weights[:, e : e + 1] * self.experts(e, received)
        routed = sum(exchange(partial).split(t))  # each row's experts, summed over the ranks holding them
        return (self.shared(tokens) + _GatherFromRows.apply(routed)).view(b, s, h)


def parallel(c: DeepSeekConfig, rank: int, world_size: int) -> DeepSeekV3:
    """Rank `rank`'s model: TP = EP = world_size."""
    _check(c, world_size)
    dims = LlamaConfig(vocab=c.vocab, hidden=c.hidden)
    layers = [
        DecoderLayer(
            c,
            MLA(c, c.n_heads // world_size, ColumnParallelLinear, RowParallelLinear, copy_to_tensor_parallel_region),
            MLP(c.hidden, c.ffn // world_size, ColumnParallelLinear, RowParallelLinear)
            if i < c.dense_layers
            else ExpertParallelMoE(c, world_size),
        )
        for i in range(c.n_layers)
    ]
    return DeepSeekV3(c, VocabParallelEmbedding(dims, rank, world_size), layers, ParallelLMHead(dims, world_size))


def _check(c: DeepSeekConfig, world_size: int) -> None:
    sizes = {"vocab": c.vocab, "n_heads": c.n_heads, "ffn": c.ffn, "expert_ffn": c.expert_ffn, "experts": c.experts,
             "tokens": c.batch * c.seq}  # fmt: skip
    problems = [f"{name}={value} is not divisible by world_size={world_size}" for name, value in sizes.items() if value % world_size]
    if problems:
        raise ValueError("; ".join(problems))


# --------------------------------------------------------------------------------------------
# the case

_CUT = {  # parameter name suffix -> the dim a rank's tensor is cut along (others are replicated)
    "embed_tokens.weight": 0,
    "lm_head.weight": 0,
    "q_b_proj.weight": 0,
    "kv_b_proj.weight": 0,
    "o_proj.weight": 1,
    "gate_proj.weight": 0,
    "up_proj.weight": 0,
    "down_proj.weight": 1,
    "experts.gate_proj": 0,
    "experts.up_proj": 0,
    "experts.down_proj": 0,
}


def reference() -> nn.Module:
    c = CONFIG
    layers = [
        DecoderLayer(c, MLA(c, c.n_heads), MLP(c.hidden, c.ffn) if i < c.dense_layers else MoE(c))
        for i in range(c.n_layers)
    ]
    return DeepSeekV3(c, nn.Embedding(c.vocab, c.hidden), layers, linear(c.hidden, c.vocab))


def distributed(rank: int, world_size: int) -> nn.Module:
    return parallel(CONFIG, rank, world_size)


def inputs() -> tuple:
    return (torch.randint(0, CONFIG.vocab, (CONFIG.batch, CONFIG.seq), dtype=torch.int64),)


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    """Each tensor cut along its `_CUT` dim to this rank's block, or copied."""
    out = {}
    for name, value in ref_state.items():
        dims = [dim for suffix, dim in _CUT.items() if name.endswith(suffix)]
        if dims:
            size = value.shape[dims[0]] // world_size
            value = value.narrow(dims[0], rank * size, size)
        out[name] = value
    return out


def loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return logits.pow(2).mean()


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """Megatron's step: the loss of the replicated logits; each router, which saw only this rank's
    rows, has its gradient summed over the ranks (the other copies' gradients are whole already:
    their inputs' gradients are all-reduced or gathered by the layers' autograd mappings)."""
    (input_ids,) = inputs
    out = loss(model(input_ids), input_ids)
    out.backward()
    for name, param in model.named_parameters():
        if name.endswith("router.weight"):
            dist.all_reduce(param.grad)
    return out
