"""Single-device Llama decoder shared by the Llama example cases (not a case file itself).

The reference uses FUSED projections, as vLLM and many checkpoints do:
  - `attn.qkv_proj.weight` rows are [q heads (n_heads*head_dim) | k heads | v heads],
  - `mlp.gate_up_proj.weight` rows are [gate (ffn) | up (ffn)].

Every module takes its `LlamaConfig` explicitly. The case files keep the module global `CONFIG`
(which `shardproof --preset NAME` replaces) and pass it in at call time, so this file has no
configuration of its own. Rotary tables are computed inside `forward` from the config, in the
dtype of the activations, so no buffers need sharding and fake tensors allocate nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 64
    hidden: int = 64
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 128
    seq: int = 8
    batch: int = 2
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


SMALL = LlamaConfig()

PRESETS = {
    "llama3-8b": LlamaConfig(
        vocab=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn=14336, seq=16, batch=1
    ),
    "llama3.1-405b": LlamaConfig(
        vocab=128256, hidden=16384, n_layers=126, n_heads=128, n_kv_heads=8, head_dim=128, ffn=53248, seq=16, batch=1
    ),
}


def token_inputs(config: LlamaConfig) -> tuple:
    """Token ids (batch, seq), int64."""
    return (torch.randint(0, config.vocab, (config.batch, config.seq), dtype=torch.int64),)


# --------------------------------------------------------------------------------------------
# building blocks (also reused, unchanged, by the distributed models: they are replicated)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotary_tables(config: LlamaConfig, seq: int, dtype: torch.dtype, device: torch.device):
    """cos, sin of shape (seq, head_dim), the rotate-half (HF/Llama) layout."""
    exponents = torch.arange(0, config.head_dim, 2, dtype=dtype, device=device) / config.head_dim
    inv_freq = torch.exp(exponents * -math.log(config.rope_theta))  # = 1 / theta**exponents
    positions = torch.arange(seq, dtype=dtype, device=device)
    freqs = torch.outer(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim); cos/sin: (seq, head_dim)."""
    return x * cos + rotate_half(x) * sin


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q: (b, hq, s, d); k, v: (b, hkv, s, d) with hq a multiple of hkv (GQA). Returns (b, hq, s, d)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    seq = q.shape[-2]
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v)


# --------------------------------------------------------------------------------------------
# the reference


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        qkv_rows = (config.n_heads + 2 * config.n_kv_heads) * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden, qkv_rows, bias=False)
        self.o_proj = nn.Linear(config.n_heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s, _ = x.shape
        qkv = self.qkv_proj(x)
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, s, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(c, s, x.dtype, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, c.n_heads * c.head_dim)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden, 2 * config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaReference(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))
