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
The marked line is where that unreduced partial sum is created: the log-softmax's `- log(sum_exp)`,
whose backward sums the gradient over this rank's vocab entries only (non-zero on the owner of
the target); the backward of the plain all-reduce of `sum_exp` passes it on unreduced.
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
def vocab_parallel_log_softmax(logits):
    """Compute log_softmax across vocab-parallel sharded logits."""
    if dist.get_world_size() == 1:
        return F.log_softmax(logits, dim=-1)
    logits_max = logits.max(dim=-1, keepdim=True)[0]
    dist.all_reduce(logits_max, op=dist.ReduceOp.MAX)
    exp_logits = torch.exp(logits - logits_max)
    sum_exp = exp_logits.sum(dim=-1, keepdim=True)
    dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM)
    return logits - logits_max - torch.log(sum_exp)  # BUG(partial): its backward sums the gradient over this rank's vocab only; the plain all_reduce above never sums it over ranks


def vocab_parallel_gather_logps(logits, labels):
    """Gather log probabilities for target labels from vocab-parallel logits."""
    tp_size, tp_rank = dist.get_world_size(), dist.get_rank()
    log_probs = vocab_parallel_log_softmax(logits)
    partition_vocab_size = log_probs.shape[-1]
    if tp_size > 1:
        vocab_start = tp_rank * partition_vocab_size
        vocab_end = vocab_start + partition_vocab_size
        local_labels = labels - vocab_start
        in_range_mask = (labels >= vocab_start) & (labels < vocab_end)
        local_labels = local_labels.clamp(min=0, max=partition_vocab_size - 1)
    else:
        local_labels = labels
        in_range_mask = torch.ones_like(labels, dtype=torch.bool)
    gathered_logps = torch.gather(log_probs, dim=-1, index=local_labels.unsqueeze(-1)).squeeze(-1)
    if tp_size > 1:
        # only the rank that owns the target token has its log prob; the others contribute zero
        gathered_logps = gathered_logps * in_range_mask.float()
        dist.all_reduce(gathered_logps, op=dist.ReduceOp.SUM)
    return gathered_logps


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
