"""Source locations: which line of user code issued each traced op."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx
from torch.fx.proxy import _register_stack_trace_anchor

from shardproof.ir.graph import Location

_TORCH_DIR = str(Path(torch.__file__).parent)
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')


def anchor_user_code(functions: list[Callable], case_dir: Path) -> None:
    """make_fx keeps only frames named `forward`; keep every frame of the user's own code too."""
    for fn in functions:
        _register_stack_trace_anchor(fn)
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not Path(path).resolve().is_relative_to(case_dir):
            continue
        for value in list(vars(module).values()):
            candidates = vars(value).values() if isinstance(value, type) else [value]
            for fn in candidates:
                if hasattr(fn, "__code__") and fn.__code__.co_filename == path:
                    _register_stack_trace_anchor(fn)


def locate(node: fx.Node) -> Location | None:
    """The innermost frame outside torch itself: the user's line that produced this op."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = [m for m in _FRAME.finditer(trace) if not m["file"].startswith(_TORCH_DIR)]
    if not frames:
        return None
    last = frames[-1]
    return Location(last["file"], int(last["line"]), last["code"].strip())
