"""ddp-static-graph: with DDP's static graph, manual optimization never all-reduces the first iteration's gradients.

Origin: Lightning-AI/pytorch-lightning #18086, fixed in #21251. With `DDPStrategy(static_graph=True)`
DDP does not reduce gradients from its hooks in the first iteration (it is still learning the graph);
it reduces them all at once when `reducer._delay_all_reduce()` runs after the backward. Lightning's
automatic optimization got there; with manual optimization (`self.manual_backward(loss)`) the
strategy's `post_backward` never called it, so the first step updated every rank with its own
batch's gradient. The fix calls `_delay_all_reduce()` in `post_backward`.

torch's DDP reducer is C++ and invisible to tracing; `DistributedDataParallel` below is a small
Python reducer with the same contract. Marked (the missing collective's value): the forward line
whose backward makes the gradients left unreduced.
"""

import torch
import torch.distributed as dist
from torch import nn

HIDDEN = 8
BATCH = 8  # global batch: every rank reads BATCH / world_size rows

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class BoringModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(HIDDEN, 2)

    def forward(self, x):
        return self.layer(x)  # BUG(partial): its weight and bias gradients are never all-reduced in the first iteration


class DistributedDataParallel(nn.Module):
    def __init__(self, module, static_graph=False):
        super().__init__()
        self.module = module
        self.static_graph = static_graph
        self.first_iteration = True
        self._delayed = []
        for param in module.parameters():
            param.register_post_accumulate_grad_hook(self._reduce)

    def forward(self, *inputs):
        return self.module(*inputs)

    def _reduce(self, param):
        if self.static_graph and self.first_iteration:  # the graph is learnt first: reduce later, all at once
            self._delayed.append(param)
        else:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)

    def _delay_all_reduce(self):
        for param in self._delayed:
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        self._delayed, self.first_iteration = [], False


class DDPStrategy:
    def __init__(self, model):
        self.model = DistributedDataParallel(model, static_graph=True)

    def backward(self, loss):
        loss.backward()
        self.post_backward(loss)

    def post_backward(self, loss):
        pass


def reference():
    return BoringModel()


def distributed(rank, world_size):
    return BoringModel()


def inputs():
    return (torch.randn(BATCH, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 0)[rank]


def loss(output, x):
    return output.pow(2).mean()


def distributed_step(model, inputs, rank, world_size):
    """Lightning's manual optimization: `training_step` calls `self.manual_backward(loss)`."""
    (x,) = inputs
    strategy = DDPStrategy(model)
    step_loss = loss(strategy.model(x), x)
    strategy.backward(step_loss)
    dist.all_reduce(step_loss, op=dist.ReduceOp.AVG)
    return step_loss
