"""Data-dependent sizes in FX dumps: the dense form of rows picked by `nonzero` computes what
torch computes (each rewrite, on random masks, the empty pick included), an expert-parallel MoE
routed by `nonzero` is verified (and a wrong expert id found), and what has no dense form is
refused at its line, saying what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from shardproof.errors import GraphFileError
from shardproof.importers.fx_dump import load_fx
from shardproof.importers.numeric import run_graphs
from shardproof.importers.verify import import_pair, verify_graphs
from shardproof.ir.run import run_graph

COMPILED = Path(__file__).parent / "fx" / "compiled.py"


def _picked_rows(x, w, b, s):
    """index_add of rows computed by pointwise ops (a broadcast operand), mm, addmm and a cast."""
    rows = torch.nonzero(s > 0)[:, 0]
    picked = torch.sigmoid(torch.addmm(b, x[rows], w) * b) @ w.t()
    return x.index_add(0, rows, picked.double().float() + 1.0)


def _summed_rows(x, w, b, s):
    """The picked rows summed over: a reduction over a data-dependent number of rows."""
    rows = torch.nonzero(s > 0)[:, 0]
    return torch.relu(x[rows] @ w).sum(0) + b


def _rows_contracted(x, w, b, s):
    """A weight's gradient: picked rows contracted with picked rows (index_select, t, mm)."""
    rows = torch.nonzero(s > 0)[:, 0]
    a = x.index_select(0, rows)
    return a.t() @ torch.relu(a @ w).detach() + b


def dump(tmp_path: Path, fn, *inputs: torch.Tensor) -> Path:
    """The forward graph torch.compile makes of fn."""

    def write(gm, example_inputs):
        (tmp_path / "graph.py").write_text(gm.print_readable(print_output=False))
        return gm

    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        torch.compile(fn, backend=aot_autograd(fw_compiler=write), fullgraph=True, dynamic=False)(*inputs)
    return tmp_path / "graph.py"


@pytest.mark.parametrize("fn", [_picked_rows, _summed_rows, _rows_contracted])
def test_dense_forms_compute_what_torch_computes(tmp_path: Path, fn) -> None:
    x, w, b = torch.randn(6, 4), torch.randn(4, 4), torch.randn(4)
    path = dump(tmp_path, fn, x, w, b, torch.randn(6))
    assert "[u0" in path.read_text()
    imported = load_fx(str(path), 0, 1)
    for seed, s in enumerate([torch.randn(6), -torch.ones(6), torch.ones(6)]):  # some rows, none, all
        by_shape = {tuple(t.shape): t.double() for t in (x, w, b, s)}  # the graph orders its inputs its own way
        got = run_graph(imported.graph, {i.name: by_shape[i.shape] for i in imported.inputs})[0]
        assert torch.allclose(got.float(), fn(x, w, b, s), atol=1e-5), seed


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fx_moe")
    for mode, bug in (("forward", ""), ("train", ""), ("forward", "local_expert_id")):
        subprocess.run([sys.executable, str(COMPILED), str(out / (bug or mode)), "moe", mode, bug], check=True, capture_output=True)
    return out


@pytest.mark.parametrize("mode", ["forward", "train"])
def test_an_expert_parallel_moe_routed_by_nonzero_is_verified(moe: Path, mode: str) -> None:
    ref, dist = moe / mode / "reference", moe / mode / "dist"
    assert "i64[u0, 1]" in next(dist.glob("*.g0.r1.py")).read_text()
    report = verify_graphs(ref, dist)
    assert report.verdict == "equivalent" and report.world_size == 2, report.diagnosis
    assert sum(c.startswith("gradient of") for c in report.proven) == (2 if mode == "train" else 0)  # the experts' weights
    pair = import_pair(ref, dist)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    assert run_graphs(captured.reference, captured.ranks, pair.checks).agree


def test_a_rank_routing_to_its_local_expert_ids_is_found(moe: Path) -> None:
    report = verify_graphs(moe / "local_expert_id" / "reference", moe / "local_expert_id" / "dist")
    assert report.verdict == "discrepancy" and "confirmed numerically" in report.diagnosis
    assert Path(report.distributed[0].file).name == "compiled.py" and report.distributed[0].rank == 1


PICKED = '''class G(torch.nn.Module):
    def forward(self, x: "f32[6, 4]", s: "f32[6]"):
        gt: "b8[6]" = torch.ops.aten.gt.Scalar(s, 0)
        nonzero: "i64[u0, 1]" = torch.ops.aten.nonzero.default(gt)
        sym_size_int: "Sym(u0)" = torch.ops.aten.sym_size.int(nonzero, 0)
        ge: "Sym(u0 >= 0)" = sym_size_int >= 0
        _assert_scalar = torch.ops.aten._assert_scalar.default(ge, "u0 >= 0")
        select: "i64[u0]" = torch.ops.aten.select.int(nonzero, 1, 0)
        index: "f32[u0, 4]" = torch.ops.aten.index.Tensor(x, [select])
{line}
'''


@pytest.mark.parametrize(
    "line, expected",
    [
        ('        c: "f32[u0, 4]" = torch.ops.aten.cumsum.default(index, 0)\n        return (x,)', "a row-wise op on `index`"),
        ("        return (index,)", "program outputs of a fixed size"),
        ('        v: "f32[s0, 4]" = torch.ops.aten.view.default(x, [6, 4])\n        return (v,)', "fixed sizes"),
    ],
)
def test_what_has_no_dense_form_is_refused_at_its_line_saying_what_to_do(tmp_path: Path, line: str, expected: str) -> None:
    path = tmp_path / "graph.py"
    path.write_text(PICKED.format(line=line))
    with pytest.raises(GraphFileError, match=expected) as err:
        load_fx(str(path), 0, 1)
    assert f"{path}:10:" in str(err.value)
