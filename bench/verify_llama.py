"""Benchmark `shardproof.verify` on the Llama examples across world sizes and depths.

Forward: examples/llama_tp.py. `--train`: one training step of examples/llama_sp_train.py
(TP + sequence parallel; loss and every gradient). `--pipeline`: one training step of
examples/llama_pp.py (min(4, ws) stages, 1F1B, 8 microbatches; pipelines data parallel beyond 4).

Each configuration runs in a fresh spawned child process, so its peak RSS is its own.
Run `python bench/verify_llama.py --help`; see bench/README.md for the columns.
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from child import run_in_child

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CASES = {"forward": EXAMPLES / "llama_tp.py", "train": EXAMPLES / "llama_sp_train.py", "pipeline": EXAMPLES / "llama_pp.py"}
HEADERS = ["ws", "layers", "verdict", "capture s", "proof s", "total s", "peak MiB", "terms", "ref ops", "dist ops"]


@dataclass
class Row:
    """One configuration's measurements; figures are None when it raised."""

    world_size: int
    layers: int
    verdict: str
    capture: float | None = None
    proof: float | None = None
    total: float | None = None
    cpu: float | None = None  # the child's CPU seconds for the whole verify (wall time varies with load)
    peak_mib: float | None = None
    terms: int | None = None
    reference_ops: int | None = None
    distributed_ops: int | None = None
    calls_proven: int | None = None
    calls_reused: int | None = None
    note: str | None = None
    culprit: tuple[str, int, int | None] | None = None  # a discrepancy's first site: file name, line, rank

    def cells(self) -> list[str]:
        seconds = [fmt(s, ".2f") for s in (self.capture, self.proof, self.total)]
        counts = [fmt(c, "d") for c in (self.terms, self.reference_ops, self.distributed_ops)]
        return [str(self.world_size), str(self.layers), self.verdict, *seconds, fmt(self.peak_mib, ".0f"), *counts]


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


# --------------------------------------------------------------------------------------------
# child process


def measure(
    world_size: int,
    layers: int,
    preset: str | None,
    mode: str = "forward",
    memo: bool = True,
    backend: str = "none",
    batch: int | None = None,
    case_file: Path | None = None,
) -> dict[str, Any]:
    """Verify one configuration in this process (`case_file`: the mode's case, unless given);
    return the Row fields."""
    from shardproof.api import verify
    from shardproof.case import load_case

    case = load_case(case_file or CASES[mode])
    if preset is not None:
        case.use_preset(preset)
    config = case.module.CONFIG
    case.module.CONFIG = dataclasses.replace(config, n_layers=layers, batch=batch or config.batch)
    started = time.process_time()
    report = verify(case, world_size=world_size, train=mode != "forward", memo=memo, backend=backend)
    cpu = time.process_time() - started
    return {
        "verdict": report.verdict,
        "capture": report.capture_seconds,
        "proof": report.seconds - report.capture_seconds,
        "total": report.seconds,
        "cpu": cpu,
        "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        "terms": report.terms,
        "reference_ops": report.reference_ops,
        "distributed_ops": report.distributed_ops,
        "calls_proven": report.calls_proven,
        "calls_reused": report.calls_reused,
        "note": report.diagnosis,
        "culprit": _culprit(report.distributed),
    }


def _culprit(sites: list) -> tuple[str, int, int | None] | None:
    """The first site a discrepancy names (the most likely culprit): file name, line, rank."""
    return (Path(sites[0].file).name, sites[0].line, sites[0].rank) if sites else None


# --------------------------------------------------------------------------------------------
# parent process


def run_configuration(
    world_size: int,
    layers: int,
    preset: str | None,
    timeout: float,
    mode: str = "forward",
    memo: bool = True,
    backend: str = "none",
    batch: int | None = None,
    case_file: Path | None = None,
) -> Row:
    """Measure one configuration in a fresh spawned process; failures become the row's verdict."""
    status, payload = run_in_child(measure, (world_size, layers, preset, mode, memo, backend, batch, case_file), timeout)
    if status == "ok":
        return Row(world_size, layers, **payload)
    return Row(world_size, layers, status, note=payload)


