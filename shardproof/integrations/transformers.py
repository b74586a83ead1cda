"""Hugging Face transformers: a case from a model config, parallelised and loaded by transformers itself.

`from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))` does three things, and the
case runs each with transformers' own code, so a bug in any of them is found:
- `prepare_distribute_model` makes the device mesh, the model is built on meta tensors, and
  `maybe_distribute_model` applies the TP plan (`base_model_tp_plan`, the head's `_tp_plan`, the
  implicit vocab-parallel `embed_tokens`, overrides from `DistributedConfig.tp_plan`): parameters
  become DTensor placeholders and forwards get their collectives (`distributed`);
- `convert_and_load_state_dict_in_model` cuts each rank's shard out of the checkpoint with
  `DtensorShardOperation` and `tie_weights` ties the head to the embedding (`shard_state`). The
  checkpoint is the reference's state as `save_pretrained` writes it (tied copies left out).
  Non-persistent buffers (rotary tables) are in no checkpoint: transformers computes them on each
  rank from the config, as the reference did, and here the ranks take the reference's;
- the model runs with transformers' defaults: sdpa attention, the default MoE experts, a bare
  `model(input_ids)` (or with an all-ones `attention_mask`); the case compares the logits.
Training: cross entropy of the logits against the next token.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import threading
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.state import module_state

try:
    import transformers
    from transformers import AutoConfig, PretrainedConfig
    from transformers import core_model_loading
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.distributed import DistributedConfig
    from transformers.modeling_utils import LoadStateDictConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
except ImportError as err:  # pragma: no cover - the extra is optional
    raise ImportError("the transformers integration needs transformers 5: pip install 'shardproof[hf]'") from err


def transformers_case(
    config: PretrainedConfig | dict | str | Path,
    tp_plan: dict[str, str] | None = None,
    train: bool = False,
    world_size: int = 2,
    batch: int = 2,
    seq_len: int = 8,
    attention_mask: bool = False,
    seed: int = 0,
) -> Case:
    """A case for `config`'s causal LM: the reference built as `from_config` builds it, each rank as
    `from_pretrained(distributed_config=DistributedConfig(tp_size=world_size, tp_plan=tp_plan))`
    builds and loads it. `config`: a config object, its dict, or a `config.json` path (its
    `model_type` picks the class); `tp_plan` overrides entries of the model's plan."""
    config = _config(config)
    model_class = _causal_lm_class(config)
    builder = _Builder(config, model_class, tp_plan, train)
    if tp_plan is not None:
        builder.check_plan()
    vocab = config.get_text_config().vocab_size

    def inputs() -> tuple:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
        return (ids, torch.ones(batch, seq_len, dtype=torch.long)) if attention_mask else (ids,)

    return Case(
        reference=builder.reference,
        distributed=builder.distributed,
        inputs=inputs,
        world_size=world_size,
        shard_state=builder.shard_state,
        loss=next_token_loss,
        distributed_step=backward_step,
        mode="train" if train else "forward",
    )


# Small sizes for every size attribute a config may have: 16 query heads (over 8 kv heads where the
# architecture groups them) divide every world size up to 8; the MoE and MLA sizes fit one another.
_TINY = {
    "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 8, "max_position_embeddings": 64,
    "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64, "num_local_experts": 4,
    "num_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 1, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 8, "sliding_window": 4, "num_mtp_layers": 0,
}


