"""Higher-order ops (FlexAttention's `flex_attention`) run through their dense implementation.

A dispatch mode sees a higher-order op whole; the code it runs on the CPU in eager mode (torch's
`CompositeExplicitAutograd` kernel: FlexAttention's math, its score and mask functions plain
Python over aten ops) is its meaning. Running that kernel with the mode active hands the mode
those aten ops: the light tracer records them, the numeric oracle computes them in float64.
"""

from __future__ import annotations

from typing import Any

from torch._C import DispatchKey
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

from shardproof.errors import CaptureError


def is_higher_order(func: Any) -> bool:
    return isinstance(func, HigherOrderOperator)


def through_dense(mode: TorchDispatchMode, func: HigherOrderOperator, args: tuple, kwargs: dict) -> Any:
    """`func(*args, **kwargs)` as its dense implementation's ops, dispatched to `mode` (which must
    set `supports_higher_order_operators`)."""
    dense = func.py_kernels.get(DispatchKey.CompositeExplicitAutograd)
    if dense is None:
        raise CaptureError(f"the higher-order op `{func.name()}` has no dense implementation to run")
    with mode:
        return dense(*args, **kwargs)
