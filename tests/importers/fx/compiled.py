"""Write FX readable dumps of programs compiled by torch.compile, as a dump hook on AOTAutograd
writes them: `fw.g<graph>.r<rank>.py` for forward graphs, `both.g<graph>.r<rank>.py` for the joint
forward+backward graph its partitioner is given.

`python compiled.py OUT PROGRAM forward|train [BUG]` writes OUT/reference (one device) and OUT/dist
(2 ranks of the fake process group, one rank at a time). Programs: `mlp`, a tensor-parallel MLP
that torch.compile breaks into graphs at a deliberate graph break (BUG `missing_all_reduce`);
`moe`, an expert-parallel mixture of experts whose tokens are picked per expert by `nonzero`, a
data-dependent size (BUG `local_expert_id`: a rank compares the routing with its local expert ids).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from torch.testing._internal.distributed.fake_pg import FakeStore

ROWS, IN, HIDDEN, OUT, EXPERTS = 6, 4, 6, 5, 4


class AllReduce(torch.autograd.Function):
    """A row-parallel layer's output as Megatron reduces it: summed over ranks forward, passed on
    backward (every rank holds the whole gradient of the replicated output)."""

    @staticmethod
    def forward(ctx, y):
        return funcol.all_reduce(y, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


def mlp(x, w1, w2, b2, bug):
    h = torch.relu(x @ w1)
    torch._dynamo.graph_break()
    y = h @ w2
    if dist.get_world_size() > 1 and bug != "missing_all_reduce":
        y = AllReduce.apply(y)
    return y + b2


def moe(x, router, w1, w2, bug):
    """Top-1 routing; this rank's experts (w1[i], w2[i] are expert `first + i`) each run on the
    tokens routed to them, picked by `nonzero`, and add their results back at those tokens."""
    first = dist.get_rank() * w1.shape[0] if bug != "local_expert_id" else 0
    choice = (x @ router).argmax(-1)
    out = torch.zeros_like(x)
    for i in range(w1.shape[0]):
        rows = torch.nonzero(choice == first + i)[:, 0]
        out = out.index_add(0, rows, torch.relu(x[rows] @ w1[i]) @ w2[i])
    if dist.get_world_size() > 1:
        out = AllReduce.apply(out)
    return out


def arguments(program: str, ranks: int) -> list[torch.Tensor]:
    if program == "mlp":
        return [torch.randn(ROWS, IN), torch.randn(IN, HIDDEN // ranks), torch.randn(HIDDEN // ranks, OUT), torch.randn(OUT)]
    local = EXPERTS // ranks
    return [torch.randn(ROWS, IN), torch.randn(IN, EXPERTS), torch.randn(local, IN, HIDDEN), torch.randn(local, HIDDEN, IN)]


def dump(out: str, rank: int, program: str, train: bool, bug: str, ranks: int) -> None:
    """Compile and run the program once, writing each graph AOTAutograd compiles."""
    graphs = {"fw": 0, "both": 0}

    def write(kind: str, gm: torch.fx.GraphModule) -> None:
        with open(f"{out}/{kind}.g{graphs[kind]}.r{rank}.py", "w") as handle:
            handle.write(gm.print_readable(print_output=False))
        graphs[kind] += 1

    def forward(gm, inputs):  # for training, also the partitioned forward and backward: not written
        if not train:
            write("fw", gm)
        return gm

    def partition(joint, inputs, **kwargs):
        write("both", joint)
        return default_partition(joint, inputs, **kwargs)

    def loss(*args):
        return fn(*args).square().sum()

    fn = {"mlp": mlp, "moe": moe}[program]
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, inputs: gm, partition_fn=partition)
    compiled = torch.compile(loss if train else fn, backend=backend)
    args = arguments(program, ranks)
    for w in args[1:]:
        w.requires_grad_(train)
    result = compiled(*args, bug)
    if train:
        result.backward()


def main(out: str, program: str, mode: str, bug: str = "") -> None:
    torch._dynamo.config.capture_dynamic_output_shape_ops = True  # `nonzero` in the graph, its size unbacked
    for side, ranks in (("reference", 1), ("dist", 2)):
        os.makedirs(f"{out}/{side}", exist_ok=True)
        for rank in range(ranks):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
            dump(f"{out}/{side}", rank, program, mode == "train", bug, ranks)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
