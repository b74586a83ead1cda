"""vocab-ce-label-smoothing-bwd: Megatron vocab-parallel cross entropy with label smoothing (backward).

Origin: Megatron-LM #737 and #7464 (megatron/core/tensor_parallel/cross_entropy.py), the backward
half of vocab-ce-label-smoothing. The loss is (1 - s) * nll - s * mean(log_probs) over the whole
vocabulary, s = alpha * V / (V - 1); its gradient with respect to the logits is
softmax - (1 - s) * one_hot(target) - s / V. Megatron's custom backward builds it on each rank's
vocab shard: the softmax, minus (1 - s) at the target if this rank owns it, minus s / V on every
class. The forward here is right (all-reduced mean, global vocab size). The buggy twin's backward
subtracts s / (local vocab size), the gradient of the mean over this rank's slice only: the same
local mean, in the backward. The per-class term is world_size times too large.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 8
VOCAB = 16
BATCH, SEQ = 2, 3
LABEL_SMOOTHING = 0.1

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token smoothed cross entropy of vocab-parallel logits, with Megatron's backward."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)

        partition_vocab_size = vocab_parallel_logits.size(-1)
        vocab_start_index = dist.get_rank() * partition_vocab_size
        vocab_end_index = vocab_start_index + partition_vocab_size
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0

        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size(0), device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits = predicted_logits_1d.clone().contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits)

        exp_logits = torch.exp(vocab_parallel_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits)

        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits = exp_logits / sum_exp_logits.unsqueeze(dim=-1)

        vocab_size = partition_vocab_size * dist.get_world_size()
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        log_probs = torch.log(exp_logits)
        sum_log_probs = log_probs.sum(dim=-1)
        dist.all_reduce(sum_log_probs)
        loss = (1.0 - smoothing) * loss - smoothing * sum_log_probs / vocab_size

        ctx.smoothing, ctx.vocab_size = smoothing, vocab_size
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        smoothing, vocab_size = ctx.smoothing, ctx.vocab_size

        grad_input = softmax.clone()
        partition_vocab_size = softmax.size(-1)
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size(0), device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= (1.0 - smoothing) * softmax_update
        grad_2d[arange_1d, :] -= smoothing / partition_vocab_size  # BUG(scale): the gradient of a mean over this rank's vocab slice only, not over the vocabulary
        grad_input.mul_(grad_output.unsqueeze(dim=-1))
        return grad_input, None, None


class ParallelLMHead(nn.Module):
    """Column-parallel lm_head (this rank's vocab rows) + vocab-parallel smoothed cross entropy."""

    def __init__(self, world_size):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB // world_size, HIDDEN))

    def forward(self, hidden_states, labels):
        logits = F.linear(hidden_states, self.weight)
        return _VocabParallelCrossEntropy.apply(logits, labels, LABEL_SMOOTHING)


class LMHead(nn.Module):
    """Single device: the same smoothed loss over the whole vocabulary, differentiated by autograd."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states, labels):
        log_probs = torch.log_softmax(F.linear(hidden_states, self.weight), dim=-1)
        nll = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        smoothing = LABEL_SMOOTHING * VOCAB / (VOCAB - 1)
        return (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


def reference():
    return LMHead()


def distributed(rank, world_size):
    return ParallelLMHead(world_size)


def inputs():
    labels = torch.arange(BATCH * SEQ).mul(5).remainder(VOCAB).view(BATCH, SEQ)
    return torch.randn(BATCH, SEQ, HIDDEN), labels


def loss(per_token_loss, hidden_states, labels):
    return per_token_loss.mean()
