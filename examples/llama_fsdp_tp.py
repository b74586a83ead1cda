"""Case: the DTensor Llama with FSDP2 over tensor parallelism on a 2-D mesh (torchtitan's 2-D).

The mesh is `init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))`, `TP` ranks per
tensor-parallel group (world size / TP data-parallel groups). Each rank's model is
examples/llama_dtensor.py's Llama, tensor parallel over `mesh["tp"]` by its `parallelize_module`
plan, then `fully_shard` over `mesh["dp"]` on every decoder layer and the root. FSDP2 shards each
parameter's local tensor on dim 0 once more: a weight TP already cut on dim 0 (ColwiseParallel) is
then `(_StridedShard(0, sf=tp), Shard(0))` on the 2-D mesh (rows of the TP shard, read right to
left), one TP cut on dim 1 `(Shard(0), Shard(1))`, a replicated norm weight `Shard(0)` over dp.
Nothing is cut by hand: the default loader cuts each parameter by those placements, and the rank's
step is `loss.backward()` (FSDP2 reduce-scatters over dp with the average, DTensor reduces over tp).

Each data-parallel group reads its chunk of the batch; the reference is the same Llama on one device
and the whole batch. A training step (`MODE = "train"`) proves the loss (the mean over ranks) and
every rank's gradient shard of every parameter, at 1x2, 2x2, 4x2 and 2x4 (`TP = 4`). A forward
alone (`MODE = "forward"`) is claimed where one data-parallel group reads the whole batch (dp = 1):
with more, a rank's output is its group's chunk of the reference's, a layout `OUTPUT` cannot state.
TP must divide the kv heads: llama_dtensor.py's replicated kv projections (fewer kv heads than TP
ranks) compute the right forward but the wrong gradients (shardproof finds it: each TP rank's
gradient of them covers only the kv head it uses).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from llama_dtensor import Llama, parallelize
from llama_reference import PRESETS as LLAMA_PRESETS
from llama_reference import SMALL, token_inputs

CONFIG = replace(SMALL, batch=8, n_kv_heads=4)  # two sequences per data-parallel group up to 4 groups
PRESETS = {name: replace(config, batch=8) for name, config in LLAMA_PRESETS.items()}
WORLD_SIZE = 4
TP = 2  # ranks per tensor-parallel group (1 at world size 1)
MODE = "train"


class DistilledLlama(Llama):
    """The Llama; the teacher logits are an input of the loss only."""

    def forward(self, input_ids: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(input_ids)


def mesh_shape(world_size: int) -> tuple[int, int]:
    """(dp, tp)."""
    tp = min(TP, world_size)
    if world_size % tp or CONFIG.batch % (world_size // tp):
        raise ValueError(f"world_size={world_size} does not split into tp={tp} and a dp dividing batch={CONFIG.batch}")
    if CONFIG.n_kv_heads % tp:  # replicated kv projections train wrong (see above)
        raise ValueError(f"n_kv_heads={CONFIG.n_kv_heads} is not divisible by tp={tp}")
    return world_size // tp, tp


def reference() -> nn.Module:
    return DistilledLlama(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    dp, tp = mesh_shape(world_size)
    with unset_fake_temporarily():  # DeviceMesh reads its rank map with .tolist(): see llama_dtensor.py
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
    model = parallelize(DistilledLlama(CONFIG), CONFIG, rank % tp, tp, mesh["tp"])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def inputs() -> tuple:
    (tokens,) = token_inputs(CONFIG)
    return tokens, torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.vocab)  # token ids, teacher logits


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Data-parallel group `rank // tp` reads its chunk of the batch; its TP ranks read the same."""
    dp, tp = mesh_shape(world_size)
    return full.chunk(dp)[rank // tp]


def loss(logits: torch.Tensor, tokens: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Logit distillation: the mean squared error against a teacher's logits over this rank's batch."""
    return F.mse_loss(logits, teacher_logits)


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    step_loss = loss(model(*inputs), *inputs)
    step_loss.backward()  # FSDP2's post-backward hooks reduce-scatter the gradients over dp
    return step_loss
