"""zero-epilogue-order: the boundary micro-batch's gradient is accumulated after the all-reduce.

Origin: DeepSpeed #7985 (BF16_Optimizer under ZeRO-1 with fp32 gradient accumulation). A bf16
model accumulates its gradients in fp32: after every micro-batch's backward, the engine's backward
epilogue adds the bf16 `.grad`s into fp32 accumulators and clears them; at the accumulation
boundary it averages the accumulators over the data-parallel ranks. `_backward_epilogue` called
`allreduce_gradients()` before the optimizer's epilogue, so the last micro-batch's gradient is
added to the already averaged accumulator and stays rank-local. The fix runs the accumulation first.
The user reads the fp32 gradients as `deepspeed.utils.safe_get_full_grad` returns them.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, FFN = 8, 16
BATCH = 8  # global batch: every rank reads BATCH / world_size rows
GRADIENT_ACCUMULATION_STEPS = 2

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


class BF16Engine:
    """The parts of DeepSpeedEngine + BF16_Optimizer that one training step goes through."""

    def __init__(self, module, gradient_accumulation_steps):
        self.module = module
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.micro_steps = 0
        self.fp32_grads = {p: torch.zeros_like(p, dtype=torch.float32) for p in module.parameters()}

    def backward(self, loss):
        (loss / self.gradient_accumulation_steps).backward()
        self.micro_steps += 1
        self._backward_epilogue()

    def is_gradient_accumulation_boundary(self):
        return self.micro_steps % self.gradient_accumulation_steps == 0

    def _backward_epilogue(self):
        for param, fp32_grad in self.fp32_grads.items():  # optimizer.backward_epilogue()
            fp32_grad.add_(param.grad.float())  # FIX: accumulated before the boundary all-reduce
            param.grad = None
        if self.is_gradient_accumulation_boundary():
            self.allreduce_gradients()

    def allreduce_gradients(self):
        for fp32_grad in self.fp32_grads.values():
            dist.all_reduce(fp32_grad, op=dist.ReduceOp.AVG)

    def safe_get_full_grad(self, param):
        return self.fp32_grads[param]


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
    engine = BF16Engine(model, GRADIENT_ACCUMULATION_STEPS)
    losses = []
    for micro_batch in x.chunk(GRADIENT_ACCUMULATION_STEPS, 0):
        micro_loss = loss(model(micro_batch), micro_batch)
        engine.backward(micro_loss)
        losses.append(micro_loss.detach())
    for param in model.parameters():
        param.grad = engine.safe_get_full_grad(param).to(param.dtype)
    return torch.stack(losses).mean()
