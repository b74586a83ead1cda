"""torchtitan's decoders as cases, parallelised by torchtitan itself.

`torchtitan_case(config, world_size)` takes a model config (`Llama3Model.Config`,
`Qwen3Model.Config`, ...) whose sharding configs are set the way torchtitan's
`update_from_config` sets them (`set_llama3_sharding_config(config, enable_sp=...)`; `tiny_config`
makes such configs), and builds:
- the reference: `config.build()`, one device;
- each rank: `config.build()` then `Module.parallelize(parallel_dims)` on a tensor-parallel mesh
  of the world size, torchtitan's `spmd_types` backend (local tensors, typed collectives), run
  under torchtitan's own SPMD context (`get_spmd_context`); the embedding tied to the head again
  where the config ties them, as the trainer's `init_states` does after `parallelize`;
- the checkpoint loader: each state tensor cut by `spmd_distribute_tensor` with the layout the
  module's sharding config declares, the function `parallelize` cuts it with;
- the inputs the trainer gives a decoder: token ids and their positions, with the attention masks
  torchtitan builds from them (`get_attention_masks`) where the attention takes masks.

In training mode (`mode="train"`) the loss is torchtitan's cross entropy summed over the tokens and
divided by their count, as its trainer normalises it; on the ranks the same function takes its
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
from typing import Any

import spmd_types as spmd
import torch
import torch.distributed as dist
import torchtitan.distributed.parallel_dims as parallel_dims_module
import torchtitan.distributed.spmd_types as spmd_helpers
from spmd_types.types import normalize_axis
from torch.nn.attention import SDPBackend
from torchtitan.components.loss import cross_entropy_loss
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.parallel_dims import MeshAxisName
from torchtitan.distributed.utils import get_spmd_context
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention
from torchtitan.protocols.module import Module

from shardproof.case import Case
from shardproof.errors import CaseError

TP = MeshAxisName.TP.value


def torchtitan_case(config: Any, world_size: int = 2, *, mode: str = "forward", batch: int = 2, seq_len: int = 16) -> Case:
    """The case of a torchtitan decoder config (see the module docstring): `batch` sequences of
    `seq_len` tokens; `mode` "forward" or "train"."""
    built = threading.local()  # the rank model each thread built last: its loader runs next, on that thread

    def reference() -> torch.nn.Module:
        return Decoding(_built(config))

    def distributed(rank: int, world_size: int) -> torch.nn.Module:
        _check_divides(config, world_size)
        dims = _parallel_dims(world_size)
        model = _built(config)
        model.parallelize(dims)
        if config.enable_weight_tying:
            model.tok_embeddings.weight = model.lm_head.weight
        built.model = Decoding(model, dims)
        return built.model

    def inputs() -> tuple:
        tokens = torch.arange(batch * seq_len).mul(7).remainder(config.vocab_size).view(batch, seq_len)
        positions = torch.arange(seq_len).repeat(batch, 1)
        if mode == "forward":
            return tokens, positions
        return tokens, positions, tokens.roll(-1, dims=1)  # labels last: the next tokens

    def shard_state(ref_state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
        model = built.model
        cut: dict[int, torch.Tensor] = {}  # a tied weight (embedding and head) is cut once, one tensor
        return {name: cut.setdefault(id(t), _local_shard(model, name, t)) for name, t in ref_state.items()}

    training = mode != "forward"
    return Case(
        reference,
        distributed,
        inputs,
        world_size=world_size,
        shard_state=shard_state,
        output=_output_layout(config),
        loss=_loss if training else None,
        distributed_step=functools.partial(_step, config.vocab_size) if training else None,
        mode=mode,
    )


def tiny_config(model: str, *, sequence_parallel: bool = False, attention: str = "flex", layers: int = 2) -> Any:
    """A tiny config of torchtitan's `model` ("llama3" or "qwen3") built by its own config builders
    with its debug flavor's choices (llama3: fused wqkv, complex RoPE with llama scaling; qwen3:
    fused wqkv, qk norms, cos/sin RoPE, tied embeddings), GQA, and its sharding set as
    `update_from_config` sets it. Head counts divide world sizes 2, 4 and 8. `attention`: "flex"
    (the default; its backward refuses the CPU) or "sdpa" (torchtitan's
    `ScaledDotProductAttention`, causal)."""
    dim, heads, kv_heads, hidden, vocab = 64, 16, 8, 128, 32  # 32 ids: the inputs hold each one
    if model == "llama3":
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        config = Llama3Model.Config(
            dim=dim, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
            norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=vocab),
            layers=_build_llama3_layers(
                n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden, attn_backend="flex",
                rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000, scaling="llama"),
            ),
        )
        shard = functools.partial(set_llama3_sharding_config, enable_sp=sequence_parallel)
    elif model == "qwen3":
        from torchtitan.models.common import CosSinRoPE, Embedding, Linear, RMSNorm
        from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_layers
        from torchtitan.models.qwen3.sharding import set_qwen3_sharding_config

        head_dim = 8
        config = Qwen3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=True, norm=RMSNorm.Config(normalized_shape=dim, eps=1e-6),
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
            lm_head=Linear.Config(in_features=dim, out_features=vocab),
            layers=_build_qwen3_layers(
                n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim, hidden_dim=hidden,
                attn_backend="flex", rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=64, theta=1000000.0),
            ),
        )
        shard = functools.partial(set_qwen3_sharding_config, enable_sp=sequence_parallel, enable_ep=False)
    else:
        raise CaseError(f"tiny_config knows llama3 and qwen3, not {model!r}")
    if attention == "sdpa":
        for layer in config.layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
    shard(config)
    return config


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
    group = model.dims.get_mesh(TP).get_group()
    for param in model.parameters():
        if param.grad is not None and spmd.get_local_type(param).get(normalize_axis(group)) is spmd.R:
            dist.all_reduce(param.grad, group=group)
    return loss


def _built(config: Any) -> torch.nn.Module:
    """`config.build()`, its SDPA attentions set to torch's math path (`sdpa_backends`, torchtitan's
    own choice of kernels): the CPU's fused kernel and its backward are one op over all the heads,
    which no rule relates to a rank's share of them; the math path is the same function in matmuls."""
    model = config.build()
    for module in model.modules():
        if isinstance(module, ScaledDotProductAttention):
            module.sdpa_backends = [SDPBackend.MATH]
    return model


