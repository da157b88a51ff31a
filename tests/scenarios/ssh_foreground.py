"""Scenario: a dstack server opens a foreground SSH tunnel and closes it, with stallwatch on.

Usage: python ssh_foreground.py FILE_DIR {asyncio|uvloop} USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR
dstack's `SSHTunnel(background=False)` owns its `ssh` process; `aclose()` kills that process's
group with SIGKILL. Fetches the HTTP body through the tunnel between the two. Prints one JSON line:
the body, the ssh pid and its return code.
"""

import asyncio
import json
import sys
from pathlib import Path

import stallwatch

file_dir, loop_name, user, host, port, identity, http_port, sock_dir = sys.argv[1:]
stallwatch.setup(file_dir=file_dir, metric_export_interval_ms=3600000, watchdog=False)

import uvloop
from dstack._internal.core.services.ssh import tunnel as tunnel_module
from dstack._internal.utils.path import FilePath

sock = Path(sock_dir) / "http.sock"


async def main() -> dict:
    tunnel = tunnel_module.SSHTunnel(
        destination=f"{user}@{host}",
        port=int(port),
        identity=FilePath(identity),
        forwarded_sockets=[
            tunnel_module.SocketPair(
                local=tunnel_module.UnixSocket(sock), remote=tunnel_module.IPSocket("localhost", int(http_port))
            )
        ],
        control_sock_path=Path(sock_dir) / "control.sock",
        batch_mode=True,
        background=False,
    )
    await tunnel.aopen()
    process = tunnel._process  # the foreground ssh the tunnel owns
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    await writer.drain()
    body = (await asyncio.wait_for(reader.read(), 10)).partition(b"\r\n\r\n")[2].decode()
    writer.close()
    await tunnel.aclose()
    return {"body": body, "ssh_pid": process.pid, "returncode": process.returncode}


result = uvloop.run(main()) if loop_name == "uvloop" else asyncio.run(main())
stallwatch.shutdown(10)
print(json.dumps(result))
