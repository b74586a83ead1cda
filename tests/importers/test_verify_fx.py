"""verify-graphs on the real FX readable dumps of ../shared/data/entangle (Megatron-LM, vLLM,
HF Trainer). These graphs are far too large to run numerically (32768 tokens, vocabularies of
10^5 rows); the small bug pair is run, and the importer's numeric agreement is tested on graphs
made here (test_fx_dump.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardproof.cli import main
from shardproof.errors import CaseError
from shardproof.importers.numeric import run_graphs
from shardproof.importers.verify import import_pair, verify_graphs
from shardproof.prove import unproven_outputs
from shardproof.relations.diagnose import Diagnoser
from shardproof.relations.execute import execute

ENTANGLE = Path(__file__).parents[2] / ".." / "shared" / "data" / "entangle"
needs_data = pytest.mark.skipif(not ENTANGLE.is_dir(), reason="../shared/data/entangle (graph dumps) not present")

# Megatron's vocab-parallel cross entropy fills masked targets with tensor constants whose values
# the dumps do not record (`masked_target[mask] = 0`, `predicted_logits[mask] = 0.0` inside the
# autograd Function); the sum over ranks is the reference's only if they are 0, the identity of
# the all-reduce they reach: the value inferred, and stated.
INFERRED = "= 0 (not recorded in the dumps; inferred: the identity of the `sum` reduction over ranks it reaches)"


def _run(tmp_path: Path, ref: str, dist: str, relations: dict | None = None) -> tuple[int, dict]:
    args = ["verify-graphs", "--reference", str(ENTANGLE / ref), "--distributed", str(ENTANGLE / dist), "--quiet"]
    if relations is not None:
        pinned = tmp_path / "relations.json"
        pinned.write_text(json.dumps(relations))
        args += ["--relations", str(pinned)]
    out = tmp_path / "out.json"
    code = main(args + ["--json", str(out)])
    return code, json.loads(out.read_text())


@needs_data
def test_vllm_qwen2_tensor_parallel_is_equivalent(tmp_path: Path) -> None:
    code, report = _run(tmp_path, "qwen2/paral1_layer1", "qwen2/paral2_layer1")
    assert code == 0 and report["verdict"] == "equivalent" and report["world_size"] == 2
    assert "arg4_1 = arg4_1 as Shard(0) in blocks [0, 1536, 1792, 2048] (each block split over ranks)" in report["inputs"]
    assert "arg9_1 = arg9_1 as Shard(0) in blocks [0, 8960, 17920] (each block split over ranks)" in report["inputs"]


@needs_data
@pytest.mark.parametrize("ref, dist, ranks", [("paral1_layer1", "paral2_layer1", 2), ("paral1_layer1", "paral4_layer1", 4), ("paral1_layer2", "paral2_layer2", 2)])
def test_megatron_gpt_tensor_and_sequence_parallel_is_equivalent(tmp_path: Path, ref: str, dist: str, ranks: int) -> None:
    code, report = _run(tmp_path, f"gpt/{ref}", f"gpt/{dist}")
    assert code == 0 and report["verdict"] == "equivalent" and report["world_size"] == ranks
    assert report["outputs_compared"].startswith("5 of")  # the loss, then tensors saved for backward differ
    filled = [i for i in report["inputs"] if i.startswith("_tensor_constant")]
    assert len(filled) == 2 and all(i.endswith(INFERRED) for i in filled)


@needs_data
def test_megatron_gpt_with_a_wrong_fill_value_is_not_proven(tmp_path: Path) -> None:
    code, report = _run(tmp_path, "gpt/paral1_layer1", "gpt/paral2_layer1", {"_tensor_constant3": {"value": 1.0}})
    assert code != 0 and report["verdict"] != "equivalent"
    assert "_tensor_constant3 = _tensor_constant1 = 1.0 (not recorded in the dumps) (pinned)" in report["inputs"]


@needs_data
def test_gradient_accumulation_bug_is_a_confirmed_wrong_scale(tmp_path: Path) -> None:
    code, report = _run(tmp_path, "bug_grad_accumulation/1step", "bug_grad_accumulation/2step.bug")
    assert code == 1 and report["verdict"] == "discrepancy"
    diagnosis = report["discrepancy"]["diagnosis"]
    assert diagnosis.startswith("wrong scale") and "confirmed numerically" in diagnosis
    assert "each share of it is scaled by 1/4 here, where the reference scales the whole by 1/8" in diagnosis
    culprit = report["discrepancy"]["distributed"][0]  # the micro-batch mean, not the accumulation
    assert (culprit["file"].rsplit("/", 1)[-1], culprit["line"]) == ("test_trainer_simple.py", 100)
    assert culprit["code"] == "loss = ((y - labels) ** 2).mean()"
    assert "arg5_1 = arg2_1 as Shard(0), micro-batch 1 of 2" in report["inputs"]


LAYERNORM_BUG = ("bug_missing_layernorm_allreduce/tp1", "bug_missing_layernorm_allreduce/tp2.bug")
# The gradients Megatron all-reduces over the tensor-parallel group under sequence parallelism,
# which this bug leaves unreduced: input, q, k and pre-MLP layer norms, the row-parallel biases.
LAYER = "module.module.decoder.layers.0."
SEQUENCE_PARALLEL_GRADIENTS = [  # named by the parameters the dump logs; the joint graph returns one gradient per primal
    f"gradient of `{LAYER}{name}` (output {i}, {node})" for name, i, node in [
        ("input_layernorm.weight", 26, "add_24"), ("input_layernorm.bias", 27, "add_25"),
        ("self_attention.linear_proj.bias", 29, "add_15"), ("self_attention.q_layernorm.weight", 32, "add_19"),
        ("self_attention.q_layernorm.bias", 33, "add_20"), ("self_attention.k_layernorm.weight", 34, "add_17"),
        ("self_attention.k_layernorm.bias", 35, "add_18"), ("pre_mlp_layernorm.weight", 36, "add_13"),
        ("pre_mlp_layernorm.bias", 37, "add_14"), ("mlp.linear_fc2.bias", 41, "add_8"),
    ]
]  # fmt: skip


@needs_data
def test_missing_layernorm_allreduce_is_found_at_the_weight_gradient() -> None:
    report = verify_graphs(*(ENTANGLE / side for side in LAYERNORM_BUG))
    assert report.verdict == "discrepancy" and report.claims[0] == SEQUENCE_PARALLEL_GRADIENTS[0]
    assert report.diagnosis.startswith(f"{SEQUENCE_PARALLEL_GRADIENTS[0]}: missing reduction")
    culprit = report.distributed[0]  # apex's layer-norm backward; the dump records torch's custom-op line for it
    assert culprit.node.startswith("fused_layer_norm_affine_bwd") and culprit.op == "sum"
    assert (Path(culprit.file).name, culprit.line) == ("custom_ops.py", 675)
    assert "process group `1`: ranks [0]" in report.inputs and "process group `3`: ranks [1]" in report.inputs


@pytest.mark.slow
@needs_data
def test_the_layernorm_bug_leaves_only_the_sequence_parallel_gradients_unproven() -> None:
    """No false finding elsewhere: the loss and every other gradient of the joint graph (tensor-
    parallel weights, the vocab-parallel embedding and cross entropy) are proven; the gradients
    left are partial sums, each rank holding its sequence (or head) shard's share."""
    pair = import_pair(*(ENTANGLE / side for side in LAYERNORM_BUG))
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    run = execute(captured.reference, captured.ranks)
    unproven = [c for c in captured.checks if unproven_outputs(run, captured.reference, captured.ranks, c, [])]
    assert [c.label for c in unproven] == SEQUENCE_PARALLEL_GRADIENTS
    partial = Diagnoser(run, captured.reference, captured.ranks).partial
    assert all(partial(run.ranks[g.rank][g.outputs[c.actual]]) for c in unproven for g in captured.ranks)


