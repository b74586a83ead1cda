"""Case: a Llama decoder trained with pipeline parallelism (1F1B, 8 microbatches), data parallel over
pipeline replicas when there are more ranks than stages.

Reference (examples/llama_reference.py) trained on a logit-distillation loss (the mean squared
error against a teacher's logits).

Distributed: S = min(MAX_STAGES, world size) stages per pipeline, world size / S pipelines. Rank r
is stage r % S of pipeline r // S and holds, under their reference names, its consecutive layers
(`layers.<i>.*`, a ModuleDict as torchtitan keeps them), the first stage the embedding too, the last
the final norm and lm_head; with CHUNKS > 1 (SCHEDULE = "interleaved") the layers are cut into S *
CHUNKS virtual stages, rank r of a pipeline running stages r, r + S, ... Each pipeline reads its
chunk of the batch (`shard_input`) and runs it as MICROBATCHES microbatches through the SCHEDULE
of pipeline_schedules.py (1F1B by default): activations are sent forward and gradients backward with
`dist.send` / `dist.recv` between the ranks of the pipeline; the last stage's loss of a microbatch
is its mean squared error divided by the number of microbatches. The gradients are then averaged
over the pipelines (an all-reduce over each stage's data-parallel group). With TIED, lm_head shares
the embedding's weight (as Llama 3.2's small models do): the first and last stage each hold a copy
and add their gradients by an all-reduce over the two (Megatron's embedding group). Claimed: the
mean of the last stages' losses is the reference's loss, and every stage's gradients are the
reference's gradients of its layers.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from llama_reference import PRESETS as LLAMA_PRESETS
from llama_reference import DecoderLayer, LlamaConfig, LlamaReference, RMSNorm, token_inputs
from pipeline_schedules import SCHEDULES, StageRun

CONFIG = LlamaConfig(vocab=64, hidden=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, ffn=64, seq=4, batch=16)
PRESETS = {name: replace(config, batch=16) for name, config in LLAMA_PRESETS.items()}
MAX_STAGES = 4
MICROBATCHES = 8
SCHEDULE = "1f1b"
TIED = False
CHUNKS = 1  # virtual stages per rank, for SCHEDULE = "interleaved"
WORLD_SIZE = 4
MODE = "train"


def _layout(world_size: int) -> tuple[int, int]:
    """(stages per pipeline, pipelines)."""
    stages = min(MAX_STAGES, world_size)
    pipelines = world_size // stages
    problems = [f"{what} does not divide" for what, whole, part in (
        (f"world size {world_size} into pipelines of {stages} stages", world_size, stages),
        (f"{CONFIG.n_layers} layers into {stages * _chunks(stages)} stages", CONFIG.n_layers, stages * _chunks(stages)),
        (f"a batch of {CONFIG.batch} into {pipelines} x {MICROBATCHES} microbatches", CONFIG.batch, pipelines * MICROBATCHES),
    ) if whole % part]
    if problems:
        raise ValueError("; ".join(problems))
    return stages, pipelines


def _chunks(stages: int) -> int:
    """CHUNKS virtual stages per rank; a pipeline of one rank, whose stages would message itself, runs one."""
    return CHUNKS if stages > 1 else 1


def _stage_layers(rank: int, world_size: int) -> list[range]:
    """The layers of each (virtual) stage this rank runs, in order: stages r, r + S, ... of its pipeline."""
    stages, _ = _layout(world_size)
    virtual = stages * _chunks(stages)
    per_stage = CONFIG.n_layers // virtual
    return [range(s * per_stage, (s + 1) * per_stage) for s in range(rank % stages, virtual, stages)]


class LlamaLM(LlamaReference):
    """The reference, called with the teacher's logits too (it ignores them)."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config)
        if TIED:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids)


