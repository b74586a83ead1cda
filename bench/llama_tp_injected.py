"""Case: examples/llama_tp.py with one silent bug injected, for bench/scale.py.

Layer BUG_LAYER's MLP output is not all-reduced (its down projection is a plain column-parallel
linear): on every rank when BUG_RANK is None, else on that rank only (then the ranks also issue
different collectives). Everything else, presets included, is examples/llama_tp.py, run with this
module's CONFIG.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import llama_tp  # noqa: E402
from llama_tp import OUTPUT, PRESETS, WORLD_SIZE, ColumnParallelLinear, LlamaTP  # noqa: E402,F401

CONFIG = llama_tp.CONFIG
BUG_LAYER = 57
BUG_RANK: int | None = None


def reference():
    llama_tp.CONFIG = CONFIG
    return llama_tp.reference()


def inputs() -> tuple:
    llama_tp.CONFIG = CONFIG
    return llama_tp.inputs()


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    llama_tp.CONFIG = CONFIG
    return llama_tp.shard_state(ref_state, rank, world_size)


def distributed(rank: int, world_size: int) -> LlamaTP:
    model = LlamaTP(CONFIG, rank, world_size)
    if BUG_RANK in (None, rank) and BUG_LAYER < CONFIG.n_layers:
        local_ffn = CONFIG.ffn // world_size
        model.layers[BUG_LAYER].mlp.down_proj = ColumnParallelLinear(local_ffn, CONFIG.hidden)  # no all-reduce
    return model
