"""Custom ops written in Python are traced through their implementation.

A library that defines an op in Python (spmd_types cuts a shard with `spmd_types::replicate_to_varying`,
torchtitan's loader calls it) hides plain torch code behind an opaque name: traced as one op, the
checkpoint loader would be a call nothing is known about. The code the op runs on the CPU is the
meaning of the op, so it is recorded in its place, as torch's decompositions are. Ops defined by
torch itself (`prims`) are left to torch's own tables. Ops declared with `torch.library.Library`
and given a CPU kernel in Python (FSDP2's `fsdp::all_gather_copy_in`, `split_with_sizes_copy`,
`chunk_cat`: the copies into and out of its flat collective buffers) are traced through that kernel
too, wherever they are defined: aten ops it calls take their place.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch._library.custom_ops import OPDEFS, CustomOpDef

_TORCH = torch.__name__ + "."


def implementations() -> dict[Any, Callable[..., Any]]:
    """Each Python custom op defined outside torch, by its overload: the function it runs on the CPU."""
    found = {}
    for opdef in list(OPDEFS.values()):
        kernel = kernel_of(opdef)
        if kernel is not None:
            found[opdef._opoverload] = kernel
    return {**_python_cpu_kernels(), **found}


def kernel_of(opdef: CustomOpDef) -> Callable[..., Any] | None:
    """The function a `torch.library.custom_op` defined outside torch runs on the CPU, if any."""
    kernel = opdef._backend_fns.get("cpu") or opdef._backend_fns.get(None)
    return None if kernel is None or opdef._init_fn.__module__.startswith(_TORCH) else kernel


_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
_TORCH_NAMESPACES = ("aten", "prims")


def _python_cpu_kernels() -> dict[Any, Callable[..., Any]]:
    """Each overload of an op outside aten and prims whose CPU kernel `torch.library` registered
    from Python (it records those in `_impls` as `namespace/name/key`): the kernel, reached by
    dispatching the op straight to the CPU key, so that the tracer records the ops it calls."""
    found = {}
    for entry in list(torch.library._impls):
        namespace, name, key = entry.split("/")
        if key != "CPU" or namespace in _TORCH_NAMESPACES:
            continue
        packet = getattr(getattr(torch.ops, namespace), name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            found[op] = functools.partial(op.redispatch, _CPU)
    return found
