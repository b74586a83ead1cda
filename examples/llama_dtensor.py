"""Case: the same Llama, tensor parallel with DTensor `parallelize_module` (torchtitan style).

Reference: `LlamaReference` from examples/llama_reference.py, with FUSED `qkv_proj` and
`gate_up_proj` weights.

Distributed: a torchtitan-style Llama with SEPARATE q/k/v and gate/up projections, parallelised
on `init_device_mesh("cpu", (world_size,))` with
  - embed_tokens: RowwiseParallel (vocab rows sharded; DTensor masks out-of-shard ids itself),
  - q/k/v_proj, gate/up_proj: ColwiseParallel; o_proj, down_proj: RowwiseParallel,
  - lm_head: ColwiseParallel(output_layouts=Replicate()) -> logits all-gathered, plain tensor out,
  - RMSNorm weights: not parallelised (plain replicated tensors).
After parallelisation each attention module computes with LOCAL head counts
(n_heads // world_size), as torchtitan sets them.

Why separate projections: ColwiseParallel cuts a weight into `world_size` contiguous row blocks.
Applied to the reference's fused [q | k | v] (or [gate | up]) weight, rank 0 would get all of q
and none of k, v: the silent bug of NeMo #1324. The natural DTensor model therefore keeps the
projections apart, and `shard_state` below is the checkpoint conversion: it unfuses the
reference's weights by slicing and then cuts each one along the dimension its parallel style
shards (the same dims DTensor placements give; rank_state wraps the shards as DTensors).

GQA with fewer kv heads than ranks (e.g. 2 kv heads at world size 4 or 8): a ColwiseParallel
k_proj would split single heads across ranks. k_proj/v_proj are then left replicated (every rank
computes all kv heads, a few small matmuls) and each rank keeps the kv head its q heads use,
kv head r // (world_size // n_kv_heads).

`shardproof --preset llama3-8b` (or llama3.1-405b) replaces the module global CONFIG; every
function below reads CONFIG when called.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from llama_reference import (
    PRESETS,
    SMALL,
    LlamaConfig,
    LlamaReference,
    RMSNorm,
    apply_rope,
    causal_attention,
    rotary_tables,
    token_inputs,
)

CONFIG = SMALL
PRESETS = dict(PRESETS)
WORLD_SIZE = 2
OUTPUT = "replicate"


# --------------------------------------------------------------------------------------------
# the model the DTensor plan is applied to (unfused projections, like torchtitan)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        d = config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.n_heads * d, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.n_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.n_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(config.n_heads * d, config.hidden, bias=False)
        # head counts of the tensors this module sees; parallelize() rewrites them to local counts
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads  # heads in k_proj's output
        self.kv_first, self.kv_used = 0, config.n_kv_heads  # which of those this module attends with

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.config.head_dim
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, d).transpose(1, 2)
        if self.kv_used != self.n_kv_heads:  # replicated kv projection: keep this rank's kv head(s)
            k = k[:, self.kv_first : self.kv_first + self.kv_used]
            v = v[:, self.kv_first : self.kv_first + self.kv_used]
        cos, sin = rotary_tables(self.config, s, x.dtype, x.device)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = causal_attention(q, k, v)
        out = out.transpose(1, 2).reshape(b, s, self.n_heads * d)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden, config.ffn, bias=False)
        self.up_proj = nn.Linear(config.hidden, config.ffn, bias=False)
        self.down_proj = nn.Linear(config.ffn, config.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden, config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab, config.hidden)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --------------------------------------------------------------------------------------------
# the tensor-parallel plan


def _kv_replicated(config: LlamaConfig, world_size: int) -> bool:
    return config.n_kv_heads % world_size != 0


def _check(config: LlamaConfig, world_size: int) -> None:
    problems = [
        f"{name}={value} is not divisible by world_size={world_size}"
        for name, value in (("vocab", config.vocab), ("n_heads", config.n_heads), ("ffn", config.ffn))
        if value % world_size
    ]
    if _kv_replicated(config, world_size) and world_size % config.n_kv_heads:
        problems.append(f"n_kv_heads={config.n_kv_heads} and world_size={world_size} do not divide one another")
    if problems:
        raise ValueError("; ".join(problems))


def parallelize(model: Llama, config: LlamaConfig, rank: int, world_size: int, mesh: DeviceMesh | None = None) -> Llama:
    """Tensor parallel over `mesh` (default: all `world_size` ranks); `rank` is the rank within it."""
    _check(config, world_size)
    if mesh is None:
        # shardproof builds models inside FakeTensorMode; DeviceMesh reads its rank map back with
        # .tolist(), which a fake tensor cannot do (DataDependentOutputException). The mesh is a few
        # ints, so build it on real tensors. Outside fake mode this context manager does nothing.
        with unset_fake_temporarily():
            mesh = init_device_mesh("cpu", (world_size,))
    kv_replicated = _kv_replicated(config, world_size)
    parallelize_module(
        model,
        mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Replicate(), use_local_output=True),
        },
    )
    layer_plan = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if not kv_replicated:
        layer_plan["self_attn.k_proj"] = ColwiseParallel()
        layer_plan["self_attn.v_proj"] = ColwiseParallel()
    for layer in model.layers:
        parallelize_module(layer, mesh, layer_plan)
        attn = layer.self_attn
        attn.n_heads = config.n_heads // world_size
        if kv_replicated:
            attn.n_kv_heads = config.n_kv_heads
            attn.kv_first, attn.kv_used = rank // (world_size // config.n_kv_heads), 1
        else:
            attn.n_kv_heads = config.n_kv_heads // world_size
            attn.kv_first, attn.kv_used = 0, attn.n_kv_heads
    return model


# --------------------------------------------------------------------------------------------
# the case


def reference() -> nn.Module:
    return LlamaReference(CONFIG)


def distributed(rank: int, world_size: int) -> nn.Module:
    return parallelize(Llama(CONFIG), CONFIG, rank, world_size)


def inputs() -> tuple:
    return token_inputs(CONFIG)


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    """Checkpoint conversion: unfuse qkv / gate_up by slicing, then take this rank's shard of each
    weight along the dim its parallel style shards (Colwise: dim 0, Rowwise Linear: dim 1,
    Rowwise Embedding: dim 0; replicated: whole)."""
    c = CONFIG
    q_rows, kv_rows = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    kv_dim = None if _kv_replicated(c, world_size) else 0

    def shard(tensor: torch.Tensor, dim: int | None) -> torch.Tensor:
        return tensor if dim is None else tensor.chunk(world_size, dim)[rank]

    out = {
        "embed_tokens.weight": shard(ref_state["embed_tokens.weight"], 0),
        "norm.weight": ref_state["norm.weight"],
        "lm_head.weight": shard(ref_state["lm_head.weight"], 0),
    }
    for i in range(c.n_layers):
        p = f"layers.{i}."
        qkv = ref_state[p + "self_attn.qkv_proj.weight"]
        gate_up = ref_state[p + "mlp.gate_up_proj.weight"]
        out.update(
            {
                p + "input_layernorm.weight": ref_state[p + "input_layernorm.weight"],
                p + "post_attention_layernorm.weight": ref_state[p + "post_attention_layernorm.weight"],
                p + "self_attn.q_proj.weight": shard(qkv[:q_rows], 0),
                p + "self_attn.k_proj.weight": shard(qkv[q_rows : q_rows + kv_rows], kv_dim),
                p + "self_attn.v_proj.weight": shard(qkv[q_rows + kv_rows :], kv_dim),
                p + "self_attn.o_proj.weight": shard(ref_state[p + "self_attn.o_proj.weight"], 1),
                p + "mlp.gate_proj.weight": shard(gate_up[: c.ffn], 0),
                p + "mlp.up_proj.weight": shard(gate_up[c.ffn :], 0),
                p + "mlp.down_proj.weight": shard(ref_state[p + "mlp.down_proj.weight"], 1),
            }
        )
    return out
