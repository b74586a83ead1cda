"""Case: one training step of a Llama decoder, tensor + sequence parallel in the Megatron-LM style.

Reference (examples/llama_reference.py) trained on a logit-distillation loss: mean squared error
between the logits and a teacher's logits (an input). Run with `shardproof verify
examples/llama_sp_train.py --train` (MODE below makes --train the default).

Distributed (this file), per rank, activations outside attention/MLP are sequence parallel
(this rank's contiguous chunk of the sequence):
  - vocab-parallel embedding, its partial sums reduce-scattered along the sequence;
  - RMSNorm on the sequence shard; its weight is replicated, so its gradient on each rank is a
    partial sum over that rank's tokens: `distributed_step` all-reduces every parameter marked
    `sequence_parallel` across the tensor-parallel group after backward (Megatron's
    finalize-grads), as it must;
  - all-gather along the sequence before the column-parallel qkv / gate_up projections (backward:
    reduce-scatter), reduce-scatter after the row-parallel o_proj / down_proj (backward:
    all-gather), through autograd Functions like Megatron's mappings;
  - column-parallel lm_head, logits all-gathered along the vocabulary (backward: own slice).
The checkpoint layout is the same as plain tensor parallelism: `shard_state` is llama_tp's.
The vocabulary-parallel embedding table is trained too: its gradient is the scatter-add of each
rank's masked rows into its own slice of the table.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn

from llama_reference import LlamaConfig, LlamaReference, RMSNorm, apply_rope, causal_attention, rotary_tables
from llama_tp import _local_heads, shard_llama_state

CONFIG = LlamaConfig(n_heads=8, n_kv_heads=8)  # kv heads split across ranks, never replicated
PRESETS = {"llama3-8b": LlamaConfig(vocab=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                    head_dim=128, ffn=14336, seq=16, batch=1)}
WORLD_SIZE = 2
MODE = "train"
SEQ_DIM = 1


# --------------------------------------------------------------------------------------------
# Megatron's mappings between the tensor-parallel and sequence-parallel regions


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return funcol.all_gather_tensor(x, SEQ_DIM, dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return funcol.reduce_scatter_tensor(grad.contiguous(), "sum", SEQ_DIM, dist.group.WORLD)


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return funcol.reduce_scatter_tensor(x.contiguous(), "sum", SEQ_DIM, dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_gather_tensor(grad, SEQ_DIM, dist.group.WORLD)


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather along the last dim; the backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x):
        return funcol.all_gather_tensor(x.contiguous(), x.dim() - 1, dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(), dim=-1)[dist.get_rank()].contiguous()


gather_from_sequence_parallel_region = _GatherFromSequenceParallelRegion.apply
reduce_scatter_to_sequence_parallel_region = _ReduceScatterToSequenceParallelRegion.apply
gather_from_tensor_parallel_region = _GatherFromTensorParallelRegion.apply


# --------------------------------------------------------------------------------------------
# parallel layers


class SequenceParallelNorm(RMSNorm):
    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps)
        self.weight.sequence_parallel = True  # its gradient is all-reduced across TP by finalize_grads


class VocabParallelEmbedding(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        per_rank = config.vocab // world_size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = nn.Parameter(torch.empty(per_rank, config.hidden))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        input_mask = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        masked_input = (input_ids - self.vocab_start).masked_fill(input_mask, 0)
        output_parallel = F.embedding(masked_input, self.weight).masked_fill(input_mask.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sequence_parallel_region(output_parallel)


class SPAttention(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        self.config = config
        self.n_q, self.n_kv, _ = _local_heads(config, rank, world_size)
        d = config.head_dim
        self.qkv_proj = nn.Linear(config.hidden, (self.n_q + 2 * self.n_kv) * d, bias=False)
        self.o_proj = nn.Linear(self.n_q * d, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.config.head_dim
        x = gather_from_sequence_parallel_region(x)
        b, s, _ = x.shape
        q, k, v = self.qkv_proj(x).split([self.n_q * d, self.n_kv * d, self.n_kv * d], dim=-1)
        q = q.view(b, s, self.n_q, d).transpose(1, 2)
        k = k.view(b, s, self.n_kv, d).transpose(1, 2)
        v = v.view(b, s, self.n_kv, d).transpose(1, 2)
        cos, sin = rotary_tables(self.config, s, x.dtype, x.device)
        out = causal_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        out = out.transpose(1, 2).reshape(b, s, self.n_q * d)
        return reduce_scatter_to_sequence_parallel_region(self.o_proj(out))


class SPMLP(nn.Module):
    def __init__(self, config: LlamaConfig, world_size: int):
        super().__init__()
        local_ffn = config.ffn // world_size
        self.gate_up_proj = nn.Linear(config.hidden, 2 * local_ffn, bias=False)
        self.down_proj = nn.Linear(local_ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(gather_from_sequence_parallel_region(x)).chunk(2, dim=-1)
        return reduce_scatter_to_sequence_parallel_region(self.down_proj(F.silu(gate) * up))


class SPDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        self.input_layernorm = SequenceParallelNorm(config.hidden, config.norm_eps)
        self.self_attn = SPAttention(config, rank, world_size)
        self.post_attention_layernorm = SequenceParallelNorm(config.hidden, config.norm_eps)
        self.mlp = SPMLP(config, world_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaSP(nn.Module):
    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__()
        if config.seq % world_size or config.n_kv_heads % world_size:
            raise ValueError(f"seq={config.seq} and n_kv_heads={config.n_kv_heads} must divide by world_size={world_size}")
        self.embed_tokens = VocabParallelEmbedding(config, rank, world_size)
        self.layers = nn.ModuleList(SPDecoderLayer(config, rank, world_size) for _ in range(config.n_layers))
        self.norm = SequenceParallelNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab // world_size, bias=False)

    def forward(self, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        hidden = gather_from_sequence_parallel_region(self.norm(x))
        return gather_from_tensor_parallel_region(self.lm_head(hidden))


def finalize_grads(model: nn.Module) -> None:
    """Megatron: sum the sequence-parallel norm weights' gradients over the tensor-parallel group."""
    for param in model.parameters():
        if getattr(param, "sequence_parallel", False) and param.grad is not None:
            dist.all_reduce(param.grad)


# --------------------------------------------------------------------------------------------
# the case


class DistillationReference(LlamaReference):
    """The reference model; the teacher logits are an input of the loss only."""

    def forward(self, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids)


def reference() -> nn.Module:
    model = DistillationReference(CONFIG)
    return model


def distributed(rank: int, world_size: int) -> nn.Module:
    return LlamaSP(CONFIG, rank, world_size)


def inputs() -> tuple:
    c = CONFIG
    tokens = torch.randint(0, c.vocab, (c.batch, c.seq), dtype=torch.int64)
    return tokens, torch.randn(c.batch, c.seq, c.vocab)  # token ids, teacher logits


def loss(logits: torch.Tensor, tokens: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits, teacher_logits)


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    step_loss = loss(model(*inputs), *inputs)
    step_loss.backward()
    finalize_grads(model)
    return step_loss


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    return shard_llama_state(CONFIG, ref_state, rank, world_size)
