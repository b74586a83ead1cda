"""ddp-sync-flag-late: DDP's sync flag is set after the forward, so the last micro-step never syncs.

Origin: karpathy/build-nanogpt #30 (also nanoGPT, modded-nanogpt #31). The training loop skips
the gradient all-reduce on all but the last micro-step of gradient accumulation by setting
`model.require_backward_grad_sync`, but it set the flag between the forward and the backward.
DDP decides in the forward whether the coming backward reduces, so every micro-step ran with the
previous one's flag: the first micro-step synced its gradient and the last one never did. The fix
sets the flag before the forward.

torch's DDP reducer is C++ and invisible to tracing; `DistributedDataParallel` below is a small
Python reducer with the same contract (the forward arms the hooks, a hook averages each
gradient once it is accumulated).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
BATCH = 8  # global batch: every rank reads BATCH / world_size rows
GRAD_ACCUM_STEPS = 2

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(HIDDEN, FFN)
        self.c_proj = nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class DistributedDataParallel(nn.Module):
    def __init__(self, module, process_group=None):
        super().__init__()
        self.module = module
        self.process_group = process_group
        self.require_backward_grad_sync = True
        self._sync_in_backward = False
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._reduce)

    def forward(self, *inputs):
        self._sync_in_backward = torch.is_grad_enabled() and self.require_backward_grad_sync  # prepare_for_backward
        return self.module(*inputs)

    def _reduce(self, param):
        if self._sync_in_backward:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=self.process_group)


def reference():
    return Mlp()


def distributed(rank, world_size):
    return Mlp()


def inputs():
    return (torch.randn(BATCH, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 0)[rank]


def loss(output, x):
    return F.mse_loss(output, x)


def distributed_step(model, inputs, rank, world_size):
    (x,) = inputs
    model = DistributedDataParallel(model)
    loss_accum = torch.zeros(())
    for micro_step, micro_batch in enumerate(x.chunk(GRAD_ACCUM_STEPS, 0)):
        model.require_backward_grad_sync = micro_step == GRAD_ACCUM_STEPS - 1  # FIX: before the forward
        micro_loss = loss(model(micro_batch), micro_batch) / GRAD_ACCUM_STEPS
        loss_accum += micro_loss.detach()
        micro_loss.backward()
    dist.all_reduce(loss_accum, op=dist.ReduceOp.AVG)
    return loss_accum
