"""log-softmax-bwd-identity: under `loss_parallel()`, the backward of log_softmax returns its
gradient unchanged, which is right only when nll_loss consumes the log-probs.

Origin: PyTorch #190746 (torch.distributed.tensor.parallel.loss_parallel). Loss parallelism
keeps the lm head's logits sharded along the vocab (`Shard(-1)`) and computes cross entropy
across ranks. Its nll_loss backward already folds in the log_softmax backward (softmax minus the
one-hot), so its log_softmax backward handler passes the gradient through. Any other consumer of
the same log-probs gets no `- softmax * sum(grad)` term: here an entropy bonus (as in
RL fine-tuning) computed from the log-probs inside the `loss_parallel()` context. The fix, as
torchtitan does, keeps only the cross entropy inside `loss_parallel()` and computes the entropy
from the gathered logits outside it.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

HIDDEN, VOCAB = 8, 16
BATCH, SEQ = 2, 3
ENTROPY_COEF = 0.1

WORLD_SIZE = 2
MODE = "train"


class LMHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, hidden_states, labels):
        return self.output(hidden_states)


def reference():
    return LMHead()


def distributed(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    plan = {"output": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(LMHead(), mesh, plan)


def inputs():
    labels = torch.arange(BATCH * SEQ).mul(5).remainder(VOCAB).view(BATCH, SEQ)
    return torch.randn(BATCH, SEQ, HIDDEN), labels


def mean_entropy(log_probs):
    return -(log_probs.exp() * log_probs).sum(-1).mean()


def loss(logits, hidden_states, labels):
    """Cross entropy minus an entropy bonus."""
    flat_logits = logits.flatten(0, 1)
    log_probs = F.log_softmax(flat_logits, dim=-1)
    cross_entropy = F.nll_loss(log_probs, labels.flatten(0, 1))
    return cross_entropy - ENTROPY_COEF * mean_entropy(log_probs)


def distributed_step(model, inputs, rank, world_size):
    hidden_states, labels = inputs
    with loss_parallel():
        logits = model(hidden_states, labels)
        cross_entropy = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))  # FIX: only nll consumes the log-probs
        entropy = mean_entropy(F.log_softmax(logits.full_tensor().flatten(0, 1), dim=-1))  # FIX: plain tensor, outside DTensor's handlers
        loss_value = cross_entropy.full_tensor() - ENTROPY_COEF * entropy  # FIX
        loss_value.backward()
    return loss_value
