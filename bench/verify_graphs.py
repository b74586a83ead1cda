"""Benchmark `shardproof verify-graphs` on the real graph dumps of ../shared/data/entangle, and
with `--jax` on the HLO XLA writes for the JAX block of tests/importers/jax (generated first; needs
the `jax` extra).

Each pair runs in a fresh spawned child process, so its peak RSS is its own. Prints one row per
pair (import seconds, proof seconds, peak MiB) and, where the research tool that published these
dumps reported a time for the same graphs, the ratio. See bench/README.md for the columns.
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from child import run_in_child
from verify_llama import render

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "entangle"
# (reference, distributed, research tool's seconds on a 16-core server); no relation is pinned
PAIRS = [
    ("aws_llama/tp1_layer1", "aws_llama/tp2_layer1", 10.1),
    ("aws_llama/tp1_layer1", "aws_llama/tp4_layer1", None),
    ("aws_llama/tp1_layer2", "aws_llama/tp2_layer2", None),
    ("gpt/paral1_layer1", "gpt/paral2_layer1", 13.6),
    ("gpt/paral1_layer1", "gpt/paral4_layer1", None),
    ("gpt/paral1_layer2", "gpt/paral2_layer2", None),
    ("qwen2/paral1_layer1", "qwen2/paral2_layer1", None),
    ("bug_grad_accumulation/1step", "bug_grad_accumulation/2step.bug", None),
    ("bug_missing_layernorm_allreduce/tp1", "bug_missing_layernorm_allreduce/tp2.bug", None),
]
JAX_DUMPS = Path(__file__).resolve().parents[1] / "tests" / "importers" / "jax" / "dumps.py"
JAX_PROGRAMS = ("tp", "sp", "dp_tp", "jit_tp", "tp_train", "sp_train", "jit_tp_train")
HEADERS = ["distributed", "ranks", "verdict", "import s", "proof s", "total s", "peak MiB", "terms", "research s", "speed-up"]


@dataclass
class Row:
    pair: str
    research: float | None
    verdict: str = "error"
    ranks: int | None = None
    imported: float | None = None
    total: float | None = None
    peak_mib: float | None = None
    terms: int | None = None
    note: str | None = None

    def cells(self) -> list[str]:
        proof = None if self.total is None else self.total - self.imported
        speedup = None if self.research is None or not self.total else self.research / self.total
        return [
            self.pair, _fmt(self.ranks, "d"), self.verdict, _fmt(self.imported, ".2f"), _fmt(proof, ".2f"),
            _fmt(self.total, ".2f"), _fmt(self.peak_mib, ".0f"), _fmt(self.terms, "d"), _fmt(self.research, ".1f"),
            "-" if speedup is None else f"{speedup:.0f}x",
        ]  # fmt: skip


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def measure(reference: str, distributed: str) -> dict[str, Any]:
    """Verify one pair in this process; return the Row fields."""
    from shardproof.importers.verify import verify_graphs

    report = verify_graphs(DATA / reference, DATA / distributed)
    return {
        "verdict": report.verdict,
        "ranks": report.world_size,
        "imported": report.capture_seconds,
        "total": report.seconds,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "terms": report.terms,
        "note": report.diagnosis,
    }


def run_pair(reference: str, distributed: str, research: float | None, timeout: float, label: str | None = None) -> Row:
    """Measure one pair in a fresh spawned process; failures become the row's verdict."""
    status, payload = run_in_child(measure, (reference, distributed), timeout)
    if status == "ok":
        return Row(label or distributed, research, **payload)
    return Row(label or distributed, research, status, note=payload)


def jax_pairs(out: Path) -> list[tuple[str, str, str]]:
    """(reference, distributed, label) for each JAX program and stage, dumped into `out`."""
    subprocess.run([sys.executable, str(JAX_DUMPS), str(out)], check=True, capture_output=True)
    pairs = []
    for program in JAX_PROGRAMS:
        reference = out / ("reference_train" if program.endswith("_train") else "reference")
        for stage in ("before", "spmd", "compiled"):
            ref_stage = "compiled" if stage == "compiled" else "before"
            pairs.append((str(reference / f"{ref_stage}.hlo"), str(out / program / f"{stage}.hlo"), f"jax/{program}/{stage}"))
    return pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="run the pairs whose distributed path contains this text")
    parser.add_argument("--markdown", action="store_true", help="emit a markdown table")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pair, default 900")
    parser.add_argument("--jax", action="store_true", help="add the JAX rows (dumps generated first; needs the jax extra)")
    args = parser.parse_args(argv)
    if not DATA.is_dir():
        parser.error(f"graph dumps not found at {DATA}")
    rows = []
    for reference, distributed, research in PAIRS:
        if args.only and args.only not in distributed:
            continue
        rows.append(run_pair(reference, distributed, research, args.timeout))
        print(f"{distributed}: {rows[-1].verdict}", file=sys.stderr, flush=True)
    if args.jax:
        with tempfile.TemporaryDirectory() as out:
            for reference, distributed, label in jax_pairs(Path(out)):
                if args.only and args.only not in label:
                    continue
                rows.append(run_pair(reference, distributed, None, args.timeout, label))
                print(f"{label}: {rows[-1].verdict}", file=sys.stderr, flush=True)
    print(render(HEADERS, [row.cells() for row in rows], args.markdown))
    notes = [f"- {row.pair}: {row.note}" for row in rows if row.note and row.verdict != "equivalent"]
    if notes:
        print("\nVerdict notes:\n" + "\n".join(notes))


if __name__ == "__main__":
    main()
