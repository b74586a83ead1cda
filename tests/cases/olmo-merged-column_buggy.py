"""olmo-merged-column: vLLM OLMo MLP with a fused up/gate projection.

Origin: vLLM #3775 (OLMo produces garbage with tensor parallelism), fixed in #3869. OLMo's ff_proj
is one fused weight [W_x; W_gate] (2 * intermediate rows); the activation splits its output with
`x, gate = x.chunk(2, dim=-1)` and returns silu(gate) * x. vLLM built ff_proj as a plain
ColumnParallelLinear, whose loader gives every rank one contiguous block of the fused rows: at
tp=2 rank 0 holds all of W_x and rank 1 all of W_gate, so the local chunk(2) pairs the wrong
halves. The fix makes it a MergedColumnParallelLinear: each rank holds [W_x shard; W_gate shard].
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
INTERMEDIATE = 64
NUM_TOKENS = 6

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class OlmoMLP(nn.Module):
    def __init__(self, tp_size=1):
        super().__init__()
        self.tp_size = tp_size
        # ff_proj: the fused [x; gate] projection, column parallel; ff_out: row parallel
        self.ff_proj = nn.Linear(HIDDEN, 2 * INTERMEDIATE // tp_size, bias=False)
        self.act = SwiGLU()
        self.ff_out = nn.Linear(INTERMEDIATE // tp_size, HIDDEN, bias=False)

    def forward(self, x):
        out = self.ff_out(self.act(self.ff_proj(x)))
        if self.tp_size > 1:
            dist.all_reduce(out)  # RowParallelLinear's reduce_results
        return out


def reference():
    return OlmoMLP()


def distributed(rank, world_size):
    return OlmoMLP(tp_size=world_size)


def inputs():
    return (torch.randn(NUM_TOKENS, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    """The weight loaders of ff_proj and ff_out (RowParallelLinear: input columns)."""
    ff_proj = ref_state["ff_proj.weight"]
    return {
        "ff_proj.weight": ff_proj.chunk(world_size, dim=0)[rank],  # BUG(layout): plain ColumnParallelLinear loader: one contiguous block of the fused [x; gate] rows, so chunk(2) pairs the wrong halves
        "ff_out.weight": ref_state["ff_out.weight"].chunk(world_size, dim=1)[rank],
    }
