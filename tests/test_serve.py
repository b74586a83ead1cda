"""The warm server: a command it runs prints and exits as the command does on its own; the client
falls back to running the command itself wherever the server cannot answer."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest

from shardproof import serve

CASES = Path(__file__).parent / "cases"
SHARDPROOF = [shutil.which("shardproof") or "shardproof"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[dict, Path]]:
    folder = tmp_path_factory.mktemp("server")
    env = {**os.environ, serve.SOCKET: str(folder / "s.sock")}
    env.pop(serve.NO_SERVER, None)
    log = folder / "server.log"
    with log.open("w") as out:
        process = subprocess.Popen([*SHARDPROOF, "serve"], env=env, stderr=out, stdout=out)
    deadline = time.monotonic() + 300
    while not (folder / "s.sock").exists():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    yield env, log
    process.terminate()
    assert process.wait(60) == 0
    assert not (folder / "s.sock").exists()


def _shown(stdout: str) -> str:
    return re.sub(r"\d+(\.\d+)? s\b", "N s", stdout)  # timings differ from run to run


@pytest.mark.parametrize("name, code", [("all-ranks-shard-0_fixed.py", 0), ("all-ranks-shard-0_buggy.py", 1)])
def test_a_command_the_server_runs_prints_and_exits_as_it_does_alone(server, tmp_path: Path, name: str, code: int) -> None:
    env, log = server
    command = [*SHARDPROOF, "verify", str(CASES / name), "--quiet", "--json", "report.json"]
    alone = subprocess.run(command, env={**env, serve.NO_SERVER: "1"}, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    alone_report = json.loads((tmp_path / "report.json").read_text())
    (tmp_path / "report.json").unlink()
    served = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert f"verify {CASES / name} --quiet --json report.json (in {tmp_path})" in log.read_text()  # it ran there
    assert served.returncode == alone.returncode == code
    assert _shown(served.stdout) == _shown(alone.stdout)
    served_report = json.loads((tmp_path / "report.json").read_text())  # written in the client's directory
    assert {**served_report, "seconds": 0} == {**alone_report, "seconds": 0}


def _fake_server(path: Path, replies: list[bytes]) -> threading.Thread:
    """A server that reads a request and answers `replies`, then hangs up."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()

    def answer() -> None:
        conn, _ = listener.accept()
        with conn, listener:
            _, stdio = serve._receive(conn)
            for fd in stdio:
                os.close(fd)
            for reply in replies:
                conn.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


def test_a_stale_server_leaves_the_command_to_the_client(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "s.sock"
    _fake_server(path, [b'{"stale": true}\n'])
    assert serve.forward(["verify", "case.py"], path) is None
    assert "code changed" in capsys.readouterr().err


def test_a_worker_that_dies_is_an_internal_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "s.sock"
    _fake_server(path, [b'{"pid": 1}\n'])
    assert serve.forward(["verify", "case.py"], path) == 3
    assert "died" in capsys.readouterr().err


def test_without_a_live_server_the_client_runs_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.sock"
    assert serve.forward(["verify", "case.py"], path) is None  # none started
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))  # a socket file nobody listens on: a server killed without cleaning up
    dead.close()
    assert serve.forward(["verify", "case.py"], path) is None
    _fake_server(path.with_name("live.sock"), [b'{"pid": 1}\n', b'{"exit": 0}\n'])
    monkeypatch.setenv(serve.NO_SERVER, "1")
    assert serve.forward(["verify", "case.py"], path.with_name("live.sock")) is None  # turned off


def test_an_edited_import_makes_the_fingerprint_differ(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    module = tmp_path / "shardproof_serve_probe.py"
    module.write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__("shardproof_serve_probe")
    try:
        before = serve._fingerprint()
        assert serve._fingerprint() == before
        stamp = os.stat(module).st_mtime + 1
        os.utime(module, (stamp, stamp))
        assert serve._fingerprint() != before
    finally:
        del sys.modules["shardproof_serve_probe"]


def test_each_interpreter_and_version_has_its_own_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(serve.SOCKET, raising=False)
    here = serve.socket_path("1.0")
    assert here != serve.socket_path("1.1")
    assert here.parent.name == f"shardproof-{os.getuid()}"
    monkeypatch.setattr(sys, "executable", "/elsewhere/python")
    assert serve.socket_path("1.0") != here
