"""Point-to-point messages for the numeric oracle's threaded process group, which has none.

`send`/`recv` of `ProcessLocalGroup` (torch's threaded group) as gloo runs them: a send leaves a
copy of its tensor on its channel (group, source, destination, tag) at once; a recv takes the
channel's oldest message into its buffer, now or when it comes, and its work waits for that. So
`irecv` before `isend` and `batch_isend_irecv` in any order run as on a real backend, and the k-th
recv of a channel gets its k-th send, as `relations/messages.py` assumes.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.testing._internal.distributed.multi_threaded_pg import ProcessLocalGroup, ret_work

# A recv still waiting this long waits for a message no rank sends (the prover refuses such programs first).
_NEVER_SENT_S = 60.0


class _Received:
    """The work of a recv: done once every buffer holds its message."""

    def __init__(self, arrived: list[threading.Event]) -> None:
        self.arrived = arrived

    def is_completed(self) -> bool:
        return all(event.is_set() for event in self.arrived)

    def wait(self, timeout: Any = None) -> bool:
        start = time.monotonic()
        for event in self.arrived:
            while not event.wait(0.01):
                if ProcessLocalGroup._terminate.is_set():
                    raise SystemExit  # the oracle woke the ranks still running: a hang
                if time.monotonic() - start > _NEVER_SENT_S:
                    raise RuntimeError("a recv waited for a message that no rank sent")
        return True


class _Channels:
    """Messages sent and not received, and buffers waiting for one, per channel."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sent: dict[tuple, deque[torch.Tensor]] = defaultdict(deque)
        self.waiting: dict[tuple, deque[tuple[torch.Tensor, threading.Event]]] = defaultdict(deque)

    def send(self, group: ProcessLocalGroup, tensors: list[torch.Tensor], destination: int, tag: int = 0) -> Any:
        key = (group.pg_name, group._rank, destination, tag)
        for tensor in tensors:
            message = tensor.detach().clone()
            with self.lock:
                if self.waiting[key]:
                    buffer, arrived = self.waiting[key].popleft()
                    _deliver(buffer, message, arrived)
                else:
                    self.sent[key].append(message)
        return ret_work(None)

    def recv(self, group: ProcessLocalGroup, tensors: list[torch.Tensor], source: int, tag: int = 0) -> _Received:
        key = (group.pg_name, source, group._rank, tag)
        events = []
        for buffer in tensors:
            arrived = threading.Event()
            with self.lock:
                if self.sent[key]:
                    _deliver(buffer, self.sent[key].popleft(), arrived)
                else:
                    self.waiting[key].append((buffer, arrived))
            events.append(arrived)
        return _Received(events)


def _deliver(buffer: torch.Tensor, message: torch.Tensor, arrived: threading.Event) -> None:
    if buffer.shape != message.shape:
        raise RuntimeError(f"a message of shape {tuple(message.shape)} received into a buffer of shape {tuple(buffer.shape)}")
    with torch.no_grad():
        buffer.copy_(message)
    arrived.set()


@contextmanager
def point_to_point() -> Iterator[None]:
    """Give the threaded process group send and recv for one oracle run."""
    channels = _Channels()
    saved = {name: ProcessLocalGroup.__dict__.get(name) for name in ("send", "recv")}
    ProcessLocalGroup.send = lambda self, tensors, dst, tag=0: channels.send(self, tensors, dst, tag)
    ProcessLocalGroup.recv = lambda self, tensors, src, tag=0: channels.recv(self, tensors, src, tag)
    try:
        yield
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(ProcessLocalGroup, name)
            else:
                setattr(ProcessLocalGroup, name, method)
