"""A warm server for the command line, as `dmypy` is for mypy: it imports torch, shardproof and the
installed frameworks once, then forks a child for each `shardproof verify` (or `verify-graphs`)
that finds it running. The imports dominate a tiny model's run (torch, DTensor and transformers take
about 6 s of 8 on an idle laptop); a forked child starts with them done.

A fork shares nothing mutable with the next request: each run gets a fresh copy of the imported
state, its own working directory, environment and the client's stdin, stdout and stderr (passed as
file descriptors over a Unix socket), and the client gets the child's exit code. A server whose
imported files changed since it started answers "stale" and stops; the client then runs the command
itself. One socket per Python interpreter and shardproof version, so servers of different
environments never answer each other.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import os
import signal
import socket
import struct
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

NO_SERVER = "SHARDPROOF_NO_SERVER"  # set (to anything but "") to run every command in its own process
SOCKET = "SHARDPROOF_SOCKET"  # overrides the socket's path
# what a verification imports; the frameworks' integrations only where the framework is installed
PRELOAD = ("shardproof.api", "shardproof.importers.verify", "shardproof.report.text", "shardproof.report.ci",
           "shardproof.report.progress")
FRAMEWORKS = {"transformers": "shardproof.integrations.transformers", "torchtitan": "shardproof.integrations.torchtitan",
              "megatron.core": "shardproof.integrations.megatron"}
_HEADER = struct.Struct("!I")
_STDIO = 3


def socket_path(version: str) -> Path:
    """Where this interpreter's server listens: a private directory per user, a name per interpreter
    and shardproof version."""
    if os.environ.get(SOCKET):
        return Path(os.environ[SOCKET])
    key = hashlib.sha256(f"{sys.executable}\0{version}\0{Path(__file__).parent}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"shardproof-{os.getuid()}" / f"{key}.sock"


# --- client ---------------------------------------------------------------------------------


def forward(argv: list[str], path: Path) -> int | None:
    """Run `argv` in the server listening at `path`; None where there is none (or it is stale), so
    the caller runs the command itself."""
    if os.environ.get(NO_SERVER) or not path.exists():
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(str(path))
        except OSError:  # a server that died without removing its socket
            return None
        request = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        socket.send_fds(conn, [_HEADER.pack(len(request))], list(range(_STDIO)))
        conn.sendall(request)
        return _await_exit(conn.makefile("r"))


def _await_exit(replies: io.TextIOBase) -> int | None:
    """The child's pid first (Ctrl-C is passed on to it), then its exit code."""
    first = replies.readline()
    if not first or json.loads(first).get("stale"):
        if first:
            print("shardproof: the server's code changed since it started; it stopped. Running here.", file=sys.stderr)
        return None
    child = json.loads(first)["pid"]
    previous = signal.signal(signal.SIGINT, lambda *_: os.kill(child, signal.SIGINT))
    try:
        last = replies.readline()
    finally:
        signal.signal(signal.SIGINT, previous)
    if not last:
        print(f"shardproof: the server's worker (pid {child}) died before it finished", file=sys.stderr)
        return 3
    return int(json.loads(last)["exit"])


# --- server ---------------------------------------------------------------------------------


def serve(path: Path, run: Callable[[list[str]], int], say: Callable[[str], None]) -> None:
    """Import everything a verification needs, then answer requests at `path` until interrupted or
    stale. `run` is the command line's `main`, called in each forked child."""
    start = time.perf_counter()
    loaded = _preload()
    fingerprint = _fingerprint()
    import gc

    gc.collect()
    gc.freeze()  # the imported objects stay shared with the children, never copied by a collection
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with _listening(path) as listener:
        say(f"shardproof server: imported {', '.join(loaded)} in {time.perf_counter() - start:.1f} s; "
            f"listening on {path} (Ctrl-C stops it)")
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it as Ctrl-C does
        signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
        while True:
            conn, _ = listener.accept()
            with conn:
                if _fingerprint() != fingerprint:
                    conn.sendall(b'{"stale": true}\n')
                    say("shardproof server: imported files changed; stopping")
                    return
                try:
                    request, stdio = _receive(conn)
                except (OSError, ValueError) as err:  # a client that hung up or spoke another protocol
                    say(f"shardproof server: dropped a request: {err}")
                    continue
                child = os.fork()
                if child == 0:
                    listener.close()
                    _child(conn, request, stdio, run)
                for fd in stdio:
                    os.close(fd)
                say(f"shardproof {' '.join(request['argv'])} (in {request['cwd']}): worker {child}")


def _preload() -> list[str]:
    """Import what a verification imports; the names of what was imported, for the user."""
    import warnings

    names = ["torch", "shardproof"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # as a verification does: the frameworks warn of missing accelerators
        for name in PRELOAD:
            importlib.import_module(name)
        for framework, integration in FRAMEWORKS.items():
            with contextlib.suppress(ImportError):
                if importlib.util.find_spec(framework.split(".")[0]) is not None:
                    importlib.import_module(integration)
                    names.append(framework)
    return names


def _fingerprint() -> dict[str, float]:
    """Modification times of every imported source file: an edit after the imports makes the
    server stale."""
    stamps = {}
    for module in list(sys.modules.values()):
        source = getattr(module, "__file__", None)
        if source:
            with contextlib.suppress(OSError):
                stamps[source] = os.stat(source).st_mtime
    return stamps


@contextlib.contextmanager
def _listening(path: Path) -> Iterator[socket.socket]:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # a dead server's socket (a live one would have answered the client)
    listener.bind(str(path))
    listener.listen()
    owner = os.getpid()
    try:
        yield listener
    finally:
        listener.close()
        if os.getpid() == owner:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """The request and the client's stdin, stdout and stderr."""
    header, stdio, _, _ = socket.recv_fds(conn, _HEADER.size, _STDIO)
    header += _read(conn, _HEADER.size - len(header))
    (size,) = _HEADER.unpack(header)
    return json.loads(_read(conn, size)), stdio


def _read(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client hung up mid-request")
        data += chunk
    return data


def _child(conn: socket.socket, request: dict, stdio: list[int], run: Callable[[list[str]], int]) -> None:
    """A forked child: become the client's process (its stdio, directory, environment), run the
    command, send the exit code, and leave without running the server's exit handlers."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 3
    try:
        for fd, target in zip(stdio, range(_STDIO)):
            os.dup2(fd, target)
            os.close(fd)
        _reopen_stdio()
        conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"], **{NO_SERVER: "1"})
        sys.argv = ["shardproof", *request["argv"]]
        try:
            code = run(request["argv"])
        except SystemExit as done:  # argparse's usage errors
            code = done.code if isinstance(done.code, int) else 2
        except KeyboardInterrupt:
            code = 130
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        with contextlib.suppress(OSError):
            conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
        os._exit(0)


def _reopen_stdio() -> None:
    """Python's stdio objects were made for the server's descriptors: remake them for the client's
    (a terminal is line-buffered, so progress and reports appear as they are written)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        terminal = os.isatty(fd)
        stream = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=terminal, write_through=name == "stderr")
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
