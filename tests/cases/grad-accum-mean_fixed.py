"""grad-accum-mean: a per-micro-batch mean loss summed over gradient accumulation steps.

Origin: HF Trainer's gradient accumulation fix (transformers 4.46, `num_items_in_batch`; Entangle
bug 6, traced on transformers' test_trainer_simple). A model whose loss accepts
`num_items_in_batch` is no longer divided by `gradient_accumulation_steps`: the loss must be the
sum over the micro-batch divided by the number of items in the whole accumulated batch. A custom
loss that still returns the micro-batch mean is added up over the accumulation steps, so the loss
and every gradient are `gradient_accumulation_steps` times too large (and uneven micro-batches
would weigh their items unequally). The fix divides the sum by `num_items_in_batch`.
Data parallel as under DDP: each rank accumulates over its shard, gradients are averaged.
"""

import torch
import torch.distributed as dist
from torch import nn

BATCH = 12  # global batch: every rank reads BATCH / world_size items
GRADIENT_ACCUMULATION_STEPS = 3

WORLD_SIZE = 2
MODE = "train"


class RegressionModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.0))
        self.b = nn.Parameter(torch.tensor(0.0))

    def forward(self, input_x, labels=None):
        return input_x * self.a + self.b


def my_loss(y, labels, num_items_in_batch):
    return ((y - labels) ** 2).sum() / num_items_in_batch  # FIX: normalised by the whole accumulated batch


def reference():
    return RegressionModel()


def distributed(rank, world_size):
    return RegressionModel()


def inputs():
    return torch.randn(BATCH), torch.randn(BATCH)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size, 0)[rank]


def loss(output, input_x, labels):
    return ((output - labels) ** 2).mean()


def distributed_step(model, inputs, rank, world_size):
    """Trainer's inner loop for one optimizer step, then DDP's gradient average and the logged mean loss."""
    input_x, labels = inputs
    micro_batches = list(zip(input_x.chunk(GRADIENT_ACCUMULATION_STEPS), labels.chunk(GRADIENT_ACCUMULATION_STEPS)))
    num_items_in_batch = sum(batch_labels.numel() for _, batch_labels in micro_batches)
    tr_loss = torch.zeros(())
    for batch_x, batch_labels in micro_batches:
        step_loss = my_loss(model(batch_x, batch_labels), batch_labels, num_items_in_batch)
        step_loss.backward()
        tr_loss = tr_loss + step_loss.detach()
    for param in model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    dist.all_reduce(tr_loss, op=dist.ReduceOp.AVG)
    return tr_loss
