"""torchtitan's decoders as cases, parallelised by torchtitan itself.

`torchtitan_case(config, world_size)` takes a model config (`Llama3Model.Config`,
`Qwen3Model.Config`, ...) whose sharding configs are set the way torchtitan's
`update_from_config` sets them (`set_llama3_sharding_config(config, enable_sp=...)`), and builds:
- the reference: `config.build()`, one device;
- each rank: `config.build()` then `Module.parallelize(parallel_dims)` on a tensor-parallel mesh
  of the world size, torchtitan's `spmd_types` backend (local tensors, typed collectives), run
  under torchtitan's own SPMD context (`get_spmd_context`);
- the checkpoint loader: each state tensor cut by `spmd_distribute_tensor` with the layout the
  module's sharding config declares, the function `parallelize` cuts it with;
- the inputs the trainer gives a decoder: token ids and their positions, with the attention masks
  torchtitan builds from them (`get_attention_masks`) where the attention needs masks.

In training mode (`mode="train"`) the loss is torchtitan's cross entropy summed over tokens and
divided by their count, as its trainer normalises it; on the ranks the same function runs its
vocab-parallel path (`_LossParallelCrossEntropy`). torchtitan's trainer always wraps the model in
FSDP, and that wrap, not `parallelize`, all-reduces over the tensor-parallel group the gradients
of the parameters spmd_types types R there (the norm weights under sequence parallelism, whose
gradient is a partial sum over the ranks' tokens). torch 2.13's `fully_shard` cannot wrap
spmd_types parameters (torch 2.14 can), so the rank's step performs that one reduction itself,
for exactly the parameters typed R on the tensor-parallel axis.

Everything runs on the CPU (shardproof's fake and threaded process groups), so torchtitan's
device type is set to "cpu" (it falls back to "cuda" on a machine without an accelerator).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import spmd_types as spmd
import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as parallel_dims_module
from torchtitan.components.loss import cross_entropy_loss
from spmd_types.types import normalize_axis
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.distributed.spmd_types import spmd_distribute_tensor
from torchtitan.distributed.utils import get_spmd_context
from torchtitan.models.common.attention import FlexAttention, VarlenAttention
from torchtitan.protocols.module import Module

from shardproof.case import Case


def torchtitan_case(
    config: Any, world_size: int = 2, *, mode: str = "forward", batch: int = 2, seq_len: int = 16
) -> Case:
    """The case of a torchtitan decoder config (see the module docstring): `batch` sequences of
    `seq_len` tokens; `mode` "forward" or "train"."""
    built = _Built()

    def reference() -> torch.nn.Module:
        return Decoding(config.build())

    def distributed(rank: int, world_size: int) -> torch.nn.Module:
        dims = _parallel_dims(world_size)
        model = config.build()
        model.parallelize(dims)
        _tie_weights(model)
        decoding = Decoding(model, dims)
        built.remember(decoding, dims)
        return decoding

    def inputs() -> tuple:
        tokens = torch.arange(batch * seq_len).mul(7).remainder(config.vocab_size).view(batch, seq_len)
        positions = torch.arange(seq_len).repeat(batch, 1)
        if mode == "forward":
            return tokens, positions
        return tokens, positions, tokens.roll(-1, dims=1)  # labels last: the next tokens

    def shard_state(ref_state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
        model, dims = built.latest()
        cut: dict[int, torch.Tensor] = {}  # a tied weight (embedding and head) is cut once, one tensor
        return {name: cut.setdefault(id(tensor), _local_shard(model, dims, name, tensor)) for name, tensor in ref_state.items()}

    return Case(
        reference,
        distributed,
        inputs,
        world_size=world_size,
        shard_state=shard_state,
        output=_output_layout(config),
        loss=_loss if mode != "forward" else None,
        distributed_step=functools.partial(_step, config.vocab_size) if mode != "forward" else None,
        mode=mode,
    )


class Decoding(torch.nn.Module):
    """A decoder run as torchtitan's trainer runs it: masks from the positions (for the attentions
    that take them), the forward inside the ranks' SPMD context."""

    def __init__(self, model: torch.nn.Module, dims: ParallelDims | None = None):
        super().__init__()
        self.model = model
        self.dims = dims

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
        masks = self.model.get_attention_masks(positions) if _takes_masks(self.model.config) else None
        with self.spmd():
            return self.model(tokens, positions, masks)

    def spmd(self) -> Any:
        return get_spmd_context(parallel_dims=self.dims)()


