"""Input paths checked before any work, with messages that say what is wrong with them. Standard
library only: the command line checks its arguments before it imports torch."""

from __future__ import annotations

from pathlib import Path

from shardproof.errors import CaseError


def case_file(path: str | Path) -> Path:
    """The path of a readable case file, or a CaseError saying what it is instead."""
    path = Path(path)
    if path.is_dir():
        raise CaseError(f"{path} is a directory; give the path of a case file (a .py file defining reference(), "
                        "distributed() and inputs(); `shardproof init` writes one)")
    if not path.exists():
        raise CaseError(f"case file not found: {path}")
    try:
        path.open("rb").close()
    except OSError as err:
        raise CaseError(f"case file {path} cannot be read: {err.strerror}") from err
    return path