def _takes_masks(config: Any) -> bool:
    """Attention masks are built for the attentions that take them, as torchtitan's trainer does."""
    attention = config.first_attention
    return attention is not None and isinstance(attention.inner_attention, (FlexAttention.Config, VarlenAttention.Config))


def _output_layout(config: Any) -> tuple:
    """Logits sharded along the vocabulary where the head's sharding config leaves them so (loss
    parallel), else replicated."""
    sharding = config.lm_head.sharding_config
    layout = (sharding.out_dst_shardings or sharding.out_src_shardings) if sharding is not None else None
    tp_type = layout.per_axis_spmd_types().get(MeshAxisName.TP) if layout is not None else None
    return ("shard", 2) if isinstance(tp_type, spmd.Shard) else ("replicate",)


def _check_divides(config: Any, world_size: int) -> None:
    """What torchtitan's `update_from_config` checks: the tensor-parallel degree divides the heads."""
    attention = config.first_attention
    heads = {"n_heads": attention.n_heads, "n_kv_heads": getattr(attention, "n_kv_heads", None) or attention.n_heads}
    wrong = [f"{name}={count}" for name, count in heads.items() if count % world_size]
    if wrong:
        raise CaseError(f"torchtitan needs the tensor-parallel degree {world_size} to divide {', '.join(wrong)}")


def _parallel_dims(world_size: int) -> ParallelDims:
    parallel_dims_module.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, world_size=world_size)
    dims.build_mesh()
    return dims


def _local_shard(model: Decoding, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The rank's part of a reference state tensor, cut as `Module.parallelize` cuts it: by
    `spmd_distribute_tensor` with the owning module's declared layout on the mesh of its axes."""
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    sharding = owner._sharding_config if isinstance(owner, Module) else None
    layout = sharding.state_shardings.get(attr) if sharding is not None else None
    if layout is None:
        return tensor
    mesh = model.dims.get_optional_mesh([axis.value for axis in layout.axes()], include_singleton_axes=True)
    return spmd_helpers.spmd_distribute_tensor(tensor, mesh, layout)  # looked up now, as torchtitan calls it
