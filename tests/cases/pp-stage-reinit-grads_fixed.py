"""pp-stage-reinit-grads: a pipeline stage re-initialised per microbatch drops the gradients accumulated so far.

Origin: NeMo Automodel #3530. Its pipeline-parallel step re-initialised the stages whenever the
microbatch's sequence length changed (for VLM batches nearly every microbatch), and the re-init's
cleanup cleared the parameters' gradients. With gradient accumulation that landed between
microbatches: each stage kept only the last microbatch's gradient. The loss (summed separately)
looked fine. The fix keeps the accumulated gradients across a re-init.

Two or more stages (one per rank) of a residual MLP stack, 4 microbatches, each run forward and
backward in turn: activations sent forward, gradients backward (`dist.send` / `dist.recv`), each
microbatch's loss divided by the number of microbatches, its parameter gradients added into
`main_grad` buffers (Megatron / NeMo style). Marked: the re-init's reset of those buffers.
"""

import torch
import torch.distributed as dist
from torch import nn

LAYERS, HIDDEN, BATCH, MICROBATCHES = 4, 8, 8, 4

WORLD_SIZE = 2
MODE = "train"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Stack(nn.Module):
    def __init__(self, layers=range(LAYERS), head=True):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): Block() for i in layers})
        self.head = nn.Linear(HIDDEN, 1) if head else None

    def forward(self, x, *targets):
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(x)


class PipelineStage:
    """A stage keeping fp32 `main_grad` accumulation buffers (Megatron / NeMo style): each
    microbatch's backward adds the parameters' gradients into them."""

    def __init__(self, module, rank, world_size):
        self.module, self.rank, self.world_size = module, rank, world_size
        self.is_first, self.is_last = rank == 0, rank == world_size - 1
        self.inputs, self.outputs = [], []

    def reset_shapes(self):
        """Re-initialise the stage for a new microbatch shape (VLM batches change it nearly every
        step); its cleanup drops what metadata inference left in the buffers."""
        for param in self.module.parameters():
            param.main_grad = param.main_grad if hasattr(param, "main_grad") else torch.zeros_like(param)  # FIX: keep the gradients accumulated so far

    def accumulate(self):
        for param in self.module.parameters():
            param.main_grad = param.main_grad + param.grad
            param.grad = None

    def forward(self, x, target):
        if not self.is_first:
            x = torch.empty(x.shape)
            dist.recv(x, self.rank - 1)
            x.requires_grad_()
        out = self.module(x)
        if self.is_last:
            out = loss(out, None, target) / MICROBATCHES
        else:
            dist.send(out.detach(), self.rank + 1)
        self.inputs.append(x)
        self.outputs.append(out)
        return out

    def backward(self, i):
        out = self.outputs[i]
        if self.is_last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, self.rank + 1)
            out.backward(grad)
        if not self.is_first:
            dist.send(self.inputs[i].grad, self.rank - 1)
        self.accumulate()


def reference():
    return Stack()


def distributed(rank, world_size):
    per_stage = LAYERS // world_size
    return Stack(range(rank * per_stage, (rank + 1) * per_stage), head=rank == world_size - 1)


def inputs():
    return torch.randn(BATCH, HIDDEN), torch.randn(BATCH, 1)


def loss(output, x, target):
    return ((output - target) ** 2).mean()


def distributed_step(model, inputs, rank, world_size):
    x, target = inputs
    stage = PipelineStage(model, rank, world_size)
    losses = []
    for i, (x_mb, target_mb) in enumerate(zip(x.chunk(MICROBATCHES), target.chunk(MICROBATCHES))):
        stage.reset_shapes()
        losses.append(stage.forward(x_mb, target_mb).detach())
        stage.backward(i)
    for param in model.parameters():
        param.grad = param.main_grad
    return sum(losses) if stage.is_last else None
