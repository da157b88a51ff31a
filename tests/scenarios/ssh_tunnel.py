"""Scenario: a dstack-style server opens and closes real SSH tunnels with stallwatch on.

Usage: python ssh_tunnel.py FILE_DIR {asyncio|uvloop} {before|after} USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR
`before`/`after`: whether dstack's tunnel module is imported before or after stallwatch.setup().
Does: aopen, HTTP through the forwarded unix socket, acheck, aexec, aclose; then aopen, SIGKILL of
the ssh master, aclose (fails: dstack only logs it); then the sync open/close. Prints one JSON line.
"""

import asyncio
import json
import sys
from pathlib import Path

file_dir, loop_name, order, user, host, port, identity, http_port, sock_dir = sys.argv[1:]
if order == "before":
    from dstack._internal.core.services.ssh import tunnel as tunnel_module
import stallwatch

stallwatch.setup(file_dir=file_dir, metric_export_interval_ms=3600000, watchdog=False)
if order == "after":
    from dstack._internal.core.services.ssh import tunnel as tunnel_module
import uvloop
from opentelemetry import trace

from support.ssh_tunnels import get_through, kill_master, loopback_tunnel

sock = Path(sock_dir) / "http.sock"
result: dict[str, object] = {}


def make():
    return loopback_tunnel(user, host, port, identity, http_port, sock)


async def main():
    tracer = trace.get_tracer("scenario")
    with tracer.start_as_current_span("probe"):
        tunnel = make()
        await tunnel.aopen()
        result["body"] = await get_through(sock)
        result["check"] = await tunnel.acheck()
        result["exec"] = await tunnel.aexec("echo hi")
        await tunnel.aclose()
    with tracer.start_as_current_span("probe-killed-master"):
        tunnel = make()
        await tunnel.aopen()
        kill_master(tunnel)
        await tunnel.aclose()  # dstack logs "Failed to close SSH tunnel, exit status: 255" and returns
        Path(tunnel.control_sock_path).unlink(missing_ok=True)


if loop_name == "uvloop":
    loop = uvloop.new_event_loop()
    loop.run_until_complete(main())
    loop.close()
else:
    asyncio.run(main())
sync_tunnel = make()
sync_tunnel.open()
sync_tunnel.close()
stallwatch.shutdown(10)
print(json.dumps(result))
