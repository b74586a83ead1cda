"""Source locations: which line of user code issued each traced op.

An op that autograd's C++ engine emits for a backward formula has no user frame of its own; it is
located at the forward op it differentiates (matched by autograd sequence number) and marked as a
backward op. A tensor subclass (DTensor) may create further autograd nodes while it runs the op,
before the first traced op, so the forward op of node n is the first one traced with number >= n.
Backward code the user wrote (custom autograd Functions, gradient hooks) keeps its own line.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import linecache
import os
import re
import sys
import sysconfig
import traceback
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
import typing_extensions
from torch.fx.experimental.proxy_tensor import PythonKeyTracer

from shardproof.ir.graph import Location

_TORCH_DIR = str(Path(torch.__file__).parent) + os.sep
# torch's files, shardproof's own, and typing_extensions (its `deprecated` wrapper sits between a
# user's line and torch's deprecated collectives)
_TOOLS = (_TORCH_DIR, str(Path(__file__).parents[1]) + os.sep, typing_extensions.__file__)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_INSTALLED = tuple({sysconfig.get_paths()[key] + os.sep for key in ("purelib", "platlib")})
_FORWARD_SEQ = "shardproof_seq_nr"  # meta key: the autograd sequence number a forward op was given
_GRAD_OF = "shardproof_grad_of"  # meta key: the sequence number of the forward op a backward formula differentiates
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n\s*(?P<code>[^\n]*)')


@functools.lru_cache(maxsize=None)
def is_user_code(file: str) -> bool:
    """Whether a frame of `file` is the user's code: the case file and every library a model comes
    from (transformers, torchtitan, Megatron), where the faulty line of a framework's model is; not
    torch, shardproof, Python's own library (decorators' and context managers' wrappers) or code
    made at run time (`<string>`: a dataclass's `__init__`)."""
    if file.startswith(_TOOLS) or file.startswith("<"):
        return False
    return not file.startswith(_STDLIB) or file.startswith(_INSTALLED)


@contextlib.contextmanager
def every_user_frame() -> Iterator[None]:
    """make_fx keeps only the frames of functions named `forward`; keep every frame of user code
    (see `is_user_code`), so an op is located at the line that issued it, in a helper function,
    a checkpoint loader or a library's model. Only frames inside this context count: those
    outside are whatever called the tracer (a console script, a test), not the traced code."""
    original = PythonKeyTracer._filter_traceback_frames
    outside = len(traceback.extract_stack())

    def user_frames(self: PythonKeyTracer, summary: traceback.StackSummary) -> traceback.StackSummary:
        return traceback.StackSummary.from_list([f for f in summary[outside:] if is_user_code(f.filename)])

    PythonKeyTracer._filter_traceback_frames = user_frames
    try:
        yield
    finally:
        PythonKeyTracer._filter_traceback_frames = original


@contextlib.contextmanager
def autograd_origins() -> Iterator[None]:
    """While tracing, tag each FX node with its place in autograd: the sequence number its forward
    op created, or, for an op of a backward formula, the number of the forward op it belongs to."""
    original = PythonKeyTracer.create_node

    def create_node(self: PythonKeyTracer, *args: Any, **kwargs: Any) -> fx.Node:
        node = original(self, *args, **kwargs)
        tag_autograd_origin(node, sys._getframe(1))
        return node

    PythonKeyTracer.create_node = create_node
    try:
        yield
    finally:
        PythonKeyTracer.create_node = original


def tag_autograd_origin(node: fx.Node, frame: FrameType) -> None:
    """Tag a node just traced (its op issued below `frame`) with its place in autograd (see `autograd_origins`)."""
    running = torch._C._current_autograd_node()
    if running is None:
        node.meta[_FORWARD_SEQ] = torch.autograd._get_sequence_nr() - 1
    elif not _user_code_below_engine(frame):
        node.meta[_GRAD_OF] = running._sequence_nr()


def _user_code_below_engine(frame: FrameType | None) -> bool:
    """Whether the current op comes from Python that autograd's engine called (a custom backward, a hook)."""
    while frame is not None:
        name = frame.f_code.co_filename
        if frame.f_code.co_name == "_engine_run_backward" and name.startswith(_TORCH_DIR):
            return False
        if is_user_code(name):
            return True
        frame = frame.f_back
    return False


def locator(gm: fx.GraphModule) -> Callable[[fx.Node], Location | None]:
    """`locate` for one traced graph, sending backward formulas to their forward op's line."""
    forward: dict[int, fx.Node] = {}
    for node in gm.graph.nodes:
        if _FORWARD_SEQ in node.meta:
            forward.setdefault(node.meta[_FORWARD_SEQ], node)
    numbers = sorted(forward)

    def origin_of(node: fx.Node) -> fx.Node | None:
        if _GRAD_OF not in node.meta:
            return None
        at = bisect.bisect_left(numbers, node.meta[_GRAD_OF])
        return forward[numbers[at]] if at < len(numbers) else None

    def locate_in_graph(node: fx.Node) -> Location | None:
        origin = origin_of(node)
        if origin is None:
            return locate(node)
        found, run_by = locate(origin), locate(node)
        calls = () if run_by is None else (*run_by.calls, replace(run_by, calls=()))
        return None if found is None else Location(found.file, found.line, found.code, backward=True, calls=calls)

    return locate_in_graph


def user_frame(err: Exception) -> str:
    """The last frame of an exception's traceback in user code: where it was when it failed."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if is_user_code(f.filename)]
    if not frames:
        return ""
    last = frames[-1]
    return f"\n  at {last.filename}:{last.lineno}  {(last.line or '').strip()}"


def library_frame(err: BaseException) -> str:
    """The line of torch's public Python code (a library the user calls, such as
    `torch.distributed.pipelining`) that issued the failing op below the user's last frame, if the
    failure is there: a value read inside a library is that library's line, not the user's call."""
    frames = traceback.extract_tb(err.__traceback__)
    users = [i for i, f in enumerate(frames) if is_user_code(f.filename)]
    issuer = None
    for frame in frames[users[-1] + 1 :] if users else ():
        if not _public_torch(frame.filename):
            break
        issuer = frame
    if issuer is None:
        return ""
    return f"\n  inside torch/{issuer.filename[len(_TORCH_DIR):]}:{issuer.lineno}  {(issuer.line or '').strip()}"


def _public_torch(file: str) -> bool:
    """A file of torch's public Python packages (not its dispatch, tracing and fake-tensor machinery,
    which sit between the library's line and the failure)."""
    top = file[len(_TORCH_DIR):].split(os.sep)[0] if file.startswith(_TORCH_DIR) else "_"
    return not top.startswith("_") and top not in ("fx", "utils")


