"""verify-graphs on HLO: small hand-written pairs run numerically, and the real Neuron Llama dumps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardproof.cli import main
from shardproof.importers.numeric import run_graphs
from shardproof.importers.verify import import_pair, verify_graphs

ENTANGLE = Path(__file__).parents[2] / ".." / "shared" / "data" / "entangle"
LLAMA = ENTANGLE / "aws_llama"
needs_llama = pytest.mark.skipif(not LLAMA.is_dir(), reason="../shared/data/entangle/aws_llama (Neuron HLO dumps) not present")

ADD = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %c = f32[] add(%a, %b)
}
"""


def mlp(ffn: int, reduce: bool) -> str:
    """RMS norm, fused gate+up projection split in two, SwiGLU, down projection; on TP ranks the
    down projection's partial sums are all-reduced (unless `reduce` is False: the bug)."""
    out = "%down_out"
    tail = []
    if reduce:
        tail = ["  %summed = f32[3,4] all-reduce(%down_out), replica_groups={{0,1}}, to_apply=%add"]
        out = "%summed"
    return "\n".join(
        [
            "HloModule mlp",
            ADD,
            f"ENTRY %main (x: f32[3,4], norm: f32[4], gate_up: f32[4,{2 * ffn}], down: f32[{ffn},4]) -> (f32[3,4]) {{",
            "  %x = f32[3,4] parameter(0)",
            "  %norm = f32[4] parameter(1)",
            "  %eps = f32[] constant(1e-05)",
            '  %normed = f32[3,4] custom-call(%x, %norm, %eps), custom_call_target="AwsNeuronRmsNorm", backend_config="1"',
            f"  %gate_up = f32[4,{2 * ffn}] parameter(2)",
            f"  %h = f32[3,{2 * ffn}] dot(%normed, %gate_up), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
            f"  %g = f32[3,{ffn}] slice(%h), slice={{[0:3], [0:{ffn}]}}",
            f"  %u = f32[3,{ffn}] slice(%h), slice={{[0:3], [{ffn}:{2 * ffn}]}}",
            f"  %sig = f32[3,{ffn}] logistic(%g)",
            f"  %act = f32[3,{ffn}] multiply(%g, %sig)",
            f"  %y = f32[3,{ffn}] multiply(%act, %u)",
            f"  %down = f32[{ffn},4] parameter(3)",
            "  %down_out = f32[3,4] dot(%y, %down), lhs_contracting_dims={1}, rhs_contracting_dims={0}",
            *tail,
            f"  ROOT %t = (f32[3,4]) tuple({out})",
            "}",
        ]
    )


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


@pytest.fixture
def mlp_pair(tmp_path: Path):
    def make(reduce: bool = True) -> tuple[str, str]:
        return write(tmp_path / "ref.hlo", mlp(6, reduce=False)), write(tmp_path / "tp2.hlo", mlp(3, reduce))

    return make


def test_fused_gate_up_blocks_are_inferred_and_proven(mlp_pair) -> None:
    ref, dist = mlp_pair()
    report = verify_graphs(ref, dist)
    assert report.verdict == "equivalent" and report.world_size == 2
    assert "gate_up = gate_up as Shard(1) in blocks [0, 6, 12]" in report.inputs[2]
    pair = import_pair(ref, dist)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    assert run_graphs(captured.reference, captured.ranks, pair.checks).agree


def test_plain_chunk_of_the_fused_weight_does_not_prove(mlp_pair, tmp_path: Path) -> None:
    ref, dist = mlp_pair()
    pinned = write(tmp_path / "rel.json", json.dumps({"gate_up": {"layout": "shard", "dim": 1}}))
    report = verify_graphs(ref, dist, relations=pinned)
    pair = import_pair(ref, dist, relations=pinned)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    numbers = run_graphs(captured.reference, captured.ranks, pair.checks)
    assert not numbers.agree and report.verdict == "discrepancy"
    assert report.inputs[2] == "gate_up = gate_up as Shard(1) (pinned)"


def test_missing_all_reduce_is_a_confirmed_missing_reduction(mlp_pair) -> None:
    ref, dist = mlp_pair(reduce=False)
    report = verify_graphs(ref, dist)
    assert report.verdict == "discrepancy" and "confirmed numerically" in report.diagnosis
    assert "partial sum" in report.diagnosis or "missing" in report.diagnosis


