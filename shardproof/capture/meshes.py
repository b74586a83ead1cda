"""Device meshes built on real tensors while the models themselves are built on fake ones.

A DeviceMesh keeps its rank map as a tensor and reads it back with `.tolist()`; under
FakeTensorMode that read is data-dependent and fails. The rank map is a handful of ints, so the
torch calls issued by torch's own mesh code run with fake mode unset, whichever way the user makes
the mesh (`init_device_mesh`, `DeviceMesh(...)`, slicing, flattening). Everything else, parameters
included, stays fake: nothing of the model's size is allocated.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch.distributed._mesh_layout as mesh_layout
import torch.distributed.device_mesh as device_mesh
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.overrides import TorchFunctionMode

_MESH_FILES = frozenset({device_mesh.__file__, mesh_layout.__file__})


class RealDeviceMeshes(TorchFunctionMode):
    """Run torch functions called from DeviceMesh code outside fake mode (enter inside fake mode)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _called_from_mesh_code():
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def _called_from_mesh_code() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _MESH_FILES:
            return True
        frame = frame.f_back
    return False
