"""loss-parallel-chunk-grad: the chunked loss hands the decoder the lm head's input gradient
labelled Replicate() when it is a Partial(sum) over the tensor-parallel ranks.

Origin: torchtitan #3412 (`ChunkedCELoss` / `GradAccumulator` in torchtitan/components/loss.py).
The chunked loss runs the lm head and cross entropy one sequence chunk at a time on detached
hidden states, calls `backward()` per chunk and gathers each chunk's input gradient in a buffer,
then hands the buffer to the decoder's backward through an autograd Function. With a
`ColwiseParallel` lm head (loss parallel: logits sharded along the vocab) the input gradient of a
Replicate() input is a Partial(sum) over the TP ranks: each rank's matmul contracts its own vocab
slice. The buggy `GradAccumulator` wraps the buffer with the placements of the reference
activation (the hidden states, Replicate()), so the decoder's backward takes each rank's partial
slice for the whole gradient; the fix takes the placements of the chunk gradients. The lm head's
own gradient is right; every decoder weight's gradient misses the other ranks' shares.
Marked: the lm head's forward line, whose backward creates the partial sum (the fix is where the
accumulator wraps its buffer).
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

HIDDEN, FFN, VOCAB = 8, 16, 16
BATCH, SEQ = 1, 4
NUM_CHUNKS = 2

WORLD_SIZE = 2
BUG_WORLD_SIZE = 2
MODE = "train"


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def hidden_states(self, x):
        return F.rms_norm(self.w2(F.silu(self.w1(x))), (HIDDEN,))

    def forward(self, x, labels):
        return self.lm_head(self.hidden_states(x))


def reference():
    return Decoder()


def distributed(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(use_local_output=False),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    return parallelize_module(Decoder(), mesh, plan)


def inputs():
    labels = torch.arange(BATCH * SEQ).mul(5).remainder(VOCAB).view(BATCH, SEQ)
    return torch.randn(BATCH, SEQ, HIDDEN), labels


def loss(logits, x, labels):
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), reduction="sum") / labels.numel()


class GradAccumulator:
    """The chunks' input gradients, written in order into one buffer."""

    def __init__(self, reference):
        self.mesh, self.placements = reference.device_mesh, reference.placements
        self.buffer = torch.zeros_like(reference.to_local())
        self.next = 0

    def add(self, chunk_grad):
        local = chunk_grad.to_local()
        self.chunk_placements = chunk_grad.placements
        self.buffer[:, self.next:self.next + local.shape[1]] = local
        self.next += local.shape[1]

    def result(self):
        return DTensor.from_local(self.buffer, self.mesh, self.chunk_placements)  # FIX: the chunks' own placements


class DecoderOutputGradient(torch.autograd.Function):
    """The loss, with the accumulated gradient handed to the decoder's output in the backward."""

    @staticmethod
    def forward(ctx, hidden_states, accumulated_grad, total_loss):
        ctx.save_for_backward(accumulated_grad)
        return total_loss.detach()

    @staticmethod
    def backward(ctx, grad_loss):
        (accumulated_grad,) = ctx.saved_tensors
        return accumulated_grad * grad_loss, None, None


def distributed_step(model, inputs, rank, world_size):
    x, labels = inputs
    hidden_states = model.hidden_states(x)
    accumulator = GradAccumulator(hidden_states)
    total_loss = 0.0
    with loss_parallel():
        for h_chunk, label_chunk in zip(hidden_states.detach().chunk(NUM_CHUNKS, dim=1), labels.chunk(NUM_CHUNKS, dim=1)):
            h_chunk.requires_grad_(True)
            logits = model.lm_head(h_chunk)
            chunk_loss = F.cross_entropy(logits.flatten(0, 1), label_chunk.flatten(0, 1), reduction="sum") / labels.numel()
            chunk_loss.backward()
            accumulator.add(h_chunk.grad)
            total_loss = total_loss + chunk_loss.detach()
    loss_value = DecoderOutputGradient.apply(hidden_states, accumulator.result(), total_loss.full_tensor())
    loss_value.backward()
    return loss_value
