"""zero-wrong-buffer: the engine all-reduces the bf16 gradients, the optimizer uses fp32 copies.

Origin: DeepSpeed #5170 (ZeRO stage 0 + bf16, also #5154). With bf16 and no ZeRO partitioning,
DeepSpeed runs BF16_Optimizer, which copies each bf16 `.grad` into an fp32 gradient buffer right
after the backward. The engine then all-reduced the bf16 `.grad`s, which nothing reads any more:
the fp32 gradients the optimizer steps on stay rank-local. The fix all-reduces the fp32 buffer.
The user reads the fp32 gradients as `deepspeed.utils.safe_get_full_grad` returns them.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
BATCH = 8  # global batch: every rank reads BATCH / world_size rows

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class Mlp(nn.Module):
    def __init__(self, dtype=None):
        super().__init__()
        self.up = nn.Linear(HIDDEN, FFN, dtype=dtype)
        self.down = nn.Linear(FFN, HIDDEN, dtype=dtype)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class BF16Optimizer:
    """Keeps fp32 gradients for a bf16 model (the gradient side of DeepSpeed's BF16_Optimizer)."""

    def __init__(self, params):
        self.fp32_grads = {p: torch.zeros_like(p, dtype=torch.float32) for p in params}

    def backward_epilogue(self):
        for param, fp32_grad in self.fp32_grads.items():
            fp32_grad.add_(param.grad.float())


class Engine:
    def __init__(self, module):
        self.module = module
        self.optimizer = BF16Optimizer(module.parameters())

    def backward(self, loss):
        loss.backward()
        self.optimizer.backward_epilogue()
        self.allreduce_gradients()

    def allreduce_gradients(self):
        for param, fp32_grad in self.optimizer.fp32_grads.items():
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)  # BUG(partial): the bf16 grads; the optimizer reads fp32_grad

    def safe_get_full_grad(self, param):
        return self.optimizer.fp32_grads[param]


def reference():
    return Mlp()


def distributed(rank, world_size):
    return Mlp(dtype=torch.bfloat16)


def inputs():
    return (torch.randn(BATCH, HIDDEN),)


def shard_state(ref_state, rank, world_size):
    return {name: tensor.to(torch.bfloat16) for name, tensor in ref_state.items()}


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 0)[rank].to(torch.bfloat16)


def loss(output, x):
    return F.mse_loss(output, x)


def distributed_step(model, inputs, rank, world_size):
    (x,) = inputs
    engine = Engine(model)
    batch_loss = loss(model(x), x)
    engine.backward(batch_loss)
    for param in model.parameters():
        param.grad = engine.safe_get_full_grad(param).to(param.dtype)
    return batch_loss
