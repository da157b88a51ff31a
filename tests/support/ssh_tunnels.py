"""dstack's SSH tunnels to the loopback sshd fixture, for the scenarios that open them. dstack is imported
when a tunnel is made: each scenario imports it before or after stallwatch as it means to."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from support.processes import is_gone


def loopback_tunnel(user: str, host: str, port: str, identity: str, http_port: str, local: Path, **options: Any) -> Any:
    """dstack's `SSHTunnel`, in batch mode, to `user@host:port` with the key `identity`, forwarding the unix
    socket `local` to the HTTP server on localhost:`http_port`; `options` are further `SSHTunnel` arguments."""
    from dstack._internal.core.services.ssh import tunnel as tunnel_module
    from dstack._internal.utils.path import FilePath

    return tunnel_module.SSHTunnel(
        destination=f"{user}@{host}",
        port=int(port),
        identity=FilePath(identity),
        forwarded_sockets=[
            tunnel_module.SocketPair(
                local=tunnel_module.UnixSocket(local), remote=tunnel_module.IPSocket("localhost", int(http_port))
            )
        ],
        batch_mode=True,
        **options,
    )


async def get_through(local: Path) -> str:
    """The body the HTTP server answers to `GET /` through the tunnel's forwarded unix socket `local`."""
    reader, writer = await asyncio.open_unix_connection(str(local))
    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return response.partition(b"\r\n\r\n")[2].decode()


def kill_master(tunnel: Any, timeout: float = 30.0) -> None:
    """SIGKILL the tunnel's ssh master (its pid from `ssh -O check`) and wait until it is gone."""
    proc = subprocess.run(tunnel.check_command(), capture_output=True, text=True, timeout=10)
    found = re.search(r"Master running \(pid=(\d+)\)", proc.stderr)
    assert found, proc.stderr
    pid = int(found.group(1))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while not is_gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
