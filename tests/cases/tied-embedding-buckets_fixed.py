"""tied-embedding-buckets: the tied embedding's gradient all-reduced between the first and last
pipeline stage after the distributed optimizer's reduce-scatter, which left each copy reduced on
another data-parallel rank.

Origin: Megatron-LM daf0006 (issue #844). With `use_distributed_optimizer` and
`share_embeddings_and_output_weights`, `finalize_model_grads` reduce-scattered every stage's
contiguous gradient buffer over the data-parallel group before `_allreduce_word_embedding_grads`
summed the word embedding's `main_grad` over the first and last stage. The embedding is the first
weight of the first stage's buffer, the output layer the last of the last stage's, so their
reduced shards live on different data-parallel ranks: the all-reduce adds a reduced copy to a
local, unreduced one, and the rank owning the embedding's shard updates it with that. The fix
all-reduces the embedding gradients first, then reduce-scatters.

Two stages (one pipeline at 2 ranks; at 4 and 8, two and four data-parallel pipelines) of a tiny
language model whose output layer is the embedding's weight transposed, 2 microbatches, the
gradients in one flat `main_grad` buffer per stage (padded to the data-parallel size), the
distributed optimizer's SGD on each rank's shard and the updated shards all-gathered back
(`MODE = "step"`). Marked: the embedding all-reduce after the reduce-scatter.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, HIDDEN, LAYERS, BATCH, MICROBATCHES, LR = 8, 4, 4, 8, 2, 0.1

WORLD_SIZE = 2
BUG_WORLD_SIZE = 4
MODE = "step"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class GPTModel(nn.Module):
    """The layers `layers`; the embedding on the first stage (pre_process), the output layer on the
    last (post_process), tied to the embedding where one stage holds both."""

    def __init__(self, layers=range(LAYERS), pre_process=True, post_process=True):
        super().__init__()
        self.pre_process, self.post_process = pre_process, post_process
        self.embedding = nn.Embedding(VOCAB, HIDDEN) if pre_process else None
        self.layers = nn.ModuleDict({str(i): Block() for i in layers})
        self.output_layer = nn.Linear(HIDDEN, VOCAB, bias=False) if post_process else None
        if pre_process and post_process:
            self.output_layer.weight = self.embedding.weight

    def shared_embedding_or_output_weight(self):
        return self.embedding.weight if self.pre_process else self.output_layer.weight

    def forward(self, x, *targets):
        if self.pre_process:
            x = self.embedding(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.output_layer(x) if self.post_process else x


def _groups(rank, world_size):
    """(data-parallel group, embedding group): rank r is stage r % 2 of pipeline r // 2."""
    stages = min(2, world_size)
    data_parallel = embedding = None
    for stage in range(stages):
        group = dist.new_group(list(range(stage, world_size, stages)))
        data_parallel = group if rank % stages == stage else data_parallel
    for first in range(0, world_size, stages) if stages > 1 else ():
        group = dist.new_group([first, first + 1])
        embedding = group if rank in (first, first + 1) else embedding
    return data_parallel, embedding


def reference():
    return GPTModel()


def distributed(rank, world_size):
    stages = min(2, world_size)
    stage, per_stage = rank % stages, LAYERS // stages
    model = GPTModel(range(stage * per_stage, (stage + 1) * per_stage), stage == 0, stage == stages - 1)
    model.data_parallel, model.embedding_group = _groups(rank, world_size)
    return model


def inputs():
    return torch.randint(0, VOCAB, (BATCH,)), torch.randn(BATCH, VOCAB)


def shard_input(index, full, rank, world_size):
    return full.chunk(max(1, world_size // 2))[rank // 2]


def loss(logits, tokens, teacher_logits):
    return F.mse_loss(logits, teacher_logits)


def optimizer(params):
    return torch.optim.SGD(params, lr=LR)


class DistributedOptimizer:
    """SGD on this rank's shard of the stage's flat gradient buffer (Megatron's `param_and_grad_buffer`)."""

    def __init__(self, model):
        self.model, self.params = model, list(model.parameters())
        self.group, self.size = model.data_parallel, dist.get_world_size(model.data_parallel)
        numel = sum(p.numel() for p in self.params)
        self.padded = -(-numel // self.size) * self.size
        self.shard = self.padded // self.size
        self.start = dist.get_rank(self.group) * self.shard
        self.grad_data = torch.zeros(self.padded)
        offset = 0
        for p in self.params:
            p.main_grad = self.grad_data[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def reduce_scatter_grads(self):
        """Each rank's shard of the buffer becomes the data-parallel mean (the rest stays local)."""
        local = self.grad_data[self.start : self.start + self.shard]
        dist.reduce_scatter_tensor(local, self.grad_data, op=dist.ReduceOp.AVG, group=self.group)

    def step(self):
        flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        flat = F.pad(flat, (0, self.padded - flat.numel()))
        updated = flat[self.start : self.start + self.shard] - LR * self.grad_data[self.start : self.start + self.shard]
        gathered = torch.empty(self.padded)
        dist.all_gather_into_tensor(gathered, updated, group=self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(gathered[offset : offset + p.numel()].view_as(p))
                p.grad = None  # the optimizer read the buffer's shard, not .grad
                offset += p.numel()


def finalize_model_grads(model, optimizer):
    if model.embedding_group is not None:  # _allreduce_word_embedding_grads
        dist.all_reduce(model.shared_embedding_or_output_weight().main_grad, group=model.embedding_group)  # FIX: both copies summed before the reduce-scatter
    optimizer.reduce_scatter_grads()


def distributed_step(model, inputs, rank, world_size):
    tokens, teacher_logits = inputs
    stages = min(2, world_size)
    first, last = rank % stages == 0, rank % stages == stages - 1
    optimizer = DistributedOptimizer(model)
    received, outputs, total = [], [], None
    microbatches = zip(tokens.chunk(MICROBATCHES), teacher_logits.chunk(MICROBATCHES))
    for tokens_mb, teacher_mb in microbatches:  # GPipe: every forward, then every backward
        x = tokens_mb
        if not first:
            x = torch.empty(tokens_mb.shape[0], HIDDEN)
            dist.recv(x, rank - 1)
            x.requires_grad_()
        out = model(x)
        if last:
            out = loss(out, None, teacher_mb) / MICROBATCHES
            total = out.detach() if total is None else total + out.detach()
        else:
            dist.send(out.detach(), rank + 1)
        received.append(x)
        outputs.append(out)
    for x, out in zip(received, outputs):
        if last:
            out.backward()
        else:
            grad = torch.empty_like(out)
            dist.recv(grad, rank + 1)
            out.backward(grad)
        if not first:
            dist.send(x.grad, rank - 1)
    for p in model.parameters():
        p.main_grad.add_(p.grad)
    finalize_model_grads(model, optimizer)
    optimizer.step()
    if total is not None and model.data_parallel is not None:
        dist.all_reduce(total, op=dist.ReduceOp.AVG, group=model.data_parallel)
    return total
