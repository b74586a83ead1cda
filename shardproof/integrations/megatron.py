"""Megatron-Core's GPTModel as a case, parallelised by Megatron-Core itself.

`megatron_gpt_case(config, vocab_size, world_size)` takes a `TransformerConfig` and builds:
- the reference: `GPTModel` at tensor-parallel size 1, on one-rank process groups;
- each rank: `GPTModel` at tensor-parallel size `world_size` (sequence parallel as the config
  says), its process groups passed explicitly (`ProcessGroupCollection`: the tensor-parallel group
  is all ranks, the others one rank each). Megatron-Core's global `parallel_state` stays
  uninitialised: every layer takes its group from the collection, as Megatron-Core asks of new code
  ("passing tp_group will be mandatory soon"), so the numeric oracle's ranks, threads of one
  process, share no process-group state;
- the checkpoint loader: Megatron-Core's own `sharded_state_dict`, which says for each parameter
  which slice of the global (tensor-parallel size 1) tensor a rank holds, fused SwiGLU weights
  through their ShardedTensorFactory (a rank's gate and up rows, merged as its loader merges them);
- the inputs its data pipeline gives GPTModel: token ids, position ids and the causal mask; in
  training also the labels, whose per-token losses GPTModel computes with Megatron-Core's
  vocab-parallel cross entropy (the native fusion, which takes its group explicitly).

In training the loss is the mean of the per-token losses and the rank's step is Megatron's:
backward, then `finalize_model_grads`, which all-reduces over the tensor-parallel group the
gradients of the parameters marked `sequence_parallel` (the norms under sequence parallelism).
The model chunk it takes is a `GPTRun`: Megatron's DistributedDataParallel at data-parallel size 1,
whose gradient sync has no other rank to reduce with.

On a CPU-only torch (shardproof's fake and threaded process groups), Megatron-Core's run-time
buffers are made on `torch.cuda.current_device()`, which then names the CPU; the RNG tracker is its
inference tracker (the models here draw no random numbers: no dropout); its global memory buffer
(scratch space for attention scores) is set up as `initialize_model_parallel` would.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.random import initialize_rng_tracker
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig
from torch._C._distributed_c10d import FakeProcessGroup

from shardproof.case import Case
from shardproof.errors import CaseError


def megatron_gpt_case(config: TransformerConfig, vocab_size: int, world_size: int = 2, *, mode: str = "forward",
                      batch: int = 2, seq_len: int = 16) -> Case:
    """The case of a GPTModel of `config` (see the module docstring): `batch` sequences of `seq_len`
    tokens over `vocab_size` ids; `mode` "forward" or "train"."""
    built = threading.local()  # the rank model each thread built last: its loader runs next, on that thread
    reference_config = dataclasses.replace(config, tensor_model_parallel_size=1, sequence_parallel=False)

    def reference() -> torch.nn.Module:
        return GPTRun(reference_config, vocab_size, seq_len, _groups(None))

    def distributed(rank: int, world_size: int) -> torch.nn.Module:
        _check_divides(config, vocab_size, seq_len, world_size)
        rank_config = dataclasses.replace(config, tensor_model_parallel_size=world_size)
        built.model = GPTRun(rank_config, vocab_size, seq_len, _groups(dist.group.WORLD))
        return built.model

    def inputs() -> tuple:
        tokens = torch.arange(batch * seq_len).mul(7).remainder(vocab_size).view(batch, seq_len)
        positions = torch.arange(seq_len).repeat(batch, 1)
        causal = torch.ones(1, 1, seq_len, seq_len).triu(1).bool()  # True: masked out, as Megatron's pipeline makes it
        if mode == "forward":
            return tokens, positions, causal
        return tokens, positions, causal, tokens.roll(-1, dims=1)  # labels last: the next tokens

    def shard_state(ref_state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
        return _loaded(built.model, ref_state)

    training = mode != "forward"
    return Case(
        reference,
        distributed,
        inputs,
        world_size=world_size,
        shard_state=shard_state,
        output=("replicate",) if training else ("shard", 2),  # per-token losses; logits split over the vocabulary
        loss=_mean_loss if training else None,
        distributed_step=_step if training else None,
        mode=mode,
    )


def tiny_config(*, sequence_parallel: bool = False, layers: int = 2) -> TransformerConfig:
    """A tiny Llama-style GPT config: RMSNorm, SwiGLU, RoPE, GQA, no biases, no dropout; head counts
    divide world sizes 2, 4 and 8 (`megatron_gpt_case` sets the tensor-parallel size to its world
    size). Pair it with vocab_size 32 (the inputs then hold every id)."""
    return TransformerConfig(
        tensor_model_parallel_size=2,
        num_layers=layers, hidden_size=64, num_attention_heads=16, num_query_groups=8, ffn_hidden_size=128,
        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32,
        sequence_parallel=sequence_parallel, cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native",
    )


class GPTRun(torch.nn.Module):
    """A GPTModel as Megatron's training loop holds it: its model chunk, wrapped for data
    parallelism (here of size 1). Called with the model's inputs, labels last."""

    def __init__(self, config: TransformerConfig, vocab_size: int, seq_len: int, groups: ProcessGroupCollection):
        super().__init__()
        _on_this_machine()
        self.config = config
        self.groups = groups
        self.ddp_config = DistributedDataParallelConfig()
        self.module = GPTModel(config, _layer_spec(config), vocab_size=vocab_size, max_sequence_length=seq_len,
                               position_embedding_type="rope", pg_collection=groups)
        _tensors_as_buffers(self.module)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
        RotaryEmbedding.forward.cache_clear()  # its cache outlives a trace: computed again from this run's tensors
        return self.module(tokens, positions, mask, labels=labels[0] if labels else None)

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """DistributedDataParallel's gradient sync over its data-parallel group: one rank, nothing to reduce."""


