"""bench/startup.py prints a row per command; and the command line reads its arguments before
importing torch (the reason `--help` is quick: its time is measured in the bench, not here)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_the_bench_prints_a_row_per_command(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    bench = importlib.import_module("startup")
    monkeypatch.setattr(sys, "argv", ["startup.py", "--repeat", "1"])
    bench.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows[1:]] == list(bench.COMMANDS)


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["verify", "--help"], ["verify-graphs", "--help"]])
def test_help_and_version_never_import_torch(argv: list[str]) -> None:
    probe = f"import sys\nfrom shardproof.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n" \
            "sys.stderr.write(str(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stderr.endswith("[]"), done.stderr