RANK = """class G(torch.nn.Module):
    def forward(self, x: "f32[2, 4]", w: "f32[4, {cols}]", b: "f32[{bias}]"):
        mm: "f32[2, {cols}]" = torch.ops.aten.mm.default(x, w)
        add: "f32[2, {cols}]" = torch.ops.aten.add.Tensor(mm, b)
        return (add,)
"""


def test_ranks_that_take_other_inputs_than_rank_0_are_refused(tmp_path: Path) -> None:
    """The inputs' layouts are inferred from rank 0 and applied to every rank: a rank dump whose
    input differs (here `b`, though broadcasting still fits its use) is damaged, never proven."""
    (tmp_path / "ref.py").write_text(RANK.format(cols=6, bias=6))
    ranks = tmp_path / "tp2"
    ranks.mkdir()
    (ranks / "fw.g0.r0.py").write_text(RANK.format(cols=3, bias=3))
    (ranks / "fw.g0.r1.py").write_text(RANK.format(cols=3, bias=3))
    assert verify_graphs(tmp_path / "ref.py", ranks).verdict == "equivalent"  # the undamaged pair
    (ranks / "fw.g0.r1.py").write_text(RANK.format(cols=3, bias=1))
    with pytest.raises(CaseError, match=r"fw.g0.r1.py: input `b` is an input float32\[1\] here but an input float32\[3\] in .*fw.g0.r0.py"):
        import_pair(tmp_path / "ref.py", ranks)


