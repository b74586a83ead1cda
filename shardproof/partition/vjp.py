"""A module call that gradients flow through, recorded apart from the trace: its forward and its VJP.

In a training trace a repeated module call cannot be traced once and copied: autograd would not
know the copies. `module_calls` runs such a call as one autograd Function instead, whose forward
and backward each record one opaque call. Their graphs are recorded here, once per kind, by the
light tracer on fresh tensors with the first call's metadata: the forward template maps the call's
flat inputs to its outputs, the VJP template maps (flat inputs, output gradients) to the gradients
of the inputs that require grad, by running the forward again and torch.autograd.grad through it.
So the VJP holds everything the module's own backward does (custom autograd Functions and the
collectives they issue included); what happens to the gradients after that (hooks on the
parameters, a step's all-reduce of them) runs in the trace as before.

A call is not recorded apart (it is traced inline, as without memoization) when its forward
writes into its inputs or its module's state, returns tensors sharing memory with its inputs,
outputs that do not require grad or non-plain data, reads a tensor that is not among its inputs
(a constant in the graph), or cannot be recorded at all (tensor subclasses).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from shardproof.capture.dispatch_trace import Decompositions, Traced, record, unrecorded
from shardproof.partition.fingerprint import PLAIN_DATA, module_key
from shardproof.state import module_state


@dataclass
class Recorded:
    """One graph recorded apart: its tensor outputs (for their metadata) and the ReduceOps of the
    in-place collectives it issued, in order."""

    graph: Traced
    outputs: list[torch.Tensor]
    reduce_ops: list[str]


@dataclass
class Apart:
    """The forward and the VJP of a module call; `graded[i]`: flat input i gets a gradient (the
    VJP's outputs are those gradients, in input order)."""

    forward: Recorded
    backward: Recorded
    graded: tuple[bool, ...]
    leaves: list[Any]  # the output's pytree leaves (tensors as recorded)
    spec: TreeSpec


class _Unfit(Exception):
    """The call does not meet the conditions in the module docstring."""


def record_apart(
    module: nn.Module,
    original: Callable,
    args: tuple,
    kwargs: dict,
    flat: list[torch.Tensor],
    reduce_ops: list[str],
    decompositions: Decompositions,
) -> Apart | None:
    """The call's forward and VJP recorded apart, or None where it must be traced inline. `flat` is
    the call's tensor arguments (pytree order), then its module's state (`module_state` order);
    `reduce_ops` is the trace's record of collective ReduceOps, left as it was."""
    in_leaves, in_spec = tree_flatten((args, kwargs))
    positions = [i for i, leaf in enumerate(in_leaves) if isinstance(leaf, torch.Tensor)]
    names = list(module_state(module))
    structure = module_key(module)
    outputs: list[Any] = []  # the last run's pytree leaves and spec
    graded: list[bool] = []

    def run(*tensors: torch.Tensor) -> list[torch.Tensor]:
        leaves = list(in_leaves)
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        call_args, call_kwargs = tree_unflatten(leaves, in_spec)
        versions = [t._version for t in tensors]
        with _reparametrize_module(module, dict(zip(names, tensors[len(positions) :]))):
            out = original(*call_args, **call_kwargs)
        out_leaves, out_spec = tree_flatten(out)
        result = [leaf for leaf in out_leaves if isinstance(leaf, torch.Tensor)]
        if (
            versions != [t._version for t in tensors]
            or not all(isinstance(leaf, (torch.Tensor, *PLAIN_DATA)) for leaf in out_leaves)
            or not all(t.requires_grad for t in result)
            or shares_memory(result, list(tensors))
        ):
            raise _Unfit
        outputs[:] = [out_leaves, out_spec]
        return result

    def vjp(*tensors: torch.Tensor) -> list[torch.Tensor]:
        inputs, output_grads = tensors[: len(flat)], tensors[len(flat) :]
        wanted = [t for t in inputs if t.requires_grad]
        found = iter(torch.autograd.grad(run(*inputs), wanted, output_grads, allow_unused=True))
        grads = [next(found) if t.requires_grad else None for t in inputs]
        graded[:] = [g is not None for g in grads]
        return [g for g in grads if g is not None]

    try:
        with disable_proxy_modes_tracing(), unrecorded():
            forward = _recorded(run, flat, reduce_ops, decompositions)
            blank = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in forward.outputs]
            backward = _recorded(vjp, [*flat, *blank], reduce_ops, decompositions)
    except Exception:  # noqa: BLE001 - anything the light tracer cannot take is traced inline, where it fails loudly
        return None
    if module_key(module) != structure:
        return None
    return Apart(forward, backward, tuple(graded), *outputs)


def _recorded(fn: Callable, inputs: list[torch.Tensor], reduce_ops: list[str], decompositions: Decompositions) -> Recorded:
    issued = len(reduce_ops)

    def forget() -> None:
        del reduce_ops[issued:]

    try:
        graph, outputs = record(fn, inputs, forget, decompositions, part=True, on_meta=False)
    finally:
        recorded = reduce_ops[issued:]
        forget()
    if any(node.op == "get_attr" for node in graph.graph.nodes):
        raise _Unfit  # a tensor from outside the call: its value is not one of the call's inputs
    return Recorded(graph, outputs, recorded)


def shares_memory(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> bool:
    storages = {t.untyped_storage()._cdata for t in inputs}
    return any(t.untyped_storage()._cdata in storages for t in outputs)
