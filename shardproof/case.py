"""A verification case: the reference model, the per-rank model and how state and inputs are split.

A case file is a Python module with the v1 contract (see README). Loading it never runs the
models; it only checks that the required parts exist so a mistake is reported before tracing. As
under `python case.py`, the file's folder is importable while it loads and while its functions run
(`Case.importable`), so a case may import the modules next to it.
"""

from __future__ import annotations


import hashlib
import importlib.util
import os
import sys
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator

import torch

from shardproof.errors import CaseError
from shardproof.paths import case_file
from shardproof.programs import Output

MODES = ("forward", "train", "step")  # what is proven: outputs; loss and gradients; also the updated parameters


@dataclass
class Case:
    """Everything shardproof needs to know about one reference/distributed pair."""

    reference: Callable[[], torch.nn.Module]
    distributed: Callable[[int, int], torch.nn.Module]
    inputs: Callable[[], tuple]
    world_size: int = 2
    shard_state: Callable[[dict, int, int], dict] | None = None
    shard_input: Callable[[int, torch.Tensor, int, int], torch.Tensor] | None = None
    output: Output = ("replicate",)
    loss: Callable[..., torch.Tensor] | None = None  # training mode: loss(output, *inputs)
    distributed_step: Callable[..., torch.Tensor] | None = None  # the user's own training step
    optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None
    mode: str = "forward"  # default for the CLI's --train / --step
    source: Path | None = None
    module: ModuleType | None = None

    def output_layout(self) -> Output:
        return normalize_output(self.output)

    def resolve_mode(self, train: bool = False, step: bool = False) -> str:
        """The flags win over the case's MODE; `step` implies training."""
        return "step" if step else "train" if train and self.mode != "step" else self.mode

    def use_preset(self, name: str) -> None:
        """Set the case module's CONFIG to PRESETS[name] (case functions read CONFIG when called)."""
        presets = getattr(self.module, "PRESETS", None) or {}
        if name not in presets:
            known = ", ".join(sorted(presets)) or "none"
            raise CaseError(f"unknown preset `{name}` (this case file has: {known})")
        self.module.CONFIG = presets[name]

    def importable(self) -> AbstractContextManager[None]:
        """While in this context the case file's folder is on sys.path: tracing, the oracle and the
        pool's workers call the case's functions long after it loaded, and they may import then."""
        return folder_on_path(None if self.source is None else self.source.parent)


@contextmanager
def folder_on_path(folder: Path | None) -> Iterator[None]:
    """`folder` first on sys.path (unless it is there already), removed again on leaving, with the
    modules imported from it in sys.modules."""
    entry = None if folder is None else str(folder)
    added = entry is not None and entry not in sys.path
    if entry is not None:
        _own_neighbours(entry)
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def normalize_output(output: Any) -> Output:
    """Accept `"replicate"`, `("shard", dim)`, `("shard", dim, "zigzag")` or `("replicate",)`;
    reject anything else early."""
    if output == "replicate" or output == ("replicate",):
        return ("replicate",)
    if isinstance(output, (tuple, list)) and len(output) == 2 and output[0] == "shard":
        return ("shard", int(output[1]))
    spelled = tuple(output) if isinstance(output, (tuple, list)) else ()
    if len(spelled) == 3 and spelled[::2] == ("shard", "zigzag") or len(spelled) == 2 and spelled[0] == "zigzag":
        return ("zigzag", int(spelled[1]))  # (the normalized form, read again, too)
    raise CaseError(f"OUTPUT must be 'replicate', ('shard', dim) or ('shard', dim, 'zigzag'), got {output!r}")


def load_case(path: str | Path) -> Case:
    """Import a case file and check its contract, turning every failure into a CaseError."""
    path = case_file(path)
    module = _import_file(path)
    built = getattr(module, "CASE", None)
    if built is not None:  # a case an integration built: `CASE = transformers_case(config)`
        if not isinstance(built, Case):
            raise CaseError(f"{path}: CASE must be a Case (as shardproof.integrations' functions return), "
                            f"got {type(built).__name__}")
        return replace(built, source=path.resolve(), module=module)  # its folder importable, as for functions
    missing = [name for name in ("reference", "distributed", "inputs") if not callable(getattr(module, name, None))]
    if missing:
        raise CaseError(
            f"{path}: missing required function(s) {', '.join(missing)}; a case file defines "
            "reference(), distributed(rank, world_size) and inputs() (or CASE, a Case built by an integration)"
        )
    return Case(
        reference=module.reference,
        distributed=module.distributed,
        inputs=module.inputs,
        world_size=int(getattr(module, "WORLD_SIZE", 2)),
        shard_state=getattr(module, "shard_state", None),
        shard_input=getattr(module, "shard_input", None),
        output=normalize_output(getattr(module, "OUTPUT", "replicate")),
        loss=getattr(module, "loss", None),
        distributed_step=getattr(module, "distributed_step", None),
        optimizer=getattr(module, "optimizer", None),
        mode=_mode(getattr(module, "MODE", "forward")),
        source=path.resolve(),
        module=module,
    )


def _mode(mode: Any) -> str:
    if mode not in MODES:
        raise CaseError(f"MODE must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def _import_file(path: Path) -> ModuleType:
    # named from the path alone (not hash(), which differs between processes), so a worker process
    # importing the same file gives its classes the same qualified names (pickling needs that)
    name = f"shardproof_case_{hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:16]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise CaseError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with folder_on_path(path.resolve().parent):
            spec.loader.exec_module(module)
    except SyntaxError as err:
        raise CaseError(f"{err.filename}:{err.lineno}: syntax error in case file: {err.msg}") from err
    except Exception as err:  # noqa: BLE001 - any import-time failure is the user's to fix
        raise CaseError(f"{path}: importing the case file failed: {type(err).__name__}: {err}") from err
    return module


_NEIGHBOURS: dict[str, dict[str, ModuleType]] = {}  # case folder -> the modules imported from it


def _own_neighbours(folder: str) -> None:
    """Put away the modules imported from other case folders and bring back this folder's, so that
    `from _helpers import f` finds this case's `_helpers.py` (the same module object each time),
    not that of another case loaded before."""
    _NEIGHBOURS.setdefault(folder, {})
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None)
        owner = where and os.path.dirname(where)
        if owner in _NEIGHBOURS and not name.startswith("shardproof_case_"):
            _NEIGHBOURS[owner][name] = module
            if owner != folder:
                del sys.modules[name]
    for name, module in _NEIGHBOURS[folder].items():
        sys.modules.setdefault(name, module)
