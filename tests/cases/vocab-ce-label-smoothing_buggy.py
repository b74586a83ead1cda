"""vocab-ce-label-smoothing: Megatron vocab-parallel cross entropy with label smoothing (forward).

Origin: Megatron-LM #737 and #7464 (megatron/core/tensor_parallel/cross_entropy.py). With the
vocabulary split across tensor-parallel ranks, the max, the target logit and the sum of exps are
all-reduced, but the label-smoothing term is not: mean_log_probs is the mean over this rank's
vocabulary slice only, never all-reduced (marked), and the smoothing coefficient uses the local
partition size exp_logits.size(-1) as the vocabulary size (the line above it). The loss differs
between ranks and from the single-device loss. Both lines are fixed in the fixed twin.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN = 32
VOCAB = 64
BATCH, SEQ = 2, 4
LABEL_SMOOTHING = 0.1

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = "replicate"


def _all_reduce(tensor, op=dist.ReduceOp.SUM):
    dist.all_reduce(tensor, op=op)
    return tensor


def vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing, rank, world_size):
    """The forward of Megatron's _VocabParallelCrossEntropy; per-token loss."""
    logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
    _all_reduce(logits_max, op=dist.ReduceOp.MAX)
    vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)

    partition_vocab_size = vocab_parallel_logits.size(-1)
    vocab_start_index = rank * partition_vocab_size
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
    _all_reduce(predicted_logits)

    exp_logits = torch.exp(vocab_parallel_logits)
    sum_exp_logits = exp_logits.sum(dim=-1)
    _all_reduce(sum_exp_logits)

    loss = torch.log(sum_exp_logits) - predicted_logits
    exp_logits = exp_logits / sum_exp_logits.unsqueeze(dim=-1)

    if label_smoothing > 0:
        # (1 - alpha) on the target plus alpha / (K - 1) on every other class, K = vocab size
        vocab_size = exp_logits.size(-1)  # also wrong: the local partition size, not the vocab size
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        log_probs = torch.log(exp_logits)
        mean_log_probs = log_probs.mean(dim=-1)  # BUG(partial): mean over this rank's vocab slice only, never all-reduced over the vocab-parallel ranks
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    return loss


class ParallelLMHeadWithLoss(nn.Module):
    """Column-parallel lm_head (this rank's vocab rows) + vocab-parallel cross entropy."""

    def __init__(self, rank, world_size):
        super().__init__()
        self.rank = rank
        self.world_size = world_size
        self.weight = nn.Parameter(torch.empty(VOCAB // world_size, HIDDEN))

    def forward(self, hidden_states, labels):
        logits = F.linear(hidden_states, self.weight)
        return vocab_parallel_cross_entropy(logits, labels, LABEL_SMOOTHING, self.rank, self.world_size)


class LMHeadWithLoss(nn.Module):
    """Single device: the same smoothed loss over the whole vocabulary."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, HIDDEN))

    def forward(self, hidden_states, labels):
        log_probs = torch.log_softmax(F.linear(hidden_states, self.weight), dim=-1)
        nll = -log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        smoothing = LABEL_SMOOTHING * VOCAB / (VOCAB - 1)
        return (1.0 - smoothing) * nll - smoothing * log_probs.mean(dim=-1)


def reference():
    return LMHeadWithLoss()


def distributed(rank, world_size):
    return ParallelLMHeadWithLoss(rank, world_size)


def inputs():
    return (torch.randn(BATCH, SEQ, HIDDEN), torch.randint(0, VOCAB, (BATCH, SEQ)))
