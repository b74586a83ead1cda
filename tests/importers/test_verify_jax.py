"""verify-graphs on the HLO XLA writes for a JAX Llama-like block (`tests/importers/jax/`),
generated at test time on 8 host CPU devices: every program at every stage against the
single-device reference, with no --relations, each verdict checked against the numbers; and
bugs injected into the `shard_map` program, each reported at the line it changed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardproof.cli import main
from shardproof.importers.numeric import run_graphs
from shardproof.importers.verify import import_pair

pytest.importorskip("jaxlib", reason="needs the jax extra: pip install 'shardproof[jax]' (tests/importers/jax is a folder, so `import jax` alone could find it)")

HERE = Path(__file__).parent / "jax"
sys.path.insert(0, str(HERE))
from bugs import BUGS  # noqa: E402

STAGES = ("before", "spmd", "compiled")
PROGRAMS = ("tp", "sp", "dp_tp", "jit_tp", "tp_train", "sp_train", "jit_tp_train")


def generate(out: Path, bug: str = "-", *programs: str) -> Path:
    subprocess.run([sys.executable, str(HERE / "dumps.py"), str(out), bug, *programs], check=True, capture_output=True)
    return out


@pytest.fixture(scope="session")
def dumps(tmp_path_factory) -> Path:
    return generate(tmp_path_factory.mktemp("jax_dumps"))


def reference(dumps: Path, program: str, stage: str) -> Path:
    name = "reference_train" if program.endswith("_train") else "reference"
    return dumps / name / ("compiled.hlo" if stage == "compiled" else "before.hlo")


@pytest.mark.slow
@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.parametrize("stage", STAGES)
def test_generated_pair_is_equivalent_without_relations(dumps: Path, program: str, stage: str, tmp_path: Path) -> None:
    ref, dist = reference(dumps, program, stage), dumps / program / f"{stage}.hlo"
    out = tmp_path / "out.json"
    code = main(["verify-graphs", "--reference", str(ref), "--distributed", str(dist), "--quiet", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["verdict"] == "equivalent", report.get("unknown") or report.get("discrepancy")
    assert report["world_size"] == (4 if program.startswith("dp_") else 2)
    pair = import_pair(ref, dist)
    captured = pair.captured([p.candidates[0] for p in pair.pairs])
    assert run_graphs(captured.reference, captured.ranks, pair.checks).agree


# bug -> the program it is injected into, and the line expected first (the edited one, or for a
# helper whose collective was removed, the model line that calls it)
INJECTED = {
    "missing_psum": ("tp", BUGS["missing_psum"][1]),
    "bias_before_psum": ("tp", BUGS["bias_before_psum"][1]),
    "gather_wrong_axis": ("sp", BUGS["gather_wrong_axis"][1]),
    "slice_wrong_offset": ("sp", BUGS["slice_wrong_offset"][1]),
    "loss_without_pmean": ("sp_train", "return comm.mean(jnp.mean(out * out))"),
}


@pytest.mark.slow
@pytest.mark.parametrize("bug", list(INJECTED))
@pytest.mark.parametrize("stage", STAGES)
def test_injected_bug_exits_1_at_its_line(dumps: Path, bug: str, stage: str, tmp_path_factory) -> None:
    program, line_text = INJECTED[bug]
    out_dir = tmp_path_factory.getbasetemp() / f"bug_{bug}"
    if not out_dir.exists():
        generate(out_dir, bug, program)
    out = out_dir / f"{stage}.json"
    ref, dist = reference(dumps, program, stage), out_dir / program / f"{stage}.hlo"
    code = main(["verify-graphs", "--reference", str(ref), "--distributed", str(dist), "--quiet", "--json", str(out)])
    report = json.loads(out.read_text())
    assert code == 1 and report["verdict"] == "discrepancy", report.get("unknown")
    first = report["discrepancy"]["distributed"][0]
    written = (out_dir / "model.py").read_text().splitlines()
    assert Path(first["file"]).name == "model.py" and line_text in written[first["line"] - 1]
    assert "confirmed numerically" in report["discrepancy"]["diagnosis"]


def test_hand_parser_reads_what_xlas_parser_reads(dumps: Path) -> None:
    """jaxlib's own HLO parser, where JAX is: both read the same computations and instructions."""
    from jax._src.lib import xla_client

    from shardproof.importers.hlo import load_hlo

    for path in sorted(dumps.glob("*/*.hlo")):
        ours = load_hlo(str(path))
        theirs = xla_client.hlo.hlo_module_from_text(path.read_text())
        counted = {c.name: len(c.instructions()) for c in theirs.computations()}
        assert counted == {name: len(c.instructions) for name, c in ours.computations.items()}, path
