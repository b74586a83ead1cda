"""Custom ops written in Python (`torch.library.custom_op`) are traced through their implementation.

A library that defines an op in Python (spmd_types cuts a shard with `spmd_types::replicate_to_varying`,
torchtitan's loader calls it) hides plain torch code behind an opaque name: traced as one op, the
checkpoint loader would be a call nothing is known about. The code the op runs on the CPU is the
meaning of the op, so it is recorded in its place, as torch's decompositions are. Ops defined by
torch itself (`prims`) are left to torch's own tables.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._library.custom_ops import OPDEFS

_TORCH = torch.__name__ + "."


def implementations() -> dict[Any, Callable[..., Any]]:
    """Each Python custom op defined outside torch, by its overload: the function it runs on the CPU."""
    found = {}
    for opdef in list(OPDEFS.values()):
        kernel = opdef._backend_fns.get("cpu") or opdef._backend_fns.get(None)
        if kernel is not None and not opdef._init_fn.__module__.startswith(_TORCH):
            found[opdef._opoverload] = kernel
    return found
