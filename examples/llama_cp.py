"""Case: a Llama decoder with context parallelism by causal ring attention, forward and training.

Reference (examples/llama_reference.py): causal attention over the whole sequence, trained on a
logit-distillation loss (the mean squared error against a teacher's logits).

Distributed: the sequence is cut into `world size` contiguous chunks; rank r holds chunk r of the
tokens (`shard_input`) and every weight whole. Each rank embeds, normalises and projects its own
tokens, its rotary tables the rows of its positions. Attention is a ring (as ring flash-attention
and torch's `context_parallel` ring): each rank's K and V travel round the ring by
`batch_isend_irecv`, rank r holding at step i the block of rank r - i. The causal mask decides
each block: the rank's own block is masked by the triangle, a block of earlier positions is
attended in full, a block of later ones is skipped, and each block's attention is merged into the
running one by log-sum-exp. The backward (an autograd Function) goes round the ring again:
it recomputes each block's probabilities from the merged log-sum-exp, adds that block's dQ to
its own and its dK and dV to the gradient travelling with the block, which a last step hands
back to the block's owner. Training: each rank's loss is the mean over its tokens; the weights'
gradients are averaged over the ranks (as FSDP/DDP over the context-parallel group does).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llama_reference import PRESETS as LLAMA_PRESETS
from llama_reference import Attention, LlamaConfig, LlamaReference, apply_rope, rotary_tables, token_inputs

CONFIG = LlamaConfig(vocab=64, hidden=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn=64, seq=16, batch=1)
PRESETS = {name: replace(config, batch=1) for name, config in LLAMA_PRESETS.items()}
WORLD_SIZE = 4
OUTPUT = ("shard", 1)
SEQ_DIM = 1


def pass_on(block: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Send `block` to rank + 1, receive rank - 1's."""
    received = torch.empty_like(block)
    ops = [dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
           dist.P2POp(dist.isend, block.contiguous(), (rank + 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def block_scores(q: torch.Tensor, k: torch.Tensor, diagonal: bool) -> torch.Tensor:
    """q k^T / sqrt(d), the future keys at -inf on the diagonal block (the rank's own)."""
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    if diagonal:
        future = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, float("-inf"))
    return scores


def visible(source: int, rank: int) -> bool:
    """Rank `rank`'s queries see keys of block `source` (contiguous chunks): earlier blocks and its own."""
    return source <= rank


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over every rank's keys, by a ring of KV blocks."""

    @staticmethod
    def forward(ctx, q, k, v, rank, world_size):
        kv = torch.stack([k, v])
        scores = block_scores(q, k, diagonal=True)
        out, lse = torch.matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)
        for step in range(1, world_size):
            kv = pass_on(kv, rank, world_size)
            if not visible((rank - step) % world_size, rank):
                continue
            scores = block_scores(q, kv[0], diagonal=False)
            block_out, block_lse = torch.matmul(torch.softmax(scores, dim=-1), kv[1]), torch.logsumexp(scores, dim=-1)
            new_lse = torch.logsumexp(torch.stack([lse, block_lse]), dim=0)
            out = torch.exp(lse - new_lse)[..., None] * out + torch.exp(block_lse - new_lse)[..., None] * block_out
            lse = new_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rank, ctx.world_size = rank, world_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world_size = ctx.rank, ctx.world_size
        scale = q.shape[-1] ** -0.5
        delta = (grad_out * out).sum(-1, keepdim=True)  # = rowsum(dP * P), the softmax backward's
        grad_q = torch.zeros_like(q)
        kv, grad_kv = torch.stack([k, v]), torch.zeros_like(torch.stack([k, v]))
        for step in range(world_size):
            if step > 0:
                kv, grad_kv = pass_on(kv, rank, world_size), pass_on(grad_kv, rank, world_size)
            if not visible((rank - step) % world_size, rank):
                continue
            probs = torch.exp(block_scores(q, kv[0], diagonal=step == 0) - lse[..., None])
            grad_probs = torch.matmul(grad_out, kv[1].transpose(-2, -1))
            grad_scores = probs * grad_probs - probs * delta  # the softmax backward
            grad_q = grad_q + torch.matmul(grad_scores, kv[0]) * scale
            grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale
            grad_v = torch.matmul(probs.transpose(-2, -1), grad_out)
            grad_kv = grad_kv + torch.stack([grad_k, grad_v])
        if world_size > 1:
            grad_kv = pass_on(grad_kv, rank, world_size)  # the block's gradient back to its owner
        return grad_q, grad_kv[0], grad_kv[1], None, None


class RingSelfAttention(Attention):
    """The reference's attention over this rank's chunk of the sequence, by ring attention."""

    def __init__(self, config: LlamaConfig, rank: int, world_size: int):
        super().__init__(config)
        self.rank, self.world_size = rank, world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, s_local, _ = x.shape
        q_size, kv_size = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(b, s_local, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, s_local, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, s_local, c.n_kv_heads, c.head_dim).transpose(1, 2)
        cos, sin = rotary_tables(c, s_local * self.world_size, x.dtype, x.device)
        mine = slice(self.rank * s_local, (self.rank + 1) * s_local)  # this rank's positions
        q, k = apply_rope(q, cos[mine], sin[mine]), apply_rope(k, cos[mine], sin[mine])
        groups = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = RingAttention.apply(q, k, v, self.rank, self.world_size)
        return self.o_proj(out.transpose(1, 2).reshape(b, s_local, q_size))


class LlamaLM(LlamaReference):
    """The reference, called with the teacher's logits too (it ignores them)."""

    def forward(self, input_ids: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids)


def reference() -> nn.Module:
    return LlamaLM(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    if CONFIG.seq % world_size:
        raise ValueError(f"a sequence of {CONFIG.seq} does not divide into {world_size} chunks")
    model = LlamaLM(CONFIG)
    for layer in model.layers:
        layer.self_attn = RingSelfAttention(CONFIG, rank, world_size)
    return model


def inputs() -> tuple:
    (tokens,) = token_inputs(CONFIG)
    return tokens, torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.vocab)  # token ids, teacher logits


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r reads chunk r of the sequence, of the tokens and of the teacher's logits alike."""
    return full.chunk(world_size, dim=SEQ_DIM)[rank]


def loss(logits: torch.Tensor, tokens: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits, teacher_logits)


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """The loss over this rank's tokens; the weights' gradients averaged over the ranks."""
    value = loss(model(*inputs), *inputs)
    value.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return value
