"""moe-split-mismatch: expert-parallel dispatch whose receivers expect the split sizes they send.

Origin: hand-written expert-parallel token dispatchers (DeepSpeed-MoE, Megatron's alltoall
dispatcher, fairseq's hash layers) pass `all_to_all_single` an `output_split_sizes` list that must be
what every other rank's `input_split_sizes` sends this rank: the counts exchanged from the other
ranks, not this rank's own. Here tokens are routed by a fixed hash of their position (hash
layers): rank r sends each rank the tokens whose expert lives there, sorted by destination. The
buggy twin passes its own send counts as its receive counts, right only when routing is symmetric;
this routing is not, so rank 0 waits for fewer rows from rank 1 than rank 1 sends it: a real run
fails or reads the wrong rows. At world size 1 the lists coincide.
"""

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

HIDDEN = 8
EXPERTS = 8
TOKENS = 16  # in all, split over the ranks

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
OUTPUT = ("shard", 0)


def expert_of(position):
    """The hash: every token's expert by its position (three of four tokens go to the first half)."""
    return (position * 3) % (EXPERTS // 2) if position % 4 else EXPERTS // 2 + position % (EXPERTS // 2)


class MoE(nn.Module):
    def __init__(self, rank=0, world_size=1):
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.local = EXPERTS // world_size
        self.experts = nn.ModuleDict({str(e): nn.Linear(HIDDEN, HIDDEN, bias=False)
                                      for e in range(rank * self.local, (rank + 1) * self.local)})

    def owner(self, position):
        return expert_of(position) // self.local

    def forward(self, x):
        n, count = self.world_size, x.shape[0]
        positions = [self.rank * count + i for i in range(count)]
        order = sorted(range(count), key=lambda i: expert_of(positions[i]))  # by expert, so by destination rank
        input_splits = [sum(self.owner(p) == dest for p in positions) for dest in range(n)]
        sent_here = [sorted(expert_of(p) for p in range(j * count, (j + 1) * count) if self.owner(p) == self.rank)
                     for j in range(n)]  # the experts of the rows each rank sends here, in its order
        output_splits = [len(experts) for experts in sent_here]  # what each rank sends here
        sent = torch.cat([x[i : i + 1] for i in order])
        received = funcol.all_to_all_single(sent, input_splits, input_splits, dist.group.WORLD)  # BUG(mismatched): its own send counts as receive counts
        pieces, start = [], 0
        for experts in sent_here:  # each rank's rows, expert after expert
            for name, expert in self.experts.items():
                rows = experts.count(int(name))
                if rows:
                    pieces.append(expert(received[start : start + rows]))
                    start += rows
        out = torch.cat(pieces) if pieces else received  # a rank none of whose experts is chosen: no rows
        back = funcol.all_to_all_single(out, input_splits, output_splits, dist.group.WORLD)
        return torch.cat([back[order.index(i) : order.index(i) + 1] for i in range(count)])


def reference():
    return MoE()


def distributed(rank, world_size):
    return MoE(rank, world_size)


def inputs():
    return (torch.randn(TOKENS, HIDDEN),)


def shard_input(index, full, rank, world_size):
    return full.chunk(world_size)[rank]


def shard_state(ref_state, rank, world_size):
    local = EXPERTS // world_size
    return {k: v for k, v in ref_state.items() if int(k.split(".")[1]) in range(rank * local, (rank + 1) * local)}
