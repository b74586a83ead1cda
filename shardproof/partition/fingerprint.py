"""When two module calls are interchangeable: they record the same ops, up to which tensors they read.

Under fake tensors, the ops a module call records are a function of
  1. the code that runs: the classes of the module and of every submodule, and any instance-level
     `forward` (a framework's wrapper: its code and what it closes over, its own module by
     position); modules with hooks are never interchangeable (hooks are arbitrary code);
  2. the module tree's other state: every attribute that is not a parameter, buffer or submodule
     (sizes, flags, configs, `training`);
  3. the metadata of every tensor the call reads: its tensor arguments and the tree's parameters
     and buffers (shape, stride, storage offset, dtype, device, requires_grad), and which of them
     are the very same tensor object; for a DTensor, in a call nothing differentiates through,
     also its mesh (by identity) and placements: DTensor's dispatch depends on nothing else, and
     the call reads its local tensor;
  4. its non-tensor arguments;
  5. ambient state: grad mode, inference mode, default dtype (in the key), and the process group,
     fixed for a whole trace (one key space per trace, so never shared between ranks).
Two calls with equal keys record the same graph; a copy's graph is the first call's graph applied
to the copy's tensors. Plain data (numbers, strings, tuples, lists, dicts, sets, dataclasses,
enums, dtypes, devices) is compared by value; anything else (other functions and objects, plain
tensor attributes, other tensor subclasses) by identity or not at all, so two different objects
never look alike: that only costs a memo miss.

Not checkable, hence assumed: a forward does not read mutable state outside its module and
arguments that changes from one call to the next (a global layer counter, say). What can be checked
is checked by `module_calls`: the first call must leave the module's own state unchanged, must not
write into its inputs and must return fresh tensors.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from typing import Any, Hashable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from shardproof.ir.rank_expr import RankExpr
from shardproof.state import module_state

MAX_DEPTH = 6  # plain data nested deeper than this is compared by identity
PLAIN_DATA = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size, torch.layout)
_PLAIN_TENSORS = (torch.Tensor, nn.Parameter, FakeTensor)
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) - {"training"}
_HOOKS = tuple(name for name in _MODULE_INTERNALS if "hook" in name)
_GLOBAL_HOOKS = [
    getattr(nn.modules.module, name)
    for name in dir(nn.modules.module)
    if name.startswith("_global_") and name.endswith("hooks")
]
WRAPPED = "_shardproof_original_forward"  # set on the forward wrappers of module_calls
_fields: dict[type, tuple[str, ...]] = {}
_UNSET = object()  # a dataclass field never set (declared with init=False, no default)


def value_key(value: Any, depth: int = 0) -> Hashable:
    """Equal keys for equal plain data; identity for everything else."""
    if type(value) is RankExpr:  # a symbolic rank's offset (capture/symbolic_rank): by its form
        return ("rank", value.form)
    if isinstance(value, PLAIN_DATA):
        return (type(value).__name__, value)
    if depth >= MAX_DEPTH:
        return ("id", id(value))
    if isinstance(value, enum.Enum):
        return ("enum", type(value), value.value)
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(value_key(v, depth + 1) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((value_key(k, depth + 1), value_key(v, depth + 1)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(value_key(v, depth + 1) for v in value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = _fields.get(type(value))
        if names is None:
            names = _fields[type(value)] = tuple(f.name for f in dataclasses.fields(value))
        return ("dataclass", type(value), tuple(value_key(getattr(value, n, _UNSET), depth + 1) for n in names))
    return ("id", id(value))


def tensor_key(tensor: torch.Tensor, distributed: bool = False) -> Hashable | None:
    """Everything about a tensor that can change the ops traced on it; None for subclasses, but
    for a DTensor where `distributed` (see `read_tensor`); None for a tensor with hooks (arbitrary
    code, as a module's: a gradient all-reduce a TP plan hangs on a replicated parameter)."""
    if getattr(tensor, "_backward_hooks", None) or getattr(tensor, "_post_accumulate_grad_hooks", None):
        return None
    if type(tensor) is DTensor and distributed:
        spec = tensor._spec
        return ("dtensor", id(spec.mesh), tuple(spec.placements), _plain_key(tensor), _plain_key(tensor._local_tensor))
    if type(tensor) not in _PLAIN_TENSORS:
        return None
    return _plain_key(tensor)


def _plain_key(tensor: torch.Tensor) -> Hashable:
    return (
        tuple(tensor.shape),
        tuple(tensor.stride()),
        tensor.storage_offset(),
        tensor.dtype,
        tensor.device.type,
        tensor.requires_grad,
    )


def read_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor a call's ops read: a DTensor's ops run on its local tensor (under DTensor's
    dispatch, which its mesh, placements and global metadata decide: all in its key)."""
    return tensor._local_tensor if type(tensor) is DTensor else tensor


def module_key(module: nn.Module, known: dict[int, Hashable] | None = None) -> Hashable | None:
    """Code and non-tensor state of a module tree; None if any part of it has hooks. `known`
    caches the keys of subtrees by module id (for one unchanged tree)."""
    if known is not None and id(module) in known:
        return known[id(module)]
    key = _module_key(module, known)
    if known is not None:
        known[id(module)] = key
    return key


def _module_key(module: nn.Module, known: dict[int, Hashable] | None) -> Hashable | None:
    if any(getattr(module, name) for name in _HOOKS):
        return None
    attrs = []
    for name, value in vars(module).items():
        if name in _MODULE_INTERNALS or (name == "forward" and hasattr(value, WRAPPED)):
            continue
        attrs.append((name, _attribute_key(value, module)))
    children = []
    for name, child in module.named_children():
        key = module_key(child, known)
        if key is None:
            return None
        children.append((name, key))
    return (type(module), tuple(attrs), tuple(children))


def _attribute_key(value: Any, owner: nn.Module) -> Hashable:
    """A module attribute's key; a function (an instance-level `forward` a framework installed, a
    closure over its module) by its code and what it closes over, the module itself by position:
    two modules' closures of one code over equal values run the same ops. A mutable container
    closed over is state a call may change (transformers' record of the parameters it hooked):
    by identity."""
    if isinstance(value, types.MethodType) and value.__self__ is owner:
        return ("own method", value.__func__)
    if not isinstance(value, types.FunctionType):
        return value_key(value)
    cells = []
    for cell in value.__closure__ or ():
        try:
            held = cell.cell_contents
        except ValueError:  # not yet assigned
            held = _UNSET
        if held is owner:
            cells.append(("owner",))
        elif isinstance(held, (dict, list, set, bytearray)):  # the closure's own mutable state
            cells.append(("id", id(held)))
        else:
            cells.append(_attribute_key(held, owner) if callable(held) else value_key(held))
    return ("function", value.__code__, tuple(cells), value_key(value.__defaults__), value_key(value.__kwdefaults__))


def call_key(
    module: nn.Module, args: tuple, kwargs: dict, distributed: bool = False
) -> tuple[Hashable, list[torch.Tensor]] | None:
    """(key, flat tensors the call reads) for a call of `module`, or None if no copy may stand in for it.

    The flat tensors are the arguments' tensors in pytree order, then the module tree's state in
    `module_state` order: a copy's graph is bound to them position by position. `distributed`:
    DTensors are keyed too, and their local tensors are the ones read (a call recorded below
    autograd: nothing differentiates through its copies)."""
    if any(_GLOBAL_HOOKS):
        return None
    structure = module_key(module)
    if structure is None:
        return None
    leaves, spec = tree_flatten((args, kwargs))
    state = module_state(module)
    flat, leaf_keys = [], []
    for leaf in [*leaves, *state.values()]:
        if isinstance(leaf, torch.Tensor):
            meta = tensor_key(leaf, distributed)
            if meta is None:
                return None
            flat.append(read_tensor(leaf))
            leaf_keys.append(meta)
        else:
            leaf_keys.append(value_key(leaf))
    first: dict[int, int] = {}
    same = tuple(first.setdefault(id(t), i) for i, t in enumerate(flat))
    ambient = (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.get_default_dtype())
    return (structure, str(spec), tuple(state), tuple(leaf_keys), same, ambient), flat
