"""Scenario: a dstack-style server opens and closes real SSH tunnels with stallwatch on.

Usage: python ssh_tunnel.py FILE_DIR {asyncio|uvloop} {before|after} USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR
`before`/`after`: whether dstack's tunnel module is imported before or after stallwatch.setup().
Does: aopen, HTTP through the forwarded unix socket, acheck, aexec, aclose; then aopen, SIGKILL of
the ssh master, aclose (fails: dstack only logs it); then the sync open/close. Prints one JSON line.
"""

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

file_dir, loop_name, order, user, host, port, identity, http_port, sock_dir = sys.argv[1:]
if order == "before":
    from dstack._internal.core.services.ssh import tunnel as tunnel_module
import stallwatch

stallwatch.setup(file_dir=file_dir, metric_export_interval_ms=3600000, watchdog=False)
if order == "after":
    from dstack._internal.core.services.ssh import tunnel as tunnel_module
import uvloop
from dstack._internal.utils.path import FilePath
from opentelemetry import trace

sock = Path(sock_dir) / "http.sock"
result: dict[str, object] = {}


def make():
    return tunnel_module.SSHTunnel(
        destination=f"{user}@{host}",
        port=int(port),
        identity=FilePath(identity),
        forwarded_sockets=[
            tunnel_module.SocketPair(
                local=tunnel_module.UnixSocket(sock), remote=tunnel_module.IPSocket("localhost", int(http_port))
            )
        ],
        batch_mode=True,
    )


async def get(path):
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    return response.partition(b"\r\n\r\n")[2].decode()


def kill_master(tunnel):
    proc = subprocess.run(tunnel.check_command(), capture_output=True, text=True, timeout=10)
    pid = int(re.search(r"Master running \(pid=(\d+)\)", proc.stderr).group(1))
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        except FileNotFoundError:
            return
        if state in ("Z", "X"):
            return
        time.sleep(0.02)


async def main():
    tracer = trace.get_tracer("scenario")
    with tracer.start_as_current_span("probe"):
        tunnel = make()
        await tunnel.aopen()
        result["body"] = await get(sock)
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
