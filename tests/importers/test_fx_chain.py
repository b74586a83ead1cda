"""verify-graphs on programs torch.compile broke into several graphs: the graphs of each rank
chained in order, forward and joint forward+backward, generated at test time (`fx/compiled.py`),
each verdict checked against the numbers; and the links the dumps cannot decide, refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardproof.errors import CaseError
from shardproof.importers.fx_dump import load_fx_ranks
from shardproof.importers.numeric import run_graphs
from shardproof.importers.verify import import_pair, verify_graphs

COMPILED = Path(__file__).parent / "fx" / "compiled.py"


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """Forward and training dumps, correct and with the row-parallel all-reduce left out."""
    out = tmp_path_factory.mktemp("fx_breaks")
    for mode, bug in (("forward", ""), ("train", ""), ("train", "missing_all_reduce")):
        subprocess.run([sys.executable, str(COMPILED), str(out / f"{mode}{bug}"), "mlp", mode, bug], check=True, capture_output=True)
    return out


def _agree(ref: Path, dist: Path) -> bool:
    pair = import_pair(ref, dist)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    return run_graphs(captured.reference, captured.ranks, pair.checks).agree


@pytest.mark.parametrize("mode, graphs", [("forward", 2), ("train", 3)])
def test_a_program_broken_into_graphs_is_verified_whole(dumps: Path, mode: str, graphs: int) -> None:
    ref, dist = dumps / mode / "reference", dumps / mode / "dist"
    assert len(list(dist.glob("*.r0.py"))) == graphs
    report = verify_graphs(ref, dist)
    assert report.verdict == "equivalent" and report.world_size == 2
    links = [i for i in report.inputs if i.startswith("distributed graph")]
    assert len(links) == graphs - 1 and links[0].startswith("distributed graph 1 input")
    assert "= graph 0 output 0 (`relu`)" in links[0]
    if mode == "train":  # the gradients of the weights of every graph are compared
        assert sum(c.startswith("gradient of") for c in report.proven) == 3, report.proven
    assert _agree(ref, dist)


def test_a_missing_all_reduce_before_a_graph_break_is_found_at_its_line(dumps: Path) -> None:
    ref, dist = dumps / "trainmissing_all_reduce" / "reference", dumps / "trainmissing_all_reduce" / "dist"
    report = verify_graphs(ref, dist)
    assert report.verdict == "discrepancy" and "missing reduction" in report.diagnosis
    culprit = report.distributed[0]
    assert (Path(culprit.file).name, culprit.code) == ("compiled.py", "y = h @ w2")
    assert not _agree(ref, dist)


GRAPH = """class G(torch.nn.Module):
    def forward(self, {inputs}):
{body}
        return ({outputs},)
"""


def _write(path: Path, inputs: str, body: str, outputs: str) -> str:
    path.write_text(GRAPH.format(inputs=inputs, body=body, outputs=outputs))
    return str(path)


@pytest.mark.parametrize(
    "inputs, message",
    [
        ('a: "f32[3]"', r"input `a` \(float32\[3\]\) may be output 0 of graph 0, output 1 of graph 0"),
        ('a: "f32[3]", b: "f32[3]"', "inputs `a` and `b` both have the shape of graph 0's output 0"),
    ],
)
def test_links_the_dumps_cannot_decide_are_refused(tmp_path: Path, inputs: str, message: str) -> None:
    first = _write(tmp_path / "fw.g0.r0.py", 'x: "f32[3]"', '        y: "f32[3]" = torch.ops.aten.neg.default(x)', "x, y" if "b" not in inputs else "y")
    second = _write(tmp_path / "fw.g1.r0.py", inputs, '        z: "f32[3]" = torch.ops.aten.neg.default(a)', "z")
    with pytest.raises(CaseError, match=message):
        load_fx_ranks([[first, second]])