# Python's own errors of a program's logic
_PROGRAMMING_ERRORS = (KeyError, AttributeError, AssertionError, NameError, ZeroDivisionError, RecursionError)


def raised_by_shardproof(err: BaseException) -> str | None:
    """Where shardproof failed on its own (`file:line`), or None when the user's code did: a
    programming error (KeyError, AttributeError, ...; torch raises none of these for a user's
    shapes or dtypes) whose innermost frame outside torch and Python's library is ours."""
    if not isinstance(err, _PROGRAMMING_ERRORS):
        return None
    frames = [f for f in traceback.extract_tb(err.__traceback__) if is_user_code(f.filename) or f.filename.startswith(_TOOLS[1])]
    if not frames or not frames[-1].filename.startswith(_TOOLS[1]):
        return None
    return f"{frames[-1].filename.removeprefix(_TOOLS[1])}:{frames[-1].lineno}"


def current_location() -> Location | None:
    """The user's line running now: the innermost frame of user code on the stack."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and not is_user_code(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return Location(frame.f_code.co_filename, frame.f_lineno, code)


def locate(node: fx.Node) -> Location | None:
    """The innermost frame outside torch itself: the user's line that produced this op."""
    trace = node.meta.get("stack_trace")
    return _innermost_user_frame(trace) if trace else None


@functools.lru_cache(maxsize=4096)
def _innermost_user_frame(trace: str) -> Location | None:
    """Cached: the ops of one line share its stack trace (a loader's slices, 126 times over)."""
    frames = [m for m in _FRAME.finditer(trace) if is_user_code(m["file"])]
    while len(frames) > 1 and forwards(frames[-1]["code"]):
        frames.pop()
    if not frames:
        return None
    outer = tuple(Location(f["file"], int(f["line"]), f["code"].strip()) for f in frames[:-1])
    last = frames[-1]
    return Location(last["file"], int(last["line"]), last["code"].strip(), calls=outer)


_FORWARDING = re.compile(r"\(\s*\*\w+\s*,\s*\*\*\w+\s*\)")


def forwards(code: str) -> bool:
    """A wrapper's line, passing its arguments on as they came (`fn(*args, **kwargs)`): an op the
    wrapped library code issues is located where the wrapper was called (torchtitan's
    `Module.parallelize` wraps every module's forward so; the call `self.wo(out)` names the module)."""
    return bool(_FORWARDING.search(code))