def ratios(rows: list[Row]) -> list[tuple[str, str, str, str]]:
    """(ratio, where, total-time ratio, proof-time ratio) for consecutive depths and extreme world sizes."""
    timed = {(r.world_size, r.layers): r for r in rows if r.total is not None}
    sizes = sorted({r.world_size for r in rows})
    depths = sorted({r.layers for r in rows})
    pairs = [
        (f"time({b} layers) / time({a} layers)", f"ws {ws}", (ws, b), (ws, a))
        for ws in sizes
        for a, b in zip(depths, depths[1:])
    ]
    if len(sizes) > 1:
        lo, hi = sizes[0], sizes[-1]
        pairs += [(f"time(ws {hi}) / time(ws {lo})", f"{n} layers", (hi, n), (lo, n)) for n in depths]
    return [(name, where, _ratio(timed, num, den, "total"), _ratio(timed, num, den, "proof")) for name, where, num, den in pairs]


def _ratio(timed: dict[tuple[int, int], Row], num: tuple[int, int], den: tuple[int, int], field: str) -> str:
    if num not in timed or den not in timed or not getattr(timed[den], field):
        return "-"
    return f"{getattr(timed[num], field) / getattr(timed[den], field):.2f}x"


def render(headers: list[str], body: list[list[str]], markdown: bool) -> str:
    """A plain table (numeric columns right-aligned, text left-aligned), or a markdown one."""
    if markdown:
        lines = [headers, ["---"] * len(headers), *body]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)
    columns = list(zip(headers, *body))
    widths = [max(len(c) for c in column) for column in columns]
    right = [all(_numeric(c) for c in column[1:]) for column in columns]
    lines = [headers, ["-" * w for w in widths], *body]
    return "\n".join(
        "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)).rstrip() for cells in lines
    )


def _numeric(cell: str) -> bool:
    return cell == "-" or cell.rstrip("x").replace(".", "", 1).isdigit()


def notes(rows: list[Row]) -> list[str]:
    """One line per distinct diagnosis/error, naming the configurations it applies to."""
    by_note: dict[str, list[str]] = {}
    for row in rows:
        if row.note:
            by_note.setdefault(row.note, []).append(f"ws{row.world_size}/L{row.layers}")
    return [f"{', '.join(where)}: {note}" for note, where in by_note.items()]


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int_list, default=[2, 4, 8], help="comma-separated, default 2,4,8")
    parser.add_argument("--layers", type=int_list, default=[2, 8, 32], help="comma-separated, default 2,8,32")
    parser.add_argument("--preset", help="a PRESETS entry of the case (e.g. llama3-8b); n_layers is overridden")
    parser.add_argument("--train", action="store_true", help="one training step of examples/llama_sp_train.py")
    parser.add_argument("--pipeline", action="store_true", help="one training step of examples/llama_pp.py")
    parser.add_argument("--markdown", action="store_true", help="emit markdown tables")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration, default 900")
    args = parser.parse_args(argv)
    args.mode = "pipeline" if args.pipeline else "train" if args.train else "forward"
    if args.preset is not None:
        _check_preset(parser, args.preset, CASES[args.mode])
    return args


def _check_preset(parser: argparse.ArgumentParser, preset: str, case: Path) -> None:
    """Fail before the sweep, not once per configuration, on an unknown preset."""
    from shardproof.case import load_case
    from shardproof.errors import CaseError

    try:
        load_case(case).use_preset(preset)
    except CaseError as err:
        parser.error(str(err))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    rows = []
    for layers in args.layers:
        for world_size in args.world_sizes:
            rows.append(run_configuration(world_size, layers, args.preset, args.timeout, args.mode))
            print(f"ws={world_size} layers={layers}: {rows[-1].verdict}", file=sys.stderr, flush=True)
    print(f"{CASES[args.mode].name} ({args.mode}), config {args.preset or 'CONFIG (small default)'} with n_layers overridden\n")
    print(render(HEADERS, [row.cells() for row in rows], args.markdown) + "\n")
    ratio_rows = [list(r) for r in ratios(rows)]
    if ratio_rows:
        print(render(["ratio", "at", "total", "proof"], ratio_rows, args.markdown))
    lines = notes(rows)
    if lines:
        print("\nVerdict notes:\n" + "\n".join(f"- {line}" for line in lines))


if __name__ == "__main__":
    main()
