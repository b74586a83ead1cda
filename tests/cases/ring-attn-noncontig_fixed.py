"""ring-attn-noncontig: ring attention's backward hands the attention kernel a log-sum-exp that
is a non-contiguous view, which the kernel reads as a dense array.

Origin: TransformerEngine #498 (context-parallel attention: a strided slice of `softmax_lse`
passed to flash attention's backward, fixed by `.contiguous()`); the ring flash-attention ports
meet the same layout, since flash attention returns the log-sum-exp as (heads, seq) and the
online-softmax merge keeps it as (seq, heads), beside the output. The kernel indexes its lse
argument from the data pointer as a dense (heads, seq) array whatever its strides: given
`lse.transpose(0, 1)` it reads the (seq, heads) buffer in the wrong order, and every gradient
computed from the recomputed probabilities is wrong. `flash_attn_backward` below is a CPU
stand-in for the kernel that reads memory as the CUDA one does. The forward is right.
The sequence is split in contiguous chunks over the ranks (a bidirectional encoder: no causal
mask); KV blocks travel round the ring by `batch_isend_irecv`, merged by log-sum-exp; the
backward goes round again, each block's dK and dV travelling with it back to its owner.
Training: each rank's loss is the mean over its tokens, the weights' gradients averaged.
Marked: the kernel's read of the lse, where the layout goes wrong (the fix makes the argument
contiguous where the backward passes it).
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 32
N_HEADS = 4
HEAD_DIM = HIDDEN // N_HEADS
SEQ = 16

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"
OUTPUT = ("shard", 0)


def pass_on(block, rank, world_size):
    """Send `block` to rank + 1, receive rank - 1's."""
    received = torch.empty_like(block)
    ops = [dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
           dist.P2POp(dist.isend, block.contiguous(), (rank + 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


def dense_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


def flash_attn_forward(q, k, v):
    """Attention of q over one KV block: out (heads, s_q, d) and lse (heads, s_q), as flash attention."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    return torch.matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)


def flash_attn_backward(grad_out, q, k, v, out, softmax_lse):
    """The gradients of one block's attention, probabilities recomputed from the merged lse.
    Reads softmax_lse as the kernel does: a dense (heads, s_q) array from its data pointer."""
    lse = softmax_lse.as_strided(softmax_lse.shape, dense_strides(softmax_lse.shape))
    probs = torch.exp(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM) - lse[..., None])
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * torch.matmul(grad_out, v.transpose(-1, -2)) - probs * delta
    grad_q = torch.matmul(grad_scores, k) / math.sqrt(HEAD_DIM)
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q) / math.sqrt(HEAD_DIM)
    return grad_q, grad_k, torch.matmul(probs.transpose(-1, -2), grad_out)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rank, world_size):
        kv = torch.stack([k, v])
        out, block_lse = flash_attn_forward(q, k, v)
        lse = block_lse.transpose(0, 1)  # (s, heads), beside out's rows, for the merge
        for _ in range(1, world_size):
            kv = pass_on(kv, rank, world_size)
            block_out, block_lse = flash_attn_forward(q, kv[0], kv[1])
            block_lse = block_lse.transpose(0, 1)
            new_lse = torch.logsumexp(torch.stack([lse, block_lse]), dim=0)
            out = (torch.exp(lse - new_lse).transpose(0, 1)[..., None] * out
                   + torch.exp(block_lse - new_lse).transpose(0, 1)[..., None] * block_out)
            lse = new_lse
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.rank, ctx.world_size = rank, world_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world_size = ctx.rank, ctx.world_size
        softmax_lse = lse.transpose(0, 1).contiguous()  # FIX: the dense (heads, seq) array the kernel reads
        grad_q = torch.zeros_like(q)
        kv, grad_kv = torch.stack([k, v]), torch.zeros_like(torch.stack([k, v]))
        for step in range(world_size):
            if step > 0:
                kv, grad_kv = pass_on(kv, rank, world_size), pass_on(grad_kv, rank, world_size)
            block_grad_q, grad_k, grad_v = flash_attn_backward(grad_out, q, kv[0], kv[1], out, softmax_lse)
            grad_q = grad_q + block_grad_q
            grad_kv = grad_kv + torch.stack([grad_k, grad_v])
        if world_size > 1:
            grad_kv = pass_on(grad_kv, rank, world_size)  # the block's gradient back to its owner
        return grad_q, grad_kv[0], grad_kv[1], None, None


class Attention(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.kv_proj = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden, targets):
        s_local = hidden.shape[0]
        q = self.q_proj(hidden).view(s_local, N_HEADS, HEAD_DIM).transpose(0, 1)
        kv = self.kv_proj(hidden).view(s_local, 2, N_HEADS, HEAD_DIM).permute(1, 2, 0, 3)
        out = RingAttention.apply(q, kv[0], kv[1], self.rank, self.world_size)
        return self.o_proj(out.transpose(0, 1).reshape(s_local, HIDDEN))


def reference():
    return Attention()


def distributed(rank, world_size):
    return Attention(rank, world_size)


def inputs():
    return torch.randn(SEQ, HIDDEN), torch.randn(SEQ, HIDDEN)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=0)[rank]


def loss(output, hidden, targets):
    return ((output - targets) ** 2).mean()


def distributed_step(model, inputs, rank, world_size):
    value = loss(model(*inputs), *inputs)
    value.backward()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return value
