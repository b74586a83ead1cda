"""Build one rank's state dict and inputs from the reference's, exactly as the checkpoint loader would.

The same functions run under fake tensors during capture (so the slicing becomes part of the traced
graph and its bugs are found too) and on real tensors in the numeric oracle.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardproof.case import Case
from shardproof.errors import CaseError
from shardproof.layouts import plain_layout, take


def module_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by qualified name: the leaves a model reads."""
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    return state


def rank_state(
    case: Case, ref_state: dict[str, torch.Tensor], dist_model: torch.nn.Module, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """This rank's state dict; plain shards are wrapped as DTensors where the model holds DTensors."""
    return as_model_holds(local_shards(case, ref_state, dist_model, rank, world_size), dist_model)


def local_shards(
    case: Case, ref_state: dict[str, torch.Tensor], dist_model: torch.nn.Module, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """This rank's plain tensors, in the model's state order: the checkpoint loader's work."""
    wanted = module_state(dist_model)
    if case.shard_state is not None:
        local = case.shard_state(ref_state, rank, world_size)
        unknown = sorted(set(local) - set(wanted))
        if unknown:
            raise CaseError(f"shard_state returned names the distributed model does not have: {unknown[:5]}")
        missing = sorted(set(wanted) - set(local))
        if missing:
            raise CaseError(f"shard_state did not return these tensors of the distributed model: {missing[:5]}")
        return {name: local[name] for name in wanted}
    return {name: _infer_shard(name, held, ref_state, rank, world_size, dist_model) for name, held in wanted.items()}


def as_model_holds(local: dict[str, torch.Tensor], dist_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Plain shards wrapped as DTensors where the model holds DTensors."""
    wanted = module_state(dist_model)
    wrapped: dict[int, torch.Tensor] = {}  # tied tensors (an embedding and its head) stay one tensor
    return {name: wrapped.setdefault(id(tensor), _as_model_holds(tensor, wanted[name])) for name, tensor in local.items()}


def rank_inputs(case: Case, ref_inputs: tuple, rank: int, world_size: int) -> tuple:
    if case.shard_input is None:
        return tuple(ref_inputs)
    return tuple(case.shard_input(i, x, rank, world_size) for i, x in enumerate(ref_inputs))


def _infer_shard(
    name: str, held: torch.Tensor, ref_state: dict[str, torch.Tensor], rank: int, world_size: int, model: torch.nn.Module
) -> torch.Tensor:
    """Default loader: same name in the reference; the layout from DTensor placements, or from the
    shapes by the rule the graph importers start from (`layouts.plain_layout`)."""
    if name not in ref_state:
        raise CaseError(
            f"cannot infer how `{name}` is built from the reference state: no reference tensor has that "
            "name. Define shard_state(ref_state, rank, world_size) in the case file."
        )
    full = ref_state[name]
    if isinstance(held, DTensor):
        return _dtensor_local(full, held, rank)
    layout = plain_layout(tuple(full.shape), tuple(held.shape), world_size)
    if layout is None:
        indivisible = [f"{f} (dim {d})" for d, (f, h) in enumerate(zip(full.shape, held.shape)) if f != h and f % world_size]
        why = f": {', '.join(indivisible)} is not divisible by world size {world_size}{_built_at(model, name)}" if indivisible else ""
        raise CaseError(
            f"cannot infer how `{name}` {tuple(held.shape)} is cut from the reference {tuple(full.shape)} "
            f"at world size {world_size}{why}. Use a world size that divides it, or define "
            "shard_state(ref_state, rank, world_size) in the case file."
        )
    return take(full, layout, rank, world_size)


def _built_at(model: torch.nn.Module, name: str) -> str:
    """` (built at model.py:12)`: the line of a class's code that assigns the module holding tensor
    `name` (`self.up = nn.Linear(...)` for `up.weight`), or the tensor itself (`self.weight = ...`);
    "" where no such line is found."""
    path = name.split(".")
    for owner, attribute in ((path[:-2], path[-2]), (path[:-1], path[-1])) if len(path) > 1 else (([], path[0]),):
        try:
            cls = type(model.get_submodule(".".join(owner)))
            lines, first = inspect.getsourcelines(cls)
            source = inspect.getsourcefile(cls)
        except (AttributeError, OSError, TypeError):
            continue
        for offset, line in enumerate(lines):
            if re.match(rf"\s*self\.{re.escape(attribute)}\s*(:[^=]*)?=[^=]", line):
                return f" (built at {Path(source).name}:{first + offset})"
    return ""


def _dtensor_local(full: torch.Tensor, held: DTensor, rank: int) -> torch.Tensor:
    """This rank's local tensor of `full` under `held`'s placements, cut mesh dim by mesh dim by
    DTensor's own arithmetic: torch.chunk's sizes, empty shards past the last chunk, and a
    `_StridedShard`'s rows (FSDP2 over TP: the dp shard of a TP shard, read right to left). Made
    contiguous, as DTensor's own shards are (FSDP2 views a local shard flat)."""
    mesh = held.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise CaseError(f"rank {rank} is not in the device mesh of a DTensor parameter")
    local = full
    for mesh_dim, placement in enumerate(held.placements):
        if isinstance(placement, _StridedShard):
            local = placement._select_split_tensor(
                local, mesh.size(mesh_dim), coordinate[mesh_dim], with_padding=False, contiguous=False, clone=False
            )
        elif isinstance(placement, Shard):
            size, offset = Shard.local_shard_size_and_offset(local.size(placement.dim), mesh.size(mesh_dim), coordinate[mesh_dim])
            local = local.narrow(placement.dim, offset, size)
    return local.contiguous()


def _as_model_holds(tensor: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    if isinstance(held, DTensor) and not isinstance(tensor, DTensor):
        return DTensor.from_local(
            tensor, held.device_mesh, held.placements, run_check=False, shape=held.shape, stride=held.stride()
        )
    return tensor
