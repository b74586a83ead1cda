"""Input-relation inference: pairing, candidate layouts ranked by slice evidence, micro-batches,
pinning; and the rank graphs it builds, run numerically against torch's chunking."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardproof.errors import CaseError
from shardproof.importers.graph_inputs import ImportedGraph
from shardproof.importers.relate import implied_world_size, pair_inputs, pin, rank_graph, with_values
from shardproof.ir.build import GraphBuilder
from shardproof.ir.graph import Graph
from shardproof.ir.run import run_graph
from shardproof.layouts import Layout


def program(inputs: dict[str, tuple[tuple[int, ...], str]], cuts: list[tuple[str, int, int, int]] = (), constants: dict = {}) -> ImportedGraph:
    """A graph whose inputs are `inputs` and which slices input `name` along `dim` at [lo, hi)."""
    imported = ImportedGraph(Graph(), "g.py")
    b = GraphBuilder(imported.graph)
    leaves = {name: imported.add_input(name, shape, dtype) for name, (shape, dtype) in inputs.items()}
    for name, (shape, dtype) in constants.items():
        leaves[name] = imported.add_input(name, shape, dtype, constant=True)
    outs = [b.slice(leaves[name], dim, lo, hi) for name, dim, lo, hi in cuts] or list(leaves.values())
    imported.graph.outputs = outs
    return imported


def test_pairs_by_position_and_ranks_fused_blocks_seen_on_both_sides_first() -> None:
    ref = program({"x": ((4, 8), "float32"), "qkv": ((8, 12), "float32")}, [("qkv", 1, 0, 8), ("qkv", 1, 8, 10), ("qkv", 1, 10, 12)])
    dist = program({"x": ((4, 8), "float32"), "qkv": ((8, 6), "float32")}, [("qkv", 1, 0, 4), ("qkv", 1, 4, 5), ("qkv", 1, 5, 6)])
    pairs = pair_inputs(ref, dist, 2)
    assert [p.candidates for p in pairs][0] == [Layout("replicate")]
    assert pairs[1].candidates == [Layout("shard", 1, (0, 8, 10, 12)), Layout("shard", 1, (0, 12))]


def test_world_size_implied_by_input_shapes() -> None:
    ref = program({"w": ((8, 12), "float32"), "b": ((12,), "float32")})
    dist = program({"w": ((8, 3), "float32"), "b": ((12,), "float32")})
    assert implied_world_size(ref, dist) == 4


def test_extra_inputs_are_micro_batches_of_the_earlier_ones() -> None:
    ref = program({"a": ((), "float32"), "x": ((8,), "float32"), "y": ((8,), "float32")})
    dist = program({"a": ((), "float32"), "x": ((4,), "float32"), "y": ((4,), "float32"), "x2": ((4,), "float32"), "y2": ((4,), "float32")})
    pairs = pair_inputs(ref, dist, 1)
    assert [(p.dist.name, p.ref.name, p.candidates[0].micro) for p in pairs] == [
        ("a", "a", (0, 1)), ("x", "x", (0, 2)), ("y", "y", (0, 2)), ("x2", "x", (1, 2)), ("y2", "y", (1, 2)),
    ]  # fmt: skip


def test_an_input_that_cannot_be_cut_names_itself_and_the_fix() -> None:
    ref = program({"w": ((8, 12), "float32")})
    dist = program({"w": ((8, 5), "float32")})
    with pytest.raises(CaseError, match="input w \\[8, 5\\] cannot be cut from reference input w \\[8, 12\\] over 2 rank.*--relations"):
        pair_inputs(ref, dist, 2)


def test_rank_graphs_cut_inputs_like_torch() -> None:
    """Rank r of blocks [0, 8, 10, 12] over 2 ranks holds columns [4r:4r+4], [8+r], [10+r]."""
    ref = program({"qkv": ((3, 12), "float32")})
    dist = program({"qkv": ((3, 6), "float32")})
    pairs = pair_inputs(ref, dist, 2)
    layout = Layout("shard", 1, (0, 8, 10, 12))
    full = torch.randn(3, 12, dtype=torch.float64)
    for rank in range(2):
        (got,) = run_graph(rank_graph(dist, pairs, [layout], rank, 2), {"qkv": full})
        want = torch.cat([block.chunk(2, 1)[rank] for block in full.split([8, 2, 2], 1)], 1)
        torch.testing.assert_close(got, want)


def test_micro_batch_layout_cuts_chunk_rank_times_count_plus_index() -> None:
    layout = Layout("shard", 0, (0, 12), (1, 3))
    assert layout.regions(1, 2) == [(8, 10)] and layout.fits((12,), (2,), 2)


def test_pinned_relations_override_and_constants_take_values(tmp_path: Path) -> None:
    ref = program({"w": ((8, 12), "float32")}, constants={"c0": ((), "float32")})
    dist = program({"w": ((8, 6), "float32")}, constants={"c9": ((), "float32")})
    pairs = pair_inputs(ref, dist, 2)
    pinned = tmp_path / "r.json"
    pinned.write_text(json.dumps({"w": {"layout": "shard", "dim": 1, "blocks": [0, 6, 12]}, "c9": {"value": 0.5}}))
    pin(pairs, ref, pinned)
    assert pairs[0].candidates == [Layout("shard", 1, (0, 6, 12))] and pairs[1].candidates[0].value == 0.5
    assert pairs[1].describe(pairs[1].candidates[0], ref) == "c9 = c0 = 0.5 (not recorded in the dumps) (pinned)"
    bound = with_values(ref.graph, {"c0": 0.5})
    assert bound[ref.inputs[1].node].op == "const"
    pinned.write_text(json.dumps({"w": {"value": 1}}))
    with pytest.raises(CaseError, match="w is a graph input, not a constant"):
        pin(pairs, ref, pinned)
    pinned.write_text(json.dumps({"nope": {}}))
    with pytest.raises(CaseError, match="no distributed input named nope"):
        pin(pairs, ref, pinned)