def _tensors_as_buffers(model: torch.nn.Module) -> None:
    """Tensors a module keeps as plain attributes (RotaryEmbedding's `inv_freq`), registered as the
    non-persistent buffers they are: state the model reads, so they are leaves of the proof (each
    rank's a copy of the reference's) and hold their computed values in the numeric run."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                delattr(module, name)
                module.register_buffer(name, value, persistent=False)


def _mean_loss(losses: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
    """Megatron's LM loss over a batch without padding: the mean of the per-token losses."""
    return losses.float().mean()


def _step(model: GPTRun, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """Megatron's step: forward and backward, then finalize_model_grads (see the module docstring)."""
    loss = _mean_loss(model(*inputs))
    loss.backward()
    finalize_model_grads([model], pg_collection=model.groups)
    return loss


def _layer_spec(config: TransformerConfig) -> Any:
    """Megatron-Core's local layer spec. Without TransformerEngine or apex its norm (torch's, through
    WrappedTorchNorm) refuses sequence parallelism; under it the norms are torch's marked as
    Megatron's sequence-parallel norms mark their weights (FusedLayerNorm, TENorm), so that
    finalize_model_grads reduces their gradients."""
    spec = get_gpt_layer_local_spec(normalization=config.normalization)
    if not config.sequence_parallel:
        return spec
    for name in ("input_layernorm", "pre_mlp_layernorm"):
        setattr(spec.submodules, name, SequenceParallelNorm)
    return TransformerBlockSubmodules(layer_specs=[spec] * config.num_layers, layer_norm=SequenceParallelNorm)


class SequenceParallelNorm:
    """torch's LayerNorm or RMSNorm (the config's), its parameters marked `sequence_parallel`."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **unused: Any) -> torch.nn.Module:
        norm_class = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_class(hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def _groups(tp: dist.ProcessGroup | None) -> ProcessGroupCollection:
    """The model's process groups: `tp` for the tensor-parallel ones (None: one rank), one rank
    (a standalone group of size 1, which Megatron never communicates over) for the rest."""
    one = FakeProcessGroup._create_internal(0, 1)
    tp = tp or one
    return ProcessGroupCollection(tp=tp, tp_cp=tp, mp=tp, tp_dp_cp=tp, pp=one, cp=one, embd=one, pos_embd=one,
                                  dp=one, dp_cp=one)


_SETTING_UP = threading.Lock()


def _on_this_machine() -> None:
    """Megatron-Core's run-time set-up for models on the CPU (see the module docstring)."""
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    with _SETTING_UP:  # the oracle's ranks build their models at once, in threads
        parallel_state.destroy_global_memory_buffer()  # a new one: the last was made in another trace
        parallel_state._set_global_memory_buffer()
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _check_divides(config: TransformerConfig, vocab_size: int, seq_len: int, world_size: int) -> None:
    sizes = {"num_attention_heads": config.num_attention_heads, "num_query_groups": config.num_query_groups,
             "ffn_hidden_size": config.ffn_hidden_size, "vocab_size": vocab_size}
    if config.sequence_parallel:
        sizes["seq_len"] = seq_len
    wrong = [f"{name}={size}" for name, size in sizes.items() if size % world_size]
    if wrong:
        raise CaseError(f"Megatron-Core needs the tensor-parallel size {world_size} to divide {', '.join(wrong)}")


def _loaded(model: GPTRun, ref_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The rank's state cut from the reference's as Megatron-Core's checkpoint loader cuts it: each
    parameter's ShardedTensor names its slice of the global tensor (the reference's parameter, its
    layer's entry of the stacked global), a ShardedTensorFactory's pieces are merged by its merge_fn;
    what the sharded state dict does not hold (buffers) is the reference's own."""
    prefix = "module."
    sharded = model.module.sharded_state_dict(metadata={"dp_cp_group": model.groups.dp_cp})
    local = {}
    for name, full in ref_state.items():
        entry = sharded.get(name.removeprefix(prefix))
        if isinstance(entry, ShardedTensorFactory):  # its pieces' slices, from the shape of its data alone
            shaped = dataclasses.replace(entry, data=torch.empty(entry.data.shape, dtype=entry.data.dtype))
            local[name] = entry.merge_fn([_slice_of(full, piece) for piece in shaped.build()])
        elif isinstance(entry, ShardedTensor):
            local[name] = _slice_of(full, entry)
        else:
            local[name] = full
    return local


def _slice_of(full: torch.Tensor, piece: ShardedTensor) -> torch.Tensor:
    """The part of `full` a ShardedTensor holds: its global slice past the prepended (layer) axes."""
    inner = piece.global_slice()[piece.prepend_axis_num :]
    global_shape = tuple(piece.global_shape[piece.prepend_axis_num :])
    if tuple(full.shape) != global_shape:
        raise CaseError(f"`{piece.key}`: the reference's {tuple(full.shape)} is not the global {global_shape}")
    return full[inner]
