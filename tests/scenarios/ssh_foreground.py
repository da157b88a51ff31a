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
from dstack._internal.core.services.ssh import tunnel as tunnel_module  # loaded at start, as in a dstack server

from support.ssh_tunnels import get_through, loopback_tunnel

sock = Path(sock_dir) / "http.sock"


async def main() -> dict:
    tunnel = loopback_tunnel(
        user, host, port, identity, http_port, sock, control_sock_path=Path(sock_dir) / "control.sock", background=False
    )
    await tunnel.aopen()
    process = tunnel._process  # the foreground ssh the tunnel owns
    body = await get_through(sock)
    await tunnel.aclose()
    return {"body": body, "ssh_pid": process.pid, "returncode": process.returncode}


result = uvloop.run(main()) if loop_name == "uvloop" else asyncio.run(main())
stallwatch.shutdown(10)
print(json.dumps(result))
