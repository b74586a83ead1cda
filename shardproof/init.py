"""`shardproof init`: write a commented case file to start from, which verifies as written.

Without a model it is a two-layer MLP split the Megatron way by hand (column- then row-parallel,
one all-reduce). With `--model pkg.module:Class` the reference is that class and each rank holds
it parallelised by DTensor's `parallelize_module` with a plan to fill in: empty, every rank holds a
replica (equivalent, and nothing distributed yet); the linear layers found are listed beside it.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from shardproof.errors import CaseError

HEADER = '''"""A shardproof case: `shardproof verify {name}` proves that `distributed` computes what `reference`
does on every rank (README: "The case file"). Written by `shardproof init`; edit every part."""

import torch
import torch.distributed as dist
'''

MLP = HEADER + '''
WORLD_SIZE = 2  # ranks proven by default; `--world-size N` overrides
HIDDEN, FFN = 16, 64  # the world size must divide FFN


class MLP(torch.nn.Module):
    def __init__(self, ffn: int = FFN):
        super().__init__()
        self.up = torch.nn.Linear(HIDDEN, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, HIDDEN, bias=False)

    def forward(self, x):
        y = self.down(torch.relu(self.up(x)))
        if dist.is_initialized():  # the row-parallel half: each rank holds a partial sum
            dist.all_reduce(y)
        return y


def reference() -> torch.nn.Module:
    """The single-device model."""
    return MLP()


def distributed(rank: int, world_size: int) -> torch.nn.Module:
    """This rank's model (a fake process group for `rank` is set up first)."""
    return MLP(ffn=FFN // world_size)


def shard_state(ref_state: dict, rank: int, world_size: int) -> dict:
    """This rank's state dict, cut from the reference's as your checkpoint loader does. Optional:
    without it, a tensor one dim `world_size` times smaller is chunk `rank` of that dim."""
    return {
        "up.weight": ref_state["up.weight"].chunk(world_size, dim=0)[rank],  # column-parallel: rows
        "down.weight": ref_state["down.weight"].chunk(world_size, dim=1)[rank],  # row-parallel: columns
    }


def inputs() -> tuple:
    """The reference's inputs: only their shapes and dtypes matter."""
    return (torch.randn(4, HIDDEN),)
'''

MODEL = HEADER + '''from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: F401

from {module} import {cls}

WORLD_SIZE = 2  # ranks proven by default; `--world-size N` overrides

# Which submodule each rank splits, and how: e.g. {{"up": ColwiseParallel(), "down": RowwiseParallel()}}.
# Empty, every rank holds a replica. Linear layers of {cls}: {linears}
PLAN: dict = {{}}


def reference() -> torch.nn.Module:
    """The single-device model."""
    return {cls}({arguments})


def distributed(rank: int, world_size: int) -> torch.nn.Module:
    """This rank's model, parallelised by the plan (a fake process group for `rank` is set up first).
    Its state is cut from the reference's by the DTensor placements the plan gives it."""
    mesh = init_device_mesh("cpu", (world_size,))
    return parallelize_module({cls}({arguments}), mesh, PLAN)


def inputs() -> tuple:
    """The reference's inputs: only their shapes and dtypes matter. TODO: {cls}'s forward takes {forward}."""
    return (torch.randn(4, 16),)
'''


def write_template(path: str, model: str | None = None, force: bool = False) -> int:
    """Write the template to `path`; say what to do next. Refuses to overwrite without `force`."""
    target = Path(path)
    if target.is_dir() or (target.exists() and not force):
        raise CaseError(f"{target} already exists; choose another path, or --force to overwrite it")
    if not target.parent.is_dir():
        raise CaseError(f"directory {target.parent} does not exist")
    text = MLP.replace("{name}", target.name) if model is None else _from_model(model, target.name)
    target.write_text(text)
    print(f"wrote {target}: edit it, then run `shardproof verify {target}`")
    return 0


def _from_model(spec: str, name: str) -> str:
    """The template around `pkg.module:Class`, which must import and be a torch module."""
    import torch

    module_name, _, cls_name = spec.partition(":")
    if not module_name or not cls_name:
        raise CaseError(f"--model {spec}: give it as pkg.module:Class")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as err:
        raise CaseError(f"--model {spec}: cannot import it ({type(err).__name__}: {err})") from err
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise CaseError(f"--model {spec}: not a torch.nn.Module class")
    required = [p.name for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    arguments = ", ".join(f"{p}=...  # TODO" for p in required) if required else ""
    return MODEL.format(name=name, module=module_name, cls=cls_name, arguments=arguments, linears=_linears(cls, required),
                        forward=str(inspect.signature(cls.forward)).replace("(self, ", "(").replace("(self)", "()"))


def _linears(cls: type, required: list[str]) -> str:
    """The names of the class's linear layers, when it builds without arguments (on the meta device)."""
    import torch

    if required:
        return "(build it to list them)"
    with torch.device("meta"):
        names = [n for n, m in cls().named_modules() if isinstance(m, torch.nn.Linear)]
    return ", ".join(names) or "none"