def tiny_config(model_type: str, **overrides: Any) -> PretrainedConfig:
    """`model_type`'s default config shrunk to a few thousand parameters (every size attribute it
    has, see `_TINY`), then `overrides`: to try transformers' TP on an architecture offline."""
    default = AutoConfig.for_model(model_type)
    sizes = {name: value for name, value in _TINY.items() if hasattr(default, name)}
    if getattr(default, "num_key_value_heads", None) in (None, getattr(default, "num_attention_heads", None)):
        sizes["num_key_value_heads"] = sizes["num_attention_heads"]  # no grouped-query attention by default
    config = AutoConfig.for_model(model_type, **{**sizes, **overrides})
    vocab = config.vocab_size
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= vocab:
            setattr(config, name, vocab - 1)
    return config


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
    """Cross entropy of each position's logits against the next token (in float32, as transformers' own loss)."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), input_ids[:, 1:].flatten())


def backward_step(model: torch.nn.Module, inputs: tuple, rank: int, world_size: int) -> torch.Tensor:
    """A rank's step as a training loop takes it: `backward()` accumulates into `.grad`, where the
    plan's gradient hooks fire (`replicated_with_grad_allreduce` all-reduces there)."""
    loss = next_token_loss(model(*inputs), *inputs)
    loss.backward()
    return loss


def load_tp_plan(path: str | Path) -> dict[str, str]:
    """A TP plan override from a JSON file: {"layers.*.mlp.down_proj": "rowwise", ...}."""
    plan = json.loads(Path(path).read_text())
    if not isinstance(plan, dict) or not all(isinstance(v, str) for v in plan.values()):
        raise CaseError(f"{path}: a TP plan is a JSON object mapping module names to style names")
    return plan


def _config(config: PretrainedConfig | dict | str | Path) -> PretrainedConfig:
    if isinstance(config, PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, (str, Path)):
        path = Path(config)
        if not path.is_file():
            raise CaseError(f"config file not found: {path}")
        config = json.loads(path.read_text())
    if "model_type" not in config:
        raise CaseError("a transformers config needs its `model_type` (e.g. \"llama\")")
    config = dict(config)
    return AutoConfig.for_model(config.pop("model_type"), **config)


def _causal_lm_class(config: PretrainedConfig) -> type:
    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError as err:
        raise CaseError(f"transformers has no causal LM for config {type(config).__name__}") from err


class _Builder:
    """The reference, each rank's model and its loader for one config."""

    def __init__(self, config: PretrainedConfig, model_class: type, tp_plan: dict[str, str] | None, train: bool):
        self.config, self.model_class, self.tp_plan, self.train = config, model_class, tp_plan, train
        # the rank model this thread built last, which its loader fills: capture builds a rank's
        # model and then traces its loader, the numeric oracle does so in one thread per rank
        self.built = threading.local()

    def reference(self) -> torch.nn.Module:
        model = self.model_class._from_config(copy.deepcopy(self.config))
        return _returning_logits(model.train(self.train))

    def distributed(self, rank: int, world_size: int) -> torch.nn.Module:
        """This rank's model as `from_pretrained` builds it before loading: mesh, meta init, TP plan."""
        cls = self.model_class
        distributed_config = DistributedConfig(tp_size=world_size, tp_plan=self.tp_plan)
        distributed_config, _, mesh_manager = cls.prepare_distribute_model(distributed_config)
        model = cls.maybe_distribute_model(self._unloaded(), distributed_config, mesh_manager)
        with _EXCLUSIVE:  # from_pretrained ties after loading; loading here keeps the ties
            model.tie_weights(recompute_mapping=False)
        self.built.model = model
        return _returning_logits(model.train(self.train))

    def check_plan(self) -> None:
        """A plan naming what the model lacks fails here, before anything is traced."""
        try:
            self._unloaded()._resolve_parallel_plans(DistributedConfig(tp_size=2, tp_plan=self.tp_plan))
        except ValueError as err:
            raise CaseError(f"the TP plan does not fit {self.model_class.__name__}: {err}") from err

    def _unloaded(self) -> torch.nn.Module:
        """The model as `from_pretrained` makes it before distributing and loading (untied, in its
        dtype), on the device in force rather than on meta tensors: capture makes it on fake ones."""
        cls = self.model_class
        with _EXCLUSIVE, contextlib.ExitStack() as stack:
            for context in cls.get_init_context(self.config.dtype or torch.get_default_dtype(), False, False, None):
                if not isinstance(context, torch.device):
                    stack.enter_context(context)
            return cls(copy.deepcopy(self.config))

    def shard_state(self, ref_state: dict[str, torch.Tensor], rank: int, world_size: int) -> dict[str, torch.Tensor]:
        """This rank's state: the reference's checkpoint loaded into the rank's model by transformers."""
        model = getattr(self.built, "model", None)
        if model is None:
            raise CaseError("shard_state runs after distributed() built this rank's model")
        saved = set(model.state_dict(keep_vars=True)) - set(model.all_tied_weights_keys)
        load_config = LoadStateDictConfig(dtype=model.dtype, device_mesh=model._device_mesh)
        with _EXCLUSIVE, _loading_in_this_thread(), _values_set() as values, _state_kept(model):
            info, _ = convert_and_load_state_dict_in_model(model, {n: ref_state[n] for n in saved}, load_config)
            model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)
            held = module_state(model)
        if info.missing_keys or info.mismatched_keys or info.unexpected_keys:
            raise CaseError(f"loading the reference's checkpoint left missing {sorted(info.missing_keys)[:5]}, "
                            f"mismatched {sorted(info.mismatched_keys)[:5]}, unexpected {sorted(info.unexpected_keys)[:5]}")
        loaded = {id(held[name]): value for name, value in values.items()}  # tied names hold one tensor
        computed = {name for name, _ in model.named_non_persistent_buffers()}
        return {name: ref_state[name] if name in computed else loaded[id(tensor)] for name, tensor in held.items()}