@needs_data
@pytest.mark.slow
def test_a_broadcast_over_a_named_group_imports_in_a_fresh_process() -> None:
    """torch resolves a functional collective's group by name when run; a fresh process has none
    registered (the suite's earlier tests may have), so collectives are not run on meta tensors."""
    ref, dist = (str(ENTANGLE / p) for p in LAYERNORM_BUG)
    done = subprocess.run([sys.executable, "-m", "shardproof", "verify-graphs", "--quiet", "--reference", ref, "--distributed", dist],
                          capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout.startswith("discrepancy"), done.stderr


def test_ranks_that_return_other_outputs_than_rank_0_are_refused(tmp_path: Path) -> None:
    """Which outputs to compare is read from rank 0: a rank dump returning fewer is damaged (a
    fuzzed dump once ended in an IndexError here)."""
    (tmp_path / "ref.py").write_text(RANK.format(cols=6, bias=6))
    ranks = tmp_path / "tp2"
    ranks.mkdir()
    (ranks / "fw.g0.r0.py").write_text(RANK.format(cols=3, bias=3).replace("return (add,)", "return (add, mm)"))
    (ranks / "fw.g0.r1.py").write_text(RANK.format(cols=3, bias=3))
    with pytest.raises(CaseError, match=r"fw.g0.r1.py: returns 1 outputs here but 2 in .*fw.g0.r0.py"):
        import_pair(tmp_path / "ref.py", ranks)


def fused_gqa(ranks: int) -> str:
    """vLLM's Qwen2 attention in small: a fused QKV linear with bias (8 query heads and 2 kv heads
    of one column each), split in q, k, v, each kv head repeated for its 4 query heads, out = q * k + v,
    then the row-parallel output projection, all-reduced. On 4 ranks each holds two query heads and
    one kv head (fewer kv heads than ranks: kv heads replicated over pairs of ranks), so the fused
    weight's 12 rows are 4 per rank, no plain shard of them ([640] of [2048] for Qwen2 at TP 4)."""
    heads, kv = (8, 2) if ranks == 1 else (2, 1)
    width, group = heads + 2 * kv, heads // kv
    repeat = "\n".join(
        f'''        {n}3: "f32[3, {kv}, 1]" = torch.ops.aten.view.default({n}, [3, {kv}, 1])
        {n}e: "f32[3, {kv}, {group}]" = torch.ops.aten.expand.default({n}3, [3, {kv}, {group}])
        {n}c: "f32[3, {kv}, {group}]" = torch.ops.aten.clone.default({n}e, memory_format=torch.contiguous_format)
        {n}r: "f32[3, {heads}]" = torch.ops.aten.view.default({n}c, [3, {heads}])'''
        for n in ("k", "v")
    )
    reduce = """
        all_reduce: "f32[3, 5]" = torch.ops._c10d_functional.all_reduce.default(out, 'sum', '0')
        out_r: "f32[3, 5]" = torch.ops._c10d_functional.wait_tensor.default(all_reduce)""" if ranks > 1 else """
        out_r: "f32[3, 5]" = torch.ops.aten.clone.default(out)"""
    return f'''class G(torch.nn.Module):
    def forward(self, x: "f32[3, 4]", w: "f32[{width}, 4]", b: "f32[{width}]", wo: "f32[5, {heads}]"):
        t: "f32[4, {width}]" = torch.ops.aten.t.default(w)
        qkv: "f32[3, {width}]" = torch.ops.aten.addmm.default(b, x, t)
        split = torch.ops.aten.split_with_sizes.default(qkv, [{heads}, {kv}, {kv}], -1)
        q: "f32[3, {heads}]" = split[0]
        k: "f32[3, {kv}]" = split[1]
        v: "f32[3, {kv}]" = split[2]
{repeat}
        qk: "f32[3, {heads}]" = torch.ops.aten.mul.Tensor(q, kr)
        mine: "f32[3, {heads}]" = torch.ops.aten.add.Tensor(qk, vr)
        t_1: "f32[{heads}, 5]" = torch.ops.aten.t.default(wo)
        out: "f32[3, 5]" = torch.ops.aten.mm.default(mine, t_1){reduce}
        return (out_r,)
'''


def test_kv_heads_fewer_than_ranks_are_inferred_replicated_blocks_in_fx_dumps(tmp_path: Path) -> None:
    """The fused weight and bias are cut in blocks q [0:8) in 4 chunks and k, v [8:10), [10:12) in
    2 each, every kv chunk held by two consecutive ranks; proven with no --relations, and the
    numbers agree."""
    (tmp_path / "ref.py").write_text(fused_gqa(1))
    ranks = tmp_path / "tp4"
    ranks.mkdir()
    for rank in range(4):
        (ranks / f"fw.g0.r{rank}.py").write_text(fused_gqa(4))
    pair = import_pair(tmp_path / "ref.py", ranks)
    fused = [p for p in pair.pairs if p.dist.name in ("w", "b")]
    assert [(c.dim, c.blocks, c.parts) for p in fused for c in p.candidates] == [(0, (0, 8, 10, 12), (4, 2, 2))] * 2
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    assert run_graphs(captured.reference, captured.ranks, captured.checks).agree
    report = verify_graphs(tmp_path / "ref.py", ranks)
    assert report.verdict == "equivalent", report.diagnosis
    assert "w = w as Shard(0) in blocks [0, 8, 10, 12] (each block split over ranks), cut in [4, 2, 2] chunks" in report.inputs[1]
