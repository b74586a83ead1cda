"""Proving call by call: identical layers share one proof, and a bug in one layer (or on one rank
only) still comes out as a discrepancy at its line, in agreement with the numbers."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Callable

import pytest
import torch

from shardproof import verify
from shardproof.capture.torch_capture import capture
from shardproof.case import Case, load_case
from shardproof.oracle import run_numeric
from shardproof.prove import prove

LLAMA = Path(__file__).parents[2] / "examples" / "llama_tp.py"
LAYERS, WORLD, BAD_LAYER, BAD_RANK = 6, 4, 3, 1


def _llama(layers: int = LAYERS) -> Case:
    case = load_case(LLAMA)
    case.module.CONFIG = dataclasses.replace(case.module.CONFIG, n_layers=layers)
    return case


def _with_loader(case: Case, loader: Callable) -> Case:
    case.shard_state = loader
    return case


def _line_of(text: str, function: Callable) -> int:
    lines, start = inspect.getsourcelines(function)
    return start + next(i for i, line in enumerate(lines) if text in line)


def test_identical_layers_are_proven_once_and_reused() -> None:
    case = _llama()
    proof = prove(capture(case, WORLD), case.output_layout())
    assert proof.verdict == "equivalent"
    assert proof.calls is not None
    # a forward program records no gradients, so every decoder layer is of one kind: layer 0's call
    # is proven, the others are answered from its proof
    assert proof.calls.proven == 1, "layer 0"
    assert proof.calls.reused >= LAYERS - 1, "layers 1.. answered from layer 0's proof"


@pytest.mark.slow
def test_a_wrong_shard_in_one_layer_on_one_rank_is_diagnosed_as_without_memoization() -> None:
    case = _llama()
    original = case.shard_state

    def loader(ref_state: dict, rank: int, world_size: int) -> dict:
        out = original(ref_state, rank, world_size)
        if rank == BAD_RANK:
            name = f"layers.{BAD_LAYER}.self_attn.o_proj.weight"
            width = out[name].shape[1]
            out[name] = ref_state[name][:, 0:width]  # rank 0's columns
        return out

    case = _with_loader(case, loader)
    report = verify(case, world_size=WORLD, backend="none")
    assert not run_numeric(case, WORLD).agree
    assert report.verdict == "discrepancy", report.diagnosis
    assert report.distributed[0].rank == BAD_RANK
    plain = verify(case, world_size=WORLD, backend="none", memo=False)
    assert (report.diagnosis, report.distributed) == (plain.diagnosis, plain.distributed), "as without memoization"


@pytest.mark.slow
def test_a_shard_one_column_off_in_one_layer_on_one_rank_is_overlapping_shards_at_the_loader_line() -> None:
    """One rank cuts one layer's down_proj columns one further on: its shard overlaps the next
    rank's and no rank holds the column before it, so the all-reduce never reads that column (a
    structural fault). Blamed on the loader's slice, naming the tensor it cuts, hence the layer."""
    case = _llama()
    original = case.shard_state
    name = f"layers.{BAD_LAYER}.mlp.down_proj.weight"

    def loader(ref_state: dict, rank: int, world_size: int) -> dict:
        out = original(ref_state, rank, world_size)
        if rank == BAD_RANK:
            width = out[name].shape[1]
            out[name] = ref_state[name][:, rank * width + 1 : (rank + 1) * width + 1]  # one column off
        return out

    case = _with_loader(case, loader)
    report = verify(case, world_size=WORLD, backend="none")
    assert not run_numeric(case, WORLD).agree
    assert report.verdict == "discrepancy", report.diagnosis
    assert "overlapping shards" in report.diagnosis and f"`{name}`" in report.diagnosis
    culprit = report.distributed[0]
    assert (Path(culprit.file).name, culprit.line, culprit.rank) == (Path(__file__).name, _line_of("one column off", loader), BAD_RANK)
    plain = verify(case, world_size=WORLD, backend="none", memo=False)
    assert (report.diagnosis, report.distributed) == (plain.diagnosis, plain.distributed), "as without memoization"


def test_a_missing_reduction_in_one_layer_is_a_discrepancy() -> None:
    case = _llama()
    module = case.module

    def distributed(rank: int, world_size: int) -> torch.nn.Module:
        model = module.LlamaTP(module.CONFIG, rank, world_size)
        local_ffn = module.CONFIG.ffn // world_size
        model.layers[BAD_LAYER].mlp.down_proj = module.ColumnParallelLinear(local_ffn, module.CONFIG.hidden)
        return model

    case.distributed = distributed
    report = verify(case, world_size=WORLD)
    assert not run_numeric(case, WORLD).agree
    assert report.verdict == "discrepancy"
    assert "missing reduction" in report.diagnosis
    culprit = report.distributed[0]
    forward = module.ColumnParallelLinear.forward
    assert (culprit.file, culprit.line) == (str(LLAMA), _line_of("F.linear", forward)), "the linear that is not reduced"


def test_a_collective_missing_on_one_rank_in_one_layer_is_a_mismatch_at_that_layer() -> None:
    case = _llama()
    module = case.module

    def distributed(rank: int, world_size: int) -> torch.nn.Module:
        model = module.LlamaTP(module.CONFIG, rank, world_size)
        if rank == BAD_RANK:
            local_ffn = module.CONFIG.ffn // world_size
            model.layers[BAD_LAYER].mlp.down_proj = module.ColumnParallelLinear(local_ffn, module.CONFIG.hidden)
        return model

    case.distributed = distributed
    report = verify(case, world_size=WORLD)
    assert report.verdict == "discrepancy"
    assert f"rank {BAD_RANK} calls module layers.{BAD_LAYER + 1}" in report.diagnosis