def _returning_logits(model: torch.nn.Module) -> torch.nn.Module:
    """The model called as users call it, answering with its logits (the cache is no output)."""
    model.register_forward_hook(lambda module, args, output: output.logits)
    return model


# from_pretrained's init contexts patch process-wide state (the default dtype, `tie_weights`,
# `torch.linspace`) and restore it on exit: ranks built and loaded in threads (the numeric oracle)
# take turns.
_EXCLUSIVE = threading.RLock()


@contextlib.contextmanager
def _loading_in_this_thread() -> Iterator[None]:
    """transformers cuts the shards in a thread pool unless told not to, where the trace (a
    per-thread dispatch mode) would not see them; and no progress bar."""
    previous, bars = os.environ.get(_ASYNC_LOAD), transformers.utils.logging.is_progress_bar_enabled()
    os.environ[_ASYNC_LOAD] = "1"
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_ASYNC_LOAD, None)
        else:
            os.environ[_ASYNC_LOAD] = previous
        if bars:
            transformers.utils.logging.enable_progress_bar()


_ASYNC_LOAD = "HF_DEACTIVATE_ASYNC_LOAD"


@contextlib.contextmanager
def _state_kept(model: torch.nn.Module) -> Iterator[None]:
    """The model's own tensors put back after loading: every load (the parameters, then the
    reference gradients in training) starts from the placeholders `from_pretrained` loads into."""
    kept = [(module, dict(module._parameters), dict(module._buffers)) for module in model.modules()]
    try:
        yield
    finally:
        for module, parameters, buffers in kept:
            module._parameters.update(parameters)
            module._buffers.update(buffers)


@contextlib.contextmanager
def _values_set() -> Iterator[dict[str, torch.Tensor]]:
    """The value transformers' loader sets for each name, before `set_param_for_module` wraps it in
    an `nn.Parameter`: that wrapping issues no op, so a tracer would take the parameter for a
    constant, not for the slice of the reference it is."""
    values: dict[str, torch.Tensor] = {}
    original = core_model_loading.set_param_for_module

    def set_param_for_module(model: torch.nn.Module, target_name: str, param_value: torch.Tensor, *args: Any) -> None:
        values[target_name] = param_value
        original(model, target_name, param_value, *args)

    core_model_loading.set_param_for_module = set_param_for_module
    try:
        yield values
    finally:
        core_model_loading.set_param_for_module = original
