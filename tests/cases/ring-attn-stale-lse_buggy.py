"""ring-attn-stale-lse: a ring-attention step that weighs the new block by the old log-sum-exp.

Origin: ring attention (Liu et al.; the ring and zigzag-ring flash-attention ports, torch's
`context_parallel` ring) merges each KV block's partial attention into the running result by
log-sum-exp: new = logsumexp(lse, block_lse), out = exp(lse - new) * out + exp(block_lse - new) *
block_out. The buggy twin weighs the block by exp(block_lse - lse), the running lse before the
merge (TransformerEngine's and several ports' update helpers were rewritten after such mix-ups of
the old and new lse). The sequence is split in contiguous chunks over the ranks (a bidirectional
encoder: no causal mask); at each step a rank passes the KV block it holds to rank r + 1 and
receives rank r - 1's with `batch_isend_irecv`. At world size 1 there is no merge.
"""

import math

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 32
N_HEADS = 4
HEAD_DIM = HIDDEN // N_HEADS
SEQ = 16

WORLD_SIZE = 4
BUG_WORLD_SIZE = 2
OUTPUT = ("shard", 0)


def block_attention(q, k, v):
    """The attention of q over one KV block, and its log-sum-exp over the block's keys."""
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    return torch.matmul(torch.softmax(scores, dim=-1), v), torch.logsumexp(scores, dim=-1)


def pass_on(block, rank, world_size):
    """Send `block` to rank + 1, receive rank - 1's."""
    received = torch.empty_like(block)
    ops = [dist.P2POp(dist.irecv, received, (rank - 1) % world_size),
           dist.P2POp(dist.isend, block.contiguous(), (rank + 1) % world_size)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


class Attention(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.kv_proj = nn.Linear(HIDDEN, 2 * HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, hidden):
        s_local = hidden.shape[0]
        q = self.q_proj(hidden).view(s_local, N_HEADS, HEAD_DIM).transpose(0, 1)
        kv = self.kv_proj(hidden).view(s_local, 2, N_HEADS, HEAD_DIM).permute(1, 2, 0, 3)
        out, lse = block_attention(q, kv[0], kv[1])
        for _ in range(1, self.world_size):  # online softmax: merge each block by the log-sum-exps
            kv = pass_on(kv, self.rank, self.world_size)
            block_out, block_lse = block_attention(q, kv[0], kv[1])
            new_lse = torch.logsumexp(torch.stack([lse, block_lse]), dim=0)
            out = torch.exp(lse - new_lse)[..., None] * out + torch.exp(block_lse - lse)[..., None] * block_out  # BUG(scale): the block weighed by the old lse
            lse = new_lse
        return self.o_proj(out.transpose(0, 1).reshape(s_local, HIDDEN))


def reference():
    return Attention()


def distributed(rank, world_size):
    return Attention(rank, world_size)


def inputs():
    return (torch.randn(SEQ, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, dim=0)[rank]