def _loss(logits: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss (`CrossEntropyLoss`): cross entropy summed over the tokens, divided by
    their count; the vocabulary size is the logits' where they are whole (the reference)."""
    return cross_entropy_loss(logits, labels, global_vocab_size=logits.shape[-1]) / labels.numel()


def _step(vocab_size: int, model: Decoding, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """The trainer's step: forward, the loss (vocab-parallel: the logits are a shard of the
    `vocab_size` columns), backward; then the reduction FSDP's wrap would do (module docstring)."""
    tokens, positions, labels = inputs
    with model.spmd():
        loss = cross_entropy_loss(model(*inputs), labels, global_vocab_size=vocab_size) / labels.numel()
    with spmd.no_typecheck():
        loss.backward()
    group = model.dims.get_mesh(MeshAxisName.TP.value).get_group()
    for param in model.parameters():
        if param.grad is not None and _typed_replicate_over(param, group):
            dist.all_reduce(param.grad, group=group)
    return loss


def _typed_replicate_over(param: torch.Tensor, group: dist.ProcessGroup) -> bool:
    """Whether spmd_types types the parameter R over the group: its gradient is pending a sum."""
    return spmd.get_local_type(param).get(normalize_axis(group)) is spmd.R


def _takes_masks(config: Any) -> bool:
    """Attention masks are built for the attentions that take them, as torchtitan's trainer does."""
    attention = config.first_attention
    return attention is not None and isinstance(attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config))


def _output_layout(config: Any) -> tuple:
    """Logits sharded along the vocabulary where the head's sharding config leaves them so (loss
    parallel), else replicated."""
    sharding = config.lm_head.sharding_config
    layout = sharding.out_dst_shardings or sharding.out_src_shardings if sharding is not None else None
    tp_type = layout.per_axis_spmd_types().get(MeshAxisName.TP) if layout is not None else None
    return ("shard", 2) if isinstance(tp_type, spmd.Shard) else ("replicate",)


def _parallel_dims(world_size: int) -> ParallelDims:
    parallel_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, world_size=world_size)
    dims.build_mesh()
    return dims


def _tie_weights(model: torch.nn.Module) -> None:
    """`parallelize` gives each module its own parameter; the trainer's `init_states` ties the
    embedding to the head again afterwards (`Decoder.init_states`), as here."""
    if getattr(model, "enable_weight_tying", False):
        model.tok_embeddings.weight = model.lm_head.weight


def _local_shard(model: torch.nn.Module, dims: ParallelDims, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The rank's part of a reference state tensor, cut as `Module.parallelize` cuts it: by
    `spmd_distribute_tensor` with the owning module's declared layout on the mesh of its axes."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    sharding = owner._sharding_config if isinstance(owner, Module) else None
    layout = sharding.state_shardings.get(attr) if sharding is not None else None
    if layout is None:
        return tensor
    mesh = dims.get_optional_mesh([axis.value for axis in layout.axes()], include_singleton_axes=True)
    return spmd_distribute_tensor(tensor, mesh, layout)


@dataclass
class _Built:
    """The distributed model and mesh each thread built last: the loader runs right after the model
    is built, on the same thread (capture, and every rank's thread of the numeric oracle)."""

    local: threading.local = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.local = threading.local()

    def remember(self, model: torch.nn.Module, dims: ParallelDims) -> None:
        self.local.built = (model, dims)

    def latest(self) -> tuple[torch.nn.Module, ParallelDims]:
        return self.local.built
