"""shardproof: prove a distributed model computes what its single-device reference does.

The names below import torch when first used, not when the package is imported, so that the
command line answers `--help` and `--version` at once.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardproof.api import verify
    from shardproof.importers.verify import verify_graphs
    from shardproof.report.model import Report

__all__ = ["verify", "verify_graphs", "Report"]
_HOMES = {"verify": "shardproof.api", "verify_graphs": "shardproof.importers.verify", "Report": "shardproof.report.model"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'shardproof' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
