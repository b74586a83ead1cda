"""Inject: a wrong shard in one layer on one rank, at Llama-3.1-405B shapes, found as fast as a proof.

Runs examples/llama_tp.py (preset llama3.1-405b) twice per repeat, each in a fresh spawned child:
as it is, and with its checkpoint loader (`shard_llama_state`) cutting layer L's
`mlp.down_proj.weight` one column off on rank R (default layer 77, rank 3), so that rank R's shard
overlaps its neighbour's and leaves a column out. The bug is written into a copy of the case
file, so the culprit the report names is a line of the loader, as in a real checkpoint bug.
Prints one table (medians over --repeat runs), whether the bug was localised (loader line, rank,
layer named), and the bug run's time over the correct run's. See bench/README.md.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from verify_llama import EXAMPLES, Row, fmt, render, run_configuration  # noqa: E402

PRESET = "llama3.1-405b"
CASE = EXAMPLES / "llama_tp.py"
DOWN_PROJ_SHARD = "[:, rank * ffn : (rank + 1) * ffn]"  # the loader's slice of down_proj, in CASE
HEADERS = ["run", "verdict", "total s", "capture s", "proof s", "peak MiB", "localised", "culprit", "diagnosis"]
DIAGNOSIS_WIDTH = 100


@dataclass(frozen=True)
class Injection:
    layer: int
    rank: int
    world_size: int

    @property
    def shift(self) -> int:
        """One column to the right, or to the left on the last rank (its shard would run out)."""
        return 1 if self.rank + 1 < self.world_size else -1

    def write(self, directory: Path) -> tuple[Path, int]:
        """The case (and the reference it imports) copied into `directory` with the loader's
        down_proj slice shifted on this rank in this layer; the case's path and that line."""
        for path in EXAMPLES.glob("llama_*.py"):
            shutil.copy(path, directory / path.name)
        lines = CASE.read_text().splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if DOWN_PROJ_SHARD in line]
        if len(hits) != 1:
            raise SystemExit(f"{CASE.name}: expected one loader line with {DOWN_PROJ_SHARD}, found {len(hits)}")
        off = f"{self.shift} * ((i, rank) == ({self.layer}, {self.rank}))"
        lines[hits[0]] = lines[hits[0]].replace(DOWN_PROJ_SHARD, f"[:, rank * ffn + {off} : (rank + 1) * ffn + {off}]")
        case = directory / CASE.name
        case.write_text("".join(lines))
        return case, hits[0] + 1

    def localised(self, row: Row, line: int) -> bool:
        """The culprit is the loader line on the injected rank, and the diagnosis names the layer."""
        return row.culprit == (CASE.name, line, self.rank) and f"layers.{self.layer}." in (row.note or "")


def median_row(rows: list[Row]) -> Row:
    """The run of median total time (its verdict, diagnosis and culprit); the largest peak memory."""
    timed = sorted((r for r in rows if r.total is not None), key=lambda r: r.total)
    if not timed:
        return rows[0]
    row = timed[(len(timed) - 1) // 2]
    row.total = statistics.median(r.total for r in timed)
    row.peak_mib = max(r.peak_mib for r in timed)
    return row


def cells(name: str, row: Row, localised: str) -> list[str]:
    culprit = "-" if row.culprit is None else f"rank {row.culprit[2]} {row.culprit[0]}:{row.culprit[1]}"
    diagnosis = (row.note or "-").splitlines()[0]
    if len(diagnosis) > DIAGNOSIS_WIDTH:
        diagnosis = diagnosis[: DIAGNOSIS_WIDTH - 1] + "…"
    return [
        name, row.verdict, fmt(row.total, ".2f"), fmt(row.capture, ".2f"), fmt(row.proof, ".2f"),
        fmt(row.peak_mib, ".0f"), localised, culprit, diagnosis,
    ]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", type=int, default=77, help="the layer whose down_proj shard is cut wrong (default 77)")
    parser.add_argument("--rank", type=int, default=3, help="the rank that cuts it (default 3)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--layers", type=int, default=126, help="n_layers (default: the preset's 126)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each; the table shows medians (default 3)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--markdown", action="store_true", help="emit a markdown table")
    args = parser.parse_args(argv)
    if not (0 <= args.layer < args.layers and 0 <= args.rank < args.world_size and args.world_size > 1):
        parser.error("need 0 <= layer < layers, 0 <= rank < world size, world size > 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    injection = Injection(args.layer, args.rank, args.world_size)
    with tempfile.TemporaryDirectory() as directory:
        buggy, line = injection.write(Path(directory))
        runs: dict[str, list[Row]] = {"correct": [], "bug": []}
        for attempt in range(args.repeat):
            for name, case in (("correct", CASE), ("bug", buggy)):
                row = run_configuration(args.world_size, args.layers, PRESET, args.timeout, case_file=case)
                runs[name].append(row)
                print(f"{name} #{attempt + 1}: {row.verdict} {fmt(row.total, '.2f')} s", file=sys.stderr, flush=True)
    correct, bug = median_row(runs["correct"]), median_row(runs["bug"])
    bug_name = f"bug: layer {args.layer}, rank {args.rank}"
    print(
        f"{CASE.name}, preset {PRESET}, ws {args.world_size}, {args.layers} layers; medians of {args.repeat}; "
        f"the bug shifts rank {args.rank}'s down_proj shard of layer {args.layer} by {injection.shift} column "
        f"({CASE.name}:{line} in the copy)\n"
    )
    rows = [cells("correct", correct, "-"), cells(bug_name, bug, "yes" if injection.localised(bug, line) else "no")]
    print(render(HEADERS, rows, args.markdown) + "\n")
    ratio = "-" if bug.total is None or not correct.total else f"{bug.total / correct.total:.2f}x"
    print(f"bug / correct (total s): {ratio}")
    if bug.note:
        print(f"\nbug diagnosis: {bug.note}")


if __name__ == "__main__":
    main()
