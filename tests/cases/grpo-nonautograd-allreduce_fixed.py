"""grpo-nonautograd-allreduce: per-token log-probs from vocab-parallel logits, all-reduced with
plain `torch.distributed.all_reduce`, so the backward never crosses ranks.

Origin: ms-swift #9947 (Megatron GRPO). The lm head is vocab-parallel: each rank holds the logits
of its vocab rows. `vocab_parallel_log_softmax` all-reduces the row max and the sum of exps, and
`vocab_parallel_gather_logps` picks the target token's log-prob on the rank that owns it, zeroes
it elsewhere and all-reduces. The forward is right. But `dist.all_reduce` is not an autograd op:
in the backward it passes each rank's own gradient through. The gradient reaching the sum of exps
is non-zero only on the rank that owns the target token, and nothing sums it over ranks, so the
other ranks' vocab rows lose their softmax gradient. The fix uses Megatron's
`vocab_parallel_cross_entropy`, whose custom backward gives every shard its softmax gradient.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HIDDEN, VOCAB = 8, 16
BATCH, SEQ = 2, 3

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


# --- swift/megatron/trainers/vocab_parallel_utils.py ----------------------------------------------
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """megatron/core/tensor_parallel/cross_entropy.py: the loss of vocab-parallel logits, with a
    backward that gives every shard its softmax gradient and the target's owner its -1."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target):
        logits_max = torch.max(vocab_parallel_logits, dim=-1)[0]
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
        vocab_parallel_logits = vocab_parallel_logits - logits_max.unsqueeze(dim=-1)
        partition_vocab_size = vocab_parallel_logits.size()[-1]
        vocab_start_index = dist.get_rank() * partition_vocab_size
        vocab_end_index = vocab_start_index + partition_vocab_size
        target_mask = (target < vocab_start_index) | (target >= vocab_end_index)
        masked_target = target.clone() - vocab_start_index
        masked_target[target_mask] = 0
        logits_2d = vocab_parallel_logits.view(-1, partition_vocab_size)
        masked_target_1d = masked_target.view(-1)
        arange_1d = torch.arange(start=0, end=logits_2d.size()[0], device=logits_2d.device)
        predicted_logits_1d = logits_2d[arange_1d, masked_target_1d]
        predicted_logits = predicted_logits_1d.clone().contiguous().view_as(target)
        predicted_logits[target_mask] = 0.0
        dist.all_reduce(predicted_logits)
        exp_logits = torch.exp(vocab_parallel_logits)
        sum_exp_logits = exp_logits.sum(dim=-1)
        dist.all_reduce(sum_exp_logits)
        loss = torch.log(sum_exp_logits) - predicted_logits
        exp_logits = exp_logits / sum_exp_logits.unsqueeze(dim=-1)
        ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, target_mask, masked_target_1d = ctx.saved_tensors
        grad_input = softmax.clone()
        partition_vocab_size = softmax.size()[-1]
        grad_2d = grad_input.view(-1, partition_vocab_size)
        arange_1d = torch.arange(start=0, end=grad_2d.size()[0], device=grad_2d.device)
        softmax_update = 1.0 - target_mask.view(-1).float()
        grad_2d[arange_1d, masked_target_1d] -= softmax_update
        return grad_input * grad_output.unsqueeze(dim=-1), None


def vocab_parallel_gather_logps(logits, labels):
    """Gather log probabilities for target labels from vocab-parallel logits."""
    return -_VocabParallelCrossEntropy.apply(logits, labels)  # FIX: Megatron's vocab-parallel cross entropy


class PolicyHead(nn.Module):
    """The lm head and the per-token log-probs of the sampled tokens."""

    def __init__(self, tp_size=None):
        super().__init__()
        self.vocab_parallel = tp_size is not None
        self.output_layer = nn.Linear(HIDDEN, VOCAB // (tp_size or 1), bias=False)

    def forward(self, hidden_states, labels, advantages):
        logits = self.output_layer(hidden_states)
        if not self.vocab_parallel:
            return F.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return vocab_parallel_gather_logps(logits, labels)


def reference():
    return PolicyHead()


def distributed(rank, world_size):
    return PolicyHead(world_size)


def inputs():
    labels = torch.arange(BATCH * SEQ).mul(5).remainder(VOCAB).view(BATCH, SEQ)
    return torch.randn(BATCH, SEQ, HIDDEN), labels, torch.randn(BATCH, SEQ)


def loss(per_token_logps, hidden_states, labels, advantages):
    """GRPO's policy-gradient term (on-policy, so the importance ratio is 1)."""
    return -(per_token_logps * advantages).mean()
