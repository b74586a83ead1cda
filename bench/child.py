"""Run one measurement in a freshly spawned process, so its peak RSS and warm caches are its own."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.connection import Connection
from typing import Any, Callable


def run_in_child(measure: Callable[..., dict[str, Any]], args: tuple, timeout: float) -> tuple[str, Any]:
    """("ok", measure(*args)), or ("error" | "timeout" | "crash", a message). `measure` must be a
    module-level function (the child imports it by name)."""
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child, args=(send, measure, args))
    child.start()
    send.close()
    if not receive.poll(timeout):
        child.terminate()
        child.join()
        return "timeout", f"no result within {timeout:.0f} s"
    try:
        status, payload = receive.recv()
    except EOFError:
        status, payload = "crash", None
    child.join()
    if status == "crash":
        payload = f"child exited with code {child.exitcode}"
    return status, payload


def _child(conn: Connection, measure: Callable[..., dict[str, Any]], args: tuple) -> None:
    try:
        conn.send(("ok", measure(*args)))
    except BaseException as err:  # noqa: BLE001 - every failure becomes the row's verdict
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        conn.close()