class LlamaStage(nn.Module):
    """Layers `layers` of the reference; the embedding on the first stage, the norm and lm_head on the last."""

    def __init__(self, config: LlamaConfig, layers: list[int], first: bool, last: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config) for i in layers})
        self.norm = RMSNorm(config.hidden, config.norm_eps) if last else None
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False) if last else None
        if TIED and first and last:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return self.run(x, list(self.layers), self.embed_tokens is not None, self.lm_head is not None)

    def run(self, x: torch.Tensor, layers: list[str], embed: bool, head: bool) -> torch.Tensor:
        """One stage: the embedding if `embed`, layers `layers` (keys of self.layers), the head if `head`."""
        if embed:
            x = self.embed_tokens(x)
        for key in layers:
            x = self.layers[key](x)
        return self.lm_head(self.norm(x)) if head else x


def reference() -> nn.Module:
    return LlamaLM(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    stages, _ = _layout(world_size)
    stage = rank % stages
    layers = [i for chunk in _stage_layers(rank, world_size) for i in chunk]
    model = LlamaStage(CONFIG, layers, stage == 0, stage == stages - 1)
    model.data_parallel = _data_parallel_group(rank, world_size, stages)
    model.embedding_group = _embedding_group(rank, world_size, stages)
    return model


def _data_parallel_group(rank: int, world_size: int, stages: int) -> dist.ProcessGroup | None:
    """The ranks holding this rank's stage in every pipeline (made on every rank, in one order)."""
    if world_size == stages:
        return None
    mine = None
    for stage in range(stages):
        group = dist.new_group(list(range(stage, world_size, stages)))
        mine = group if stage == rank % stages else mine
    return mine


def _embedding_group(rank: int, world_size: int, stages: int) -> dist.ProcessGroup | None:
    """With TIED and several stages, the first and last stage of this rank's pipeline (made on every
    rank, in one order); None on the other stages."""
    if not TIED or stages == 1:
        return None
    mine = None
    for first in range(0, world_size, stages):
        group = dist.new_group([first, first + stages - 1])
        mine = group if rank in (first, first + stages - 1) else mine
    return mine


def inputs() -> tuple:
    (tokens,) = token_inputs(CONFIG)
    return tokens, torch.randn(CONFIG.batch, CONFIG.seq, CONFIG.vocab)  # token ids, teacher logits


def shard_input(index: int, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Pipeline p reads chunk p of the batch."""
    stages, pipelines = _layout(world_size)
    return full.chunk(pipelines)[rank // stages]


def loss(logits: torch.Tensor, tokens: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Logit distillation (as examples/llama_sp_train.py): the mean squared error against a teacher's
    logits. A microbatch's mean divided by the number of microbatches sums to the batch's mean."""
    return F.mse_loss(logits, teacher_logits)


def distributed_step(model: nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor | None:
    """This rank's stages run by the schedule over its pipeline's microbatches, then the data-parallel average."""
    tokens, teacher_logits = inputs
    stages, _ = _layout(world_size)
    stage, first_rank, virtual = rank % stages, rank - rank % stages, stages * _chunks(stages)
    size = tokens.shape[0] // MICROBATCHES
    runs = [StageRun(partial(model.run, layers=[str(i) for i in layers], embed=s == 0, head=s == virtual - 1), s, virtual,
                     list(tokens.split(size)), list(teacher_logits.split(size)), lambda i: (size, CONFIG.seq, CONFIG.hidden),
                     lambda logits, y: loss(logits, None, y), first_rank, ranks=stages)
            for s, layers in zip(range(stage, virtual, stages), _stage_layers(rank, world_size))]
    SCHEDULES[SCHEDULE](runs, MICROBATCHES)
    total = runs[-1].total
    if model.embedding_group is not None:  # the tied weight's two copies: each gets the sum of both gradients
        tied = model.embed_tokens if stage == 0 else model.lm_head
        dist.all_reduce(tied.weight.grad, group=model.embedding_group)
    if model.data_parallel is not None:
        for param in model.parameters():
            dist.all_reduce(param.grad, op=dist.ReduceOp.AVG, group=model.data_parallel)
        if total is not None:
            dist.all_reduce(total, op=dist.ReduceOp.AVG, group=model.data_parallel)
    return total
