"""Write FX readable dumps of a program torch.compile breaks into two graphs, as a dump hook on
AOTAutograd writes them: `fw.g<graph>.r<rank>.py` for forward graphs, `both.g<graph>.r<rank>.py` for
the joint forward+backward graph its partitioner is given.

`python breaks.py OUT forward|train [missing_all_reduce]` writes OUT/reference (one device) and
OUT/tp (a tensor-parallel MLP on 2 ranks of the fake process group, one rank at a time).
"""

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import default_partition
from torch.testing._internal.distributed.fake_pg import FakeStore

ROWS, IN, HIDDEN, OUT = 2, 4, 6, 5


class AllReduce(torch.autograd.Function):
    """A row-parallel layer's output as Megatron reduces it: summed over ranks forward, passed on
    backward (every rank holds the whole gradient of the replicated output)."""

    @staticmethod
    def forward(ctx, y):
        return funcol.all_reduce(y, "sum", dist.group.WORLD)

    @staticmethod
    def backward(ctx, grad):
        return grad


def mlp(x, w1, w2, b2, reduce):
    h = torch.relu(x @ w1)
    torch._dynamo.graph_break()
    y = h @ w2
    if reduce:
        y = AllReduce.apply(y)
    return y + b2


def loss(x, w1, w2, b2, reduce):
    return mlp(x, w1, w2, b2, reduce).square().sum()


def dump(out: str, rank: int, train: bool, reduce: bool, ranks: int) -> None:
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

    torch._dynamo.reset()
    fn = torch.compile(loss if train else mlp, backend=aot_autograd(fw_compiler=forward, bw_compiler=lambda gm, inputs: gm, partition_fn=partition))
    weights = [torch.randn(IN, HIDDEN // ranks), torch.randn(HIDDEN // ranks, OUT), torch.randn(OUT)]
    for w in weights:
        w.requires_grad_(train)
    result = fn(torch.randn(ROWS, IN), *weights, reduce)
    if train:
        result.backward()


def main(out: str, mode: str, bug: str = "") -> None:
    import os

    for program, ranks in (("reference", 1), ("tp", 2)):
        os.makedirs(f"{out}/{program}", exist_ok=True)
        for rank in range(ranks):
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=ranks)
            dump(f"{out}/{program}", rank, mode == "train", ranks > 1 and bug != "missing_all_reduce", ranks)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
