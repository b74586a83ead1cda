"""DeviceMesh under capture: built on real tensors, and one identity per simulated rank.

A DeviceMesh keeps its rank map as a tensor and reads it back with `.tolist()`; under
FakeTensorMode that read is data-dependent and fails. The rank map is a handful of ints, so the
torch calls issued by torch's own mesh code run with fake mode unset, whichever way the user makes
the mesh (`init_device_mesh`, `DeviceMesh(...)`, slicing, flattening). Everything else, parameters
included, stays fake: nothing of the model's size is allocated.

Capture simulates every rank in one process, one after another. Meshes of different ranks compare
equal (equality ignores the rank), so DTensor's caches (sharding propagation, redistribute plans)
would hand rank 1 specs holding rank 0's mesh, and with it rank 0's coordinate: rank 1 would then
trace rank 0's shards. torch separates the ranks of its threaded process group by stamping each
mesh with its thread id; `distinct_meshes` stamps each simulated rank's meshes the same way.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
from typing import Any, Callable, Iterator

import torch.distributed._mesh_layout as mesh_layout
import torch.distributed.device_mesh as device_mesh
import torch.distributed.tensor._utils as dtensor_utils
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes

_MESH_FILES = frozenset({device_mesh.__file__, mesh_layout.__file__})
_SESSIONS = itertools.count(1)


class RealDeviceMeshes(TorchFunctionMode):
    """Run torch functions called from DeviceMesh code outside fake mode (enter inside fake mode)."""

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not _called_from_mesh_code():
            return func(*args, **kwargs)
        with unset_fake_temporarily():
            return func(*args, **kwargs)


def _called_from_mesh_code() -> bool:
    """Mesh code anywhere up the stack: its direct callee may be another mode (torch.device(...))."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename in _MESH_FILES:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def distinct_meshes() -> Iterator[None]:
    """Meshes made inside compare unequal to every mesh made outside (see the module docstring)."""
    stamp = -next(_SESSIONS)  # thread ids are positive: never equal to a threaded-backend mesh
    original = DeviceMesh.__init__

    def init(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self._thread_id = stamp

    DeviceMesh.__init__ = init
    try:
        yield
    finally:
        DeviceMesh.__init__ = original


@contextlib.contextmanager
def real_shard_offsets() -> Iterator[None]:
    """DTensor's shard offsets (`compute_local_shape_and_global_offset`, which a checkpoint loader
    asks for each parameter) computed on real tensors: torch works them out with a few small int
    tensors and reads one back with `int()`, a data-dependent read under fake mode. They are
    metadata, so neither fake mode nor a tracer sees them."""
    original = dtensor_utils._compute_local_shape_and_global_offset

    def compute(*args: Any, **kwargs: Any) -> Any:
        with _disable_current_modes():
            return original(*args, **kwargs)

    dtensor_utils._compute_local_shape_and_global_offset = compute
    try:
        yield
    finally:
        dtensor_utils._compute_local_shape_and_global_offset = original
