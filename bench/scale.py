"""Scale: Llama-3.1-405B shapes (examples/llama_tp.py, preset llama3.1-405b) over world sizes and depths.

Sweeps of issue 5: world sizes 8, 16, 64 at the full 126 layers, and depths 1, 2, 4, 8, 16, 32, 126
at TP=8. Each configuration runs twice, each time in a fresh spawned child (so peak RSS is its
own): with memoization (the default) and without it (every layer traced and proven), the latter
bounded by --baseline-timeout. Prints one table, then the ratios the issues set targets for, in
CPU seconds (wall seconds on a shared machine measure its load).
`--train`: the same sweeps for one training step (loss and every gradient) of the same case;
`--preset llama3.1-405b-kv64` (64 kv heads) trains at 64 ranks. `--case examples/deepseek_v3.py
--preset deepseek-v3 --layers 61`: DeepSeek-V3's shapes (issue 12: 64 ranks under 60 s, 4 GiB).
Run `python bench/scale.py --help`; columns are described in bench/README.md.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from verify_llama import EXAMPLES, Row, fmt, int_list, render, run_configuration  # noqa: E402

PRESET = "llama3.1-405b"
CASE = EXAMPLES / "llama_tp.py"
HEADERS = [
    "sweep", "ws", "layers", "verdict", "capture s", "proof s", "total s", "cpu s", "peak MiB", "memo hits",
    "no-memo s", "no-memo / memo",
]  # fmt: skip
LIMITS = (60.0, 4096.0)  # issue 12: CPU seconds and peak MiB of the largest world size at full depth


@dataclass
class Measured:
    sweep: str
    memo: Row
    baseline: Row  # the same configuration without memoization
    limit: float  # the baseline's timeout

    def cells(self) -> list[str]:
        m = self.memo
        return [
            self.sweep, str(m.world_size), str(m.layers), m.verdict,
            fmt(m.capture, ".2f"), fmt(m.proof, ".2f"), fmt(m.total, ".2f"), fmt(m.cpu, ".2f"), fmt(m.peak_mib, ".0f"),
            hit_rate(m), _baseline_seconds(self), speedup(self),
        ]  # fmt: skip


def hit_rate(row: Row) -> str:
    """Calls answered from an earlier proof, of all repeated-module calls."""
    if row.calls_proven is None or row.calls_reused is None or row.calls_proven + row.calls_reused == 0:
        return "-"
    calls = row.calls_proven + row.calls_reused
    return f"{row.calls_reused / calls:.0%} of {calls}"


def _baseline_seconds(measured: Measured) -> str:
    if measured.baseline.verdict == "timeout":
        return f"> {measured.limit:.0f}"
    return fmt(measured.baseline.total, ".1f")


def speedup(measured: Measured) -> str:
    memo, base = measured.memo, measured.baseline
    if memo.total is None:
        return "-"
    if base.verdict == "timeout":
        return f"> {measured.limit / memo.total:.1f}x"
    return "-" if base.total is None else f"{base.total / memo.total:.1f}x"


def targets(depth: int, world_sizes: list[int]) -> list[tuple[str, tuple[int, int], tuple[int, int], float]]:
    """(what, numerator (ws, layers), denominator, target ratio of CPU seconds)."""
    widest = max(world_sizes)
    return [
        (f"depth: {depth} layers / 8 layers", (8, depth), (8, 8), 3.0),
        (f"world size: {widest} / 8", (widest, depth), (8, depth), 1.15),
    ]


def target_lines(measured: list[Measured], depth: int, world_sizes: list[int]) -> list[list[str]]:
    timed = {(m.memo.world_size, m.memo.layers): m.memo for m in measured if m.memo.cpu is not None}
    lines = []
    for what, num, den, target in targets(depth, world_sizes):
        if num in timed and den in timed and num != den:
            ratio = timed[num].cpu / timed[den].cpu
            lines.append([what, f"{ratio:.2f}x", f"< {target}x", "met" if ratio < target else "not met"])
    widest = timed.get((max(world_sizes), depth))
    if widest is not None and widest.peak_mib is not None:
        seconds, mib = LIMITS
        within = widest.cpu < seconds and widest.peak_mib < mib and widest.verdict == "equivalent"
        lines.append([f"ws {widest.world_size}: cpu s, peak MiB", f"{widest.cpu:.1f} s, {widest.peak_mib:.0f} MiB",
                      f"< {seconds:.0f} s, {mib:.0f} MiB", "met" if within else "not met"])
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int_list, default=[8, 16, 64], help="at full depth; default 8,16,64")
    parser.add_argument("--depths", type=int_list, default=[1, 2, 4, 8, 16, 32, 126], help="at TP=8")
    parser.add_argument("--layers", type=int, default=126, help="full depth, of the world-size sweep (default 126)")
    parser.add_argument("--case", type=Path, default=CASE, help=f"the case file (default {CASE.relative_to(CASE.parents[1])})")
    parser.add_argument("--baseline-timeout", type=float, default=600.0, help="seconds for a run without memoization")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for a run with memoization")
    parser.add_argument("--backend", default="none", help="where ranks are traced (default: in the child itself)")
    parser.add_argument("--preset", default=PRESET, help=f"a PRESETS entry of the case (default {PRESET}); n_layers overridden")
    parser.add_argument("--batch", type=int, help="override the preset's batch size (its shapes otherwise)")
    parser.add_argument("--train", action="store_true", help="one training step instead of the forward")
    parser.add_argument("--markdown", action="store_true", help="emit markdown tables")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    plan: dict[tuple[int, int], list[str]] = {}  # (ws, layers) -> the sweeps it belongs to
    for ws in args.world_sizes:
        plan.setdefault((ws, args.layers), []).append("ws")
    for layers in args.depths:
        plan.setdefault((8, layers), []).append("depth")
    measured = []
    for (ws, layers), sweeps in plan.items():
        sweep = "+".join(sweeps)
        options = {"backend": args.backend, "batch": args.batch, "mode": "train" if args.train else "forward", "case_file": args.case}
        memo = run_configuration(ws, layers, args.preset, args.timeout, memo=True, **options)
        base = run_configuration(ws, layers, args.preset, args.baseline_timeout, memo=False, **options)
        measured.append(Measured(sweep, memo, base, args.baseline_timeout))
        print(f"{sweep} ws={ws} layers={layers}: {memo.verdict} {fmt(memo.total, '.1f')} s", file=sys.stderr, flush=True)
    batch = f", batch {args.batch}" if args.batch else ""
    step = ", one training step" if args.train else ""
    print(f"{args.case.name}{step}, preset {args.preset}, n_layers overridden{batch}; backend {args.backend}\n")
    print(render(HEADERS, [m.cells() for m in measured], args.markdown) + "\n")
    lines = target_lines(measured, args.layers, args.world_sizes)
    if lines:
        print(render(["target", "measured", "goal", ""], lines, args.markdown))


if __name__ == "__main__":
    main()
