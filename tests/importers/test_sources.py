"""Finding a side's graph files: ranks in order, the joint graph preferred, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardproof.errors import CaseError
from shardproof.importers.sources import detect_format, graph_files


def touch(directory: Path, *names: str) -> None:
    for name in names:
        (directory / name).write_text("")


def test_rank_files_in_rank_order(tmp_path: Path) -> None:
    touch(tmp_path, "fw.g0.r10.py", "fw.g0.r2.py", *(f"fw.g0.r{r}.py" for r in (0, 1, 3, 4, 5, 6, 7, 8, 9)))
    assert [f.name for [f] in graph_files(tmp_path, "distributed")][:3] == ["fw.g0.r0.py", "fw.g0.r1.py", "fw.g0.r2.py"]
    assert graph_files(tmp_path, "distributed")[-1][0].name == "fw.g0.r10.py"


def test_the_joint_graph_covers_forward_and_backward(tmp_path: Path) -> None:
    touch(tmp_path, "both.g0.r0.py", "both.g0.r1.py", "bw.g0.r0.py", "bw.g0.r1.py")
    assert [f.name for [f] in graph_files(tmp_path, "distributed")] == ["both.g0.r0.py", "both.g0.r1.py"]


def test_the_graphs_of_a_broken_program_come_per_rank_in_graph_order(tmp_path: Path) -> None:
    touch(tmp_path, *(f"fw.g{g}.r{r}.py" for g in (0, 1, 10, 2) for r in (0, 1)))
    assert [[f.name for f in rank] for rank in graph_files(tmp_path, "distributed")] == [
        [f"fw.g{g}.r{r}.py" for g in (0, 1, 2, 10)] for r in (0, 1)
    ]


@pytest.mark.parametrize(
    "names, message",
    [
        (["fw.g0.r0.py", "bw.g0.r0.py"], "several kinds of graph .* pass the distributed as one file"),
        (["fw.g0.r0.py", "fw.g0.r2.py"], "are not ranks 0..1"),
        (["fw.g0.r0.py", "fw.g0.r1.py", "fw.g1.r0.py"], "are not ranks 0..1"),
        ([], "no graph files"),
    ],
)
def test_unusable_directories_say_what_to_do(tmp_path: Path, names: list[str], message: str) -> None:
    touch(tmp_path, *names)
    with pytest.raises(CaseError, match=message):
        graph_files(tmp_path, "distributed")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CaseError, match="reference graph not found"):
        graph_files(tmp_path / "nope", "reference")


def test_format_is_detected_from_the_text(tmp_path: Path) -> None:
    hlo, fx, other = tmp_path / "m.txt", tmp_path / "g.py", tmp_path / "x.txt"
    hlo.write_text("HloModule m\n")
    fx.write_text("class G(torch.nn.Module):\n    def forward(self, x):\n        return (x,)\n")
    other.write_text("hello\n")
    assert (detect_format(hlo), detect_format(fx)) == ("hlo", "fx")
    with pytest.raises(CaseError, match="say which with --format"):
        detect_format(other)