def test_cli_malformed_hlo_exits_2_with_file_line_and_expectation(mlp_pair, tmp_path: Path, capsys) -> None:
    ref, _ = mlp_pair()
    text = mlp(3, True).replace("%sig = f32[3,3] logistic(%g)", "%sig = f32[3,3] logistic(%g")
    line = text.splitlines().index("  %sig = f32[3,3] logistic(%g") + 1
    bad = write(tmp_path / "bad.hlo", text)
    code = main(["verify-graphs", "--reference", ref, "--distributed", bad, "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and f"{bad}:{line}: expected a closing `)`" in err


def test_cli_unknown_op_is_unknown_with_exit_2(mlp_pair, tmp_path: Path) -> None:
    ref, _ = mlp_pair()
    odd = write(tmp_path / "odd.hlo", mlp(3, True).replace("logistic(%g)", "cbrt(%g)"))
    out = tmp_path / "out.json"
    code = main(["verify-graphs", "--reference", ref, "--distributed", odd, "--quiet", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 2 and report["verdict"] == "unknown" and "HLO cbrt" in report["unknown"]["op"]


@needs_llama
@pytest.mark.parametrize("dist, ref", [("tp2_layer1", "tp1_layer1"), ("tp4_layer1", "tp1_layer1"), ("tp2_layer2", "tp1_layer2")])
def test_neuron_llama_tensor_parallel_is_equivalent(dist: str, ref: str, tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    code = main(["verify-graphs", "--reference", str(LLAMA / ref), "--distributed", str(LLAMA / dist), "--quiet", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["verdict"] == "equivalent"
    assert report["world_size"] == int(dist[2]) and report["outputs_compared"].startswith(report["outputs_compared"].split()[-1])
    fused = [line for line in report["inputs"] if "blocks" in line]
    assert fused == ["p9.10 = p9.10 as Shard(1) in blocks [0, 2048, 2560, 3072] (each block split over ranks)"] or dist == "tp2_layer2"


@needs_llama
def test_neuron_llama_with_qkv_as_a_plain_chunk_is_not_proven(tmp_path: Path) -> None:
    pinned = write(tmp_path / "rel.json", json.dumps({"p9.10": {"layout": "shard", "dim": 1}}))
    report = verify_graphs(LLAMA / "tp1_layer1", LLAMA / "tp2_layer1", relations=pinned)
    assert report.verdict != "equivalent"


def mesh_product(sharded: bool, reduce: bool = True) -> str:
    """x @ w on a 2x2 (dp, tp) mesh as XLA's SPMD partitioner leaves it: x split over dp (ranks
    0,1 | 2,3) on its batch and over tp (ranks 0,2 | 1,3) on its columns, w over tp on its rows,
    the partial products all-reduced over tp (unless `reduce` is False: the bug). The output's
    sharding (the batch over dp) is stated nowhere; the reference is the module on one device."""
    batch, rows = (1, 2) if sharded else (2, 4)
    x_sharding = ", sharding={devices=[2,2]<=[4]}" if sharded else ""
    w_sharding = ", sharding={devices=[2,1,2]<=[2,2]T(1,0) last_tile_dim_replicate}" if sharded else ""
    reduced = sharded and reduce
    return "\n".join(
        [
            f"HloModule mesh{', num_partitions=4' if sharded else ''}",
            ADD,
            f"ENTRY %main (x: f32[{batch},{rows}], w: f32[{rows},3]) -> f32[{batch},3] {{",
            f"  %x = f32[{batch},{rows}] parameter(0){x_sharding}",
            f"  %w = f32[{rows},3] parameter(1){w_sharding}",
            f"  %y = f32[{batch},3] dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
            *([f"  %summed = f32[{batch},3] all-reduce(%y), replica_groups={{{{0,1}},{{2,3}}}}, to_apply=%add"] if reduced else []),
            f"  ROOT %out = f32[{batch},3] copy({'%summed' if reduced else '%y'})",
            "}",
        ]
    )


@pytest.mark.parametrize("reduce", [True, False])
def test_an_output_split_over_one_axis_of_a_2d_mesh_is_gathered_over_the_axis_the_inputs_state(tmp_path: Path, reduce: bool) -> None:
    """A rank's output is neither a replica nor one of 4 shards: the readings are the mesh axes the
    inputs' shardings state (dp first, then tp); the one that proves is stated in the report, and
    a missing reduction is a discrepancy under every reading."""
    ref = write(tmp_path / "ref.hlo", mesh_product(False))
    dist = write(tmp_path / "dist.hlo", mesh_product(True, reduce))
    report = verify_graphs(ref, dist)
    assert report.verdict == ("equivalent" if reduce else "discrepancy"), report.diagnosis
    pair = import_pair(ref, dist)
    readings = list(pair.readings())
    assert len(readings) == 2
    for splits in readings:
        captured = pair.captured([p.candidates[0] for p in pair.pairs], splits)
        agree = run_graphs(captured.reference, captured.ranks, captured.checks).agree
        assert agree == (reduce and splits == readings[0])
    if reduce:
        assert any("Shard(0) over ranks [[0, 2], [1, 3]]" in line for line in report.inputs)


def sequence_gather(new_axis: int | None, shift: int = 0) -> str:
    """x doubled; on 2 ranks (`new_axis` not None) each rank doubles its rows of x, taken by
    `partition-id`, gives them a new size-1 axis at `new_axis`, all-gathers along it and flattens
    back to rows: the whole in order when the new axis is ahead of the rows (0), interleaved when
    behind them (1: the wrong axis). `shift` moves each rank's start by that many rows, on its own
    line of model.py (23; the slice is on 24), as a user computes an offset from the rank."""
    if new_axis is None:
        body = ["%x = f32[4,3] parameter(0)", "ROOT %out = f32[4,3] add(%x, %x)"]
    else:
        stacked, gathered = ("f32[2,1,3]", "f32[2,2,3]") if new_axis else ("f32[1,2,3]", "f32[2,2,3]")
        body = [
            "%x = f32[4,3] parameter(0)",
            "%id = u32[] partition-id()",
            "%two = u32[] constant(2)",
            "%base = u32[] multiply(%id, %two)",
            f"%shift = u32[] constant({shift})",
            '%start = u32[] add(%base, %shift), metadata={source_file="model.py" source_line=23}',
            "%zero = u32[] constant(0)",
            '%mine = f32[2,3] dynamic-slice(%x, %start, %zero), dynamic_slice_sizes={2,3}, metadata={source_file="model.py" source_line=24}',
            "%doubled = f32[2,3] add(%mine, %mine)",
            f"%stacked = {stacked} reshape(%doubled)",
            f"%all = {gathered} all-gather(%stacked), replica_groups={{{{0,1}}}}, dimensions={{{new_axis}}}",
            "ROOT %out = f32[4,3] reshape(%all)",
        ]
    return "\n".join(["HloModule sp", "ENTRY %main (x: f32[4,3]) -> f32[4,3] {", *(f"  {line}" for line in body), "}"])


@pytest.mark.parametrize("new_axis", [0, 1])
def test_shards_gathered_along_a_new_axis_behind_the_rows_are_the_wrong_axis(tmp_path: Path, new_axis: int) -> None:
    """A rank's rows gathered along a new axis ahead of them are the whole; behind them the rows
    interleave: a discrepancy at the all-gather (wrong axis), confirmed by the numbers."""
    ref = write(tmp_path / "ref.hlo", sequence_gather(None))
    dist = write(tmp_path / "dist.hlo", sequence_gather(new_axis))
    report = verify_graphs(ref, dist)
    pair = import_pair(ref, dist)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    assert run_graphs(captured.reference, captured.ranks, captured.checks).agree == (new_axis == 0)
    if new_axis == 0:
        assert report.verdict == "equivalent", report.diagnosis
        return
    assert report.verdict == "discrepancy" and report.kind == "wrong axis", report.diagnosis
    assert "all-gather" in report.distributed[0].code and "confirmed numerically" in report.diagnosis


def test_a_rank_slice_at_a_wrong_offset_gathered_is_found_where_the_offset_is_computed(tmp_path: Path) -> None:
    """Rank 0 takes rows [1:3) (its start shifted by one), rank 1 [2:4) (clamped): gathered, they
    overlap and leave row 0 out. The discrepancy names the slice, located at the line that
    computed its offset, then the all-gather."""
    ref = write(tmp_path / "ref.hlo", sequence_gather(None))
    dist = write(tmp_path / "dist.hlo", sequence_gather(0, shift=1))
    pair = import_pair(ref, dist)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    assert not run_graphs(captured.reference, captured.ranks, captured.checks).agree
    report = verify_graphs(ref, dist)
    assert report.verdict == "discrepancy" and report.kind == "overlapping shards", report.diagnosis
    assert "[1:3), [2:4)" in report.diagnosis and "confirmed numerically" in report.diagnosis
    first, second = report.distributed[:2]
    assert (first.line, first.op, second.op) == (23, "slice", "all_gather")


def fused_gqa(ranks: int, tiled: bool = False) -> str:
    """A fused QKV projection with 8 query heads and 2 kv heads (one column each), split in q,
    k, v; each query head takes its kv head, out = q * k + v. On one device k and v are repeated
    per query head (query head h takes kv head h // 4; `tiled`: h % 2); on 4 ranks each holds two
    query heads and one kv head, repeated for them (fewer kv heads than ranks: the kv blocks of
    the fused weight are replicated over pairs of ranks), and the outputs are all-gathered."""
    heads, kv, width = (8, 2, 12) if ranks == 1 else (2, 1, 4)
    repeated = f"f32[3,{heads // kv},{kv}]" if tiled else f"f32[3,{kv},{heads // kv}]"
    body = [
        f"%y = f32[3,{width}] dot(%x, %w), lhs_contracting_dims={{1}}, rhs_contracting_dims={{0}}",
        f"%q = f32[3,{heads}] slice(%y), slice={{[0:3], [0:{heads}]}}",
        f"%k = f32[3,{kv}] slice(%y), slice={{[0:3], [{heads}:{heads + kv}]}}",
        f"%v = f32[3,{kv}] slice(%y), slice={{[0:3], [{heads + kv}:{width}]}}",
        f"%kb = {repeated} broadcast(%k), dimensions={{0,{2 if tiled else 1}}}",
        f"%vb = {repeated} broadcast(%v), dimensions={{0,{2 if tiled else 1}}}",
        f"%kr = f32[3,{heads}] reshape(%kb)",
        f"%vr = f32[3,{heads}] reshape(%vb)",
        f"%qk = f32[3,{heads}] multiply(%q, %kr)",
        f"%mine = f32[3,{heads}] add(%qk, %vr)",
    ]
    if ranks > 1:
        body.append("%out = f32[3,8] all-gather(%mine), replica_groups={{0,1,2,3}}, dimensions={1}")
    body[-1] = "ROOT " + body[-1]
    head = ["HloModule gqa", f"ENTRY %main (x: f32[3,4], w: f32[4,{width}]) -> f32[3,8] {{",
            "  %x = f32[3,4] parameter(0)", f"  %w = f32[4,{width}] parameter(1)"]
    return "\n".join([*head, *(f"  {line}" for line in body), "}"])


@pytest.mark.parametrize("tiled", [False, True])
def test_kv_heads_fewer_than_ranks_are_replicated_blocks_of_the_fused_weight(tmp_path: Path, tiled: bool) -> None:
    """The fused weight [4, 12] is [4, 4] per rank: no plain shard. Its blocks, matched in order
    where both programs slice its product, are q [0:8) in 4 chunks and k, v [8:10), [10:12) in 2
    each, every kv chunk held by two consecutive ranks. Proven where the reference pairs query
    head h with kv head h // 4; where it pairs h with h % 2 (the kv heads tiled, not repeated
    head by head) the same layout is wrong, and the numbers say so too."""
    ref = write(tmp_path / "ref.hlo", fused_gqa(1, tiled))
    dist = write(tmp_path / "dist.hlo", fused_gqa(4))
    pair = import_pair(ref, dist)
    weight = next(p for p in pair.pairs if p.dist.name == "w")
    assert [(c.blocks, c.parts) for c in weight.candidates] == [((0, 8, 10, 12), (4, 2, 2))]
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    agree = run_graphs(captured.reference, captured.ranks, captured.checks).agree
    report = verify_graphs(ref, dist)
    assert agree == (not tiled)
    assert report.verdict == ("equivalent" if agree else "discrepancy"), report.diagnosis
    if agree:
        assert any("cut in [4, 2, 2] chunks" in line for line in report.inputs)
