"""The real-sshd fixtures, exercised with the plain ssh client and with dstack's SSHTunnel."""

from __future__ import annotations

import asyncio
import http.client
import logging
import os
import re
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvloop
from dstack._internal.core.services.ssh.tunnel import IPSocket, SocketPair, SSHTunnel, UnixSocket
from dstack._internal.utils.path import FilePath

from sshd_fixture import HTTP_BODY, Sshd
from support.processes import is_gone
from support.waiting import wait_until

TUNNEL_LOGGER = "dstack._internal.core.services.ssh.tunnel"


def run_on(loop_name: str, coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` on a fresh standard asyncio or uvloop event loop (without event loop policies, which 3.14 removes)."""
    if loop_name == "asyncio":
        asyncio.run(coro)
        return
    loop = uvloop.new_event_loop()
    try:
        loop.run_until_complete(coro)
        loop.run_until_complete(loop.shutdown_default_executor())
    finally:
        loop.close()


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: Path) -> None:
        super().__init__("localhost", timeout=5)
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(str(self.unix_path))


def get_sync(path: Path) -> bytes:
    conn = UnixHTTPConnection(path)
    try:
        conn.request("GET", "/")
        response = conn.getresponse()
        assert response.status == 200
        return response.read()
    finally:
        conn.close()


async def get_async(path: Path) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.0 200 "), head
    return body


def master_pid(tunnel: SSHTunnel) -> int:
    """The ssh master's pid, from `ssh -S CTL -O check` ("Master running (pid=N)" on stderr)."""
    proc = subprocess.run(tunnel.check_command(), capture_output=True, text=True, timeout=10)
    assert proc.returncode == 0, proc.stderr
    match = re.search(r"Master running \(pid=(\d+)\)", proc.stderr)
    assert match, proc.stderr
    return int(match.group(1))


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short directory for unix sockets (sun_path is limited to 108 bytes; pytest's tmp_path can be longer)."""
    with tempfile.TemporaryDirectory(prefix="sw-ssh-") as d:
        yield Path(d)


@pytest.fixture
def make_tunnel(sshd: Sshd, http_server: int, sock_dir: Path) -> Iterator[Callable[[], SSHTunnel]]:
    """Build SSHTunnels forwarding sock_dir/http.sock to the HTTP server; closes them all at teardown."""
    tunnels: list[SSHTunnel] = []

    def make() -> SSHTunnel:
        tunnel = SSHTunnel(
            destination=f"{sshd.user}@{sshd.host}",
            port=sshd.port,
            identity=FilePath(sshd.identity),
            forwarded_sockets=[
                SocketPair(local=UnixSocket(sock_dir / "http.sock"), remote=IPSocket("localhost", http_server))
            ],
            batch_mode=True,
        )
        tunnels.append(tunnel)
        return tunnel

    yield make
    for tunnel in tunnels:
        tunnel.close()


def test_plain_ssh_echo(sshd: Sshd) -> None:
    proc = subprocess.run(
        [
            "ssh",
            "-F",
            "none",
            "-i",
            str(sshd.identity),
            "-p",
            str(sshd.port),
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            f"{sshd.user}@{sshd.host}",
            "echo hi",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0, f"{proc.stderr}\nsshd log:\n{sshd.log.read_text()}"
    assert proc.stdout == "hi\n"


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_tunnel_async(make_tunnel: Callable[[], SSHTunnel], sock_dir: Path, loop_name: str) -> None:
    tunnel = make_tunnel()

    async def scenario() -> None:
        await tunnel.aopen()
        assert await tunnel.acheck()
        assert await get_async(sock_dir / "http.sock") == HTTP_BODY
        assert await tunnel.aexec("echo hi") == "hi\n"
        await tunnel.aclose()

    run_on(loop_name, scenario())
    # `ssh -O exit` returns once the master acknowledged; the master unlinks its socket as it exits.
    wait_until(lambda: not Path(tunnel.control_sock_path).exists(), "the control socket is gone")


def test_tunnel_sync(make_tunnel: Callable[[], SSHTunnel], sock_dir: Path) -> None:
    tunnel = make_tunnel()
    tunnel.open()
    assert tunnel.check()
    assert get_sync(sock_dir / "http.sock") == HTTP_BODY
    tunnel.close()
    wait_until(lambda: not Path(tunnel.control_sock_path).exists(), "the control socket is gone")


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_tunnel_close_after_master_killed(
    make_tunnel: Callable[[], SSHTunnel], caplog: pytest.LogCaptureFixture, mode: str
) -> None:
    tunnel = make_tunnel()
    if mode == "async":
        asyncio.run(tunnel.aopen())
    else:
        tunnel.open()
    pid = master_pid(tunnel)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: is_gone(pid), f"the ssh master (pid {pid}) is dead")
    control_sock = Path(tunnel.control_sock_path)
    assert control_sock.exists()  # SIGKILL leaves the master's control socket behind

    # Neither aclose() nor close() raises: both log at ERROR and return.
    with caplog.at_level(logging.ERROR, logger=TUNNEL_LOGGER):
        if mode == "async":
            asyncio.run(tunnel.aclose())
        else:
            tunnel.close()
    # `ssh -O exit` cannot connect to the dead master's socket: OpenSSH's muxclient reports
    # "Control socket connect(PATH): Connection refused" and ssh exits with 255, its status for ssh-level errors.
    # The output is logged as bytes: stdout + stderr for aclose(), stdout with stderr merged in for close().
    [record] = [r for r in caplog.records if r.name == TUNNEL_LOGGER]
    assert record.levelno == logging.ERROR
    assert record.getMessage() == (
        f"Failed to close SSH tunnel, exit status: 255, output: b'Control socket connect({control_sock}):"
        " Connection refused\\r\\n'"
    )
    # The control commands run with `-F none` (ControlMaster=no), so ssh does not unlink the stale socket either.
    assert control_sock.exists()
    control_sock.unlink()  # so that make_tunnel's teardown close() is a no-op
