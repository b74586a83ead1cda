"""Case: a Llama decoder, tensor parallel in the Megatron-LM / vLLM style with explicit collectives.

Reference (examples/llama_reference.py): embedding, L x [RMSNorm, GQA attention with RoPE and a
fused qkv projection, residual, RMSNorm, SwiGLU MLP with a fused gate_up projection, residual],
final RMSNorm, lm_head.

Distributed (this file), per rank, on the default process group:
  - VocabParallelEmbedding: rows [vocab_start, vocab_end) of the table; ids outside are masked,
    looked up as 0, their rows zeroed, then `dist.all_reduce`.
  - QKVParallelLinear: the rank's fused weight is cat(its q-head rows, its k-head rows, its v-head
    rows). With fewer kv heads than ranks, kv heads are replicated: rank r holds kv head
    r // (world_size // n_kv_heads), exactly the one its q heads attend with.
  - attention on the local heads (RoPE, explicit causal softmax), row-parallel o_proj + all_reduce.
  - MergedColumnParallelLinear gate_up: the rank's fused weight is cat(gate shard, up shard);
    row-parallel down_proj + all_reduce.
  - column-parallel lm_head, logits all-gathered along the vocab (last) dim: output replicated.
  - RMSNorm weights replicated.
`shard_state` builds each rank's tensors from the reference checkpoint with slicing/chunk/cat only.

Training (`--train`, loss: mean square of the logits): each collective is wrapped in Megatron's
autograd mapping, so the forward is the same ops and the backward is Megatron-LM's: the input of
every column-parallel layer has its gradient all-reduced (`copy_to_tensor_model_parallel_region`),
the all-reduce after a row-parallel layer passes its gradient through, and the logits' all-gather
keeps this rank's slice of the gradient; the vocabulary-parallel embedding's gradient is the
scatter-add of this rank's masked rows into its slice of the table. Training needs
n_kv_heads divisible by the world size: a kv head replicated over ranks (vLLM's inference layout)
gets only its own rank's share of the gradient, and shardproof reports that missing reduction
(SMALL at world size 4, say).

`shardproof --preset llama3-8b` (or llama3.1-405b, or llama3.1-405b-kv64) replaces the module global CONFIG; every
function below reads CONFIG when called.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llama_reference import (
    PRESETS,
    SMALL,
    LlamaConfig,
    LlamaReference,
    RMSNorm,
    apply_rope,
    causal_attention,
    rotary_tables,
    token_inputs,
)

CONFIG = SMALL
PRESETS = dict(PRESETS)
# 405B's shapes with 64 kv heads: trains at 64 ranks, one kv head each (the real 8 train up to 8 ranks)
PRESETS["llama3.1-405b-kv64"] = replace(PRESETS["llama3.1-405b"], n_kv_heads=64)
WORLD_SIZE = 2
OUTPUT = "replicate"


# --------------------------------------------------------------------------------------------
# head / row bookkeeping shared by the model and shard_state


def _check(config: LlamaConfig, world_size: int) -> None:
    problems = [
        f"{name}={value} is not divisible by world_size={world_size}"
        for name, value in (("vocab", config.vocab), ("n_heads", config.n_heads), ("ffn", config.ffn))
        if value % world_size
    ]
    if config.n_kv_heads % world_size and world_size % config.n_kv_heads:
        problems.append(f"n_kv_heads={config.n_kv_heads} and world_size={world_size} do not divide one another")
    if problems:
        raise ValueError("; ".join(problems))


def _local_heads(config: LlamaConfig, rank: int, world_size: int) -> tuple[int, int, int]:
    """(local q heads, local kv heads, first kv head of this rank)."""
    n_q = config.n_heads // world_size
    if config.n_kv_heads >= world_size:
        n_kv = config.n_kv_heads // world_size
        return n_q, n_kv, rank * n_kv
    replicas = world_size // config.n_kv_heads  # vLLM: num_kv_head_replicas
    return n_q, 1, rank // replicas


# --------------------------------------------------------------------------------------------
# Megatron-LM's autograd mappings around the collectives


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """Identity forward; the input's gradient is all-reduced (it is partial on every rank)."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """All-reduce forward (in place, as vLLM does); the gradient passes through."""

    @staticmethod
    def forward(ctx, x):
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dim; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x):
        gathered = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, x)
        return torch.cat(gathered, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


copy_to_tensor_parallel_region = _CopyToTensorParallelRegion.apply
reduce_from_tensor_parallel_region = _ReduceFromTensorParallelRegion.apply
gather_from_tensor_parallel_region = _GatherFromTensorParallelRegion.apply


# --------------------------------------------------------------------------------------------
# parallel layers


class VocabParallelEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        per_rank = config.vocab // world_size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, config.hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        masked_input = (input_ids - self.vocab_start).masked_fill(input_mask, 0)
        output_parallel = F.embedding(masked_input, self.weight)
        output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        return reduce_from_tensor_parallel_region(output_parallel)


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local.T; the output stays sharded along its last dim."""

    def __init__(self, in_features: int, local_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(local_out, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_tensor_parallel_region(x), self.weight)


class RowParallelLinear(nn.Module):
    """Input sharded along its last dim; partial products summed with all_reduce."""

    def __init__(self, local_in: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tensor_parallel_region(F.linear(x, self.weight))


class ParallelLMHead(nn.Module):
    """Column-parallel over the vocab, then Megatron's gather along the last dim."""

    def __init__(self, config: LlamaConfig, world_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.vocab // world_size, config.hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gather_from_tensor_parallel_region(F.linear(copy_to_tensor_parallel_region(x), self.weight).contiguous())


class TPAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        self.config = config
        self.n_q, self.n_kv, _ = _local_heads(config, rank, world_size)
        d = config.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden, (self.n_q + 2 * self.n_kv) * d)  # QKVParallelLinear
        self.o_proj = RowParallelLinear(self.n_q * d, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.config.head_dim
        b, s, _ = x.shape
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.n_q * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = q.view(b, s, self.n_q, d).transpose(1, 2)
        k = k.view(b, s, self.n_kv, d).transpose(1, 2)
        v = v.view(b, s, self.n_kv, d).transpose(1, 2)
        cos, sin = rotary_tables(self.config, s, x.dtype, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.n_q * d)
        return self.o_proj(out)


class TPMLP(nn.Module):
    def __init__(self, config: LlamaConfig, world_size: int):
        super().__init__()
        local_ffn = config.ffn // world_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden, 2 * local_ffn)  # MergedColumnParallelLinear
        self.down_proj = RowParallelLinear(local_ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        half = gate_up.shape[-1] // 2
        return self.down_proj(F.silu(gate_up[..., :half]) * gate_up[..., half:])  # SiluAndMul


class TPDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.self_attn = TPAttention(config, rank, world_size)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = TPMLP(config, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaTP(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        _check(config, world_size)
        self.embed_tokens = VocabParallelEmbedding(config, rank, world_size)
        self.layers = nn.ModuleList(TPDecoderLayer(config, rank, world_size) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = ParallelLMHead(config, world_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# the case


def reference() -> nn.Module:
    return LlamaReference(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    return LlamaTP(CONFIG, rank, world_size)


def inputs() -> tuple:
    return token_inputs(CONFIG)


def loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return logits.pow(2).mean()


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    return shard_llama_state(CONFIG, ref_state, rank, world_size)


def shard_llama_state(c: LlamaConfig, ref_state: dict, rank: int, world_size: int) -> dict:
    """The checkpoint loader: this rank's tensors, cut from the reference's with slicing and cat."""
    d = c.head_dim
    n_q, n_kv, kv_first = _local_heads(c, rank, world_size)
    q_rows, kv_rows = c.n_heads * d, c.n_kv_heads * d
    vocab_rows = c.vocab // world_size
    ffn = c.ffn // world_size

    out = {
        "embed_tokens.weight": ref_state["embed_tokens.weight"][rank * vocab_rows : (rank + 1) * vocab_rows],
        "norm.weight": ref_state["norm.weight"],
        "lm_head.weight": ref_state["lm_head.weight"][rank * vocab_rows : (rank + 1) * vocab_rows],
    }
    for i in range(c.n_layers):
        p = f"layers.{i}."
        qkv = ref_state[p + "self_attn.qkv_proj.weight"]
        q = qkv[rank * n_q * d : (rank + 1) * n_q * d]
        k = qkv[q_rows + kv_first * d : q_rows + (kv_first + n_kv) * d]
        v = qkv[q_rows + kv_rows + kv_first * d : q_rows + kv_rows + (kv_first + n_kv) * d]
        gate_up = ref_state[p + "mlp.gate_up_proj.weight"]
        gate = gate_up[rank * ffn : (rank + 1) * ffn]
        up = gate_up[c.ffn + rank * ffn : c.ffn + (rank + 1) * ffn]
        out.update(
            {
                p + "input_layernorm.weight": ref_state[p + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": ref_state[p + "post_attention_layernorm.weight"],
                p + "self_attn.qkv_proj.weight": torch.cat([q, k, v], dim=0),
                p + "self_attn.o_proj.weight": ref_state[p + "self_attn.o_proj.weight"][
                    :, rank * n_q * d : (rank + 1) * n_q * d
                ],
                p + "mlp.gate_up_proj.weight": torch.cat([gate, up], dim=0),
                p + "mlp.down_proj.weight": ref_state[p + "mlp.down_proj.weight"][:, rank * ffn : (rank + 1) * ffn],
            }
        )
    return out
