"""A verification case: the reference model, the per-rank model and how state and inputs are split.

A case file is a Python module with the v1 contract (see README). Loading it never runs the
models; it only checks that the required parts exist so a mistake is reported before tracing.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

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


def normalize_output(output: Any) -> Output:
    """Accept `"replicate"`, `("shard", dim)` or `("replicate",)`; reject anything else early."""
    if output == "replicate" or output == ("replicate",):
        return ("replicate",)
    if isinstance(output, (tuple, list)) and len(output) == 2 and output[0] == "shard":
        return ("shard", int(output[1]))
    raise CaseError(f"OUTPUT must be 'replicate' or ('shard', dim), got {output!r}")


def load_case(path: str | Path) -> Case:
    """Import a case file and check its contract, turning every failure into a CaseError."""
    path = case_file(path)
    module = _import_file(path)
    missing = [name for name in ("reference", "distributed", "inputs") if not callable(getattr(module, name, None))]
    if missing:
        raise CaseError(
            f"{path}: missing required function(s) {', '.join(missing)}; a case file defines "
            "reference(), distributed(rank, world_size) and inputs()"
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
        spec.loader.exec_module(module)
    except SyntaxError as err:
        raise CaseError(f"{err.filename}:{err.lineno}: syntax error in case file: {err.msg}") from err
    except Exception as err:  # noqa: BLE001 - any import-time failure is the user's to fix
        raise CaseError(f"{path}: importing the case file failed: {type(err).__name__}: {err}") from err
    return module
