"""Benchmark start-up: wall seconds of `shardproof --help`, `shardproof --version` and
`python -m shardproof --help` (no torch import), beside `python -c pass` and `import torch` for
scale. Each command runs `--repeat` times in a fresh process; the table shows the median and the
slowest run, then each command's median over Python's own start-up.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time

COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "shardproof --help": [shutil.which("shardproof") or "shardproof", "--help"],
    "shardproof --version": [shutil.which("shardproof") or "shardproof", "--version"],
    "python -m shardproof --help": [sys.executable, "-m", "shardproof", "--help"],
    "import torch": [sys.executable, "-c", "import torch"],
}


def _seconds(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (default 5)")
    args = parser.parse_args()
    rows = {name: [_seconds(command) for _ in range(args.repeat)] for name, command in COMMANDS.items()}
    python = statistics.median(rows["python -c pass"])
    print("| command | median s | slowest s | median / python's start-up |\n| --- | --- | --- | --- |")
    for name, times in rows.items():
        print(f"| {name} | {statistics.median(times):.3f} | {max(times):.3f} | {statistics.median(times) / python:.1f}x |")


if __name__ == "__main__":
    main()
