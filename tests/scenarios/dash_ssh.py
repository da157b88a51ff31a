"""Scenario for the SSH panels of the Freezes dashboard: real dstack SSH tunnels to the sshd fixture.

Usage: python dash_ssh.py USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR
Opens and closes tunnels twice, then opens one, SIGKILLs its ssh master and closes it (a failure).
"""

import stallwatch

stallwatch.setup(watchdog=False)

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from dash_common import done, ready
from dstack._internal.core.services.ssh import tunnel as tunnel_module
from dstack._internal.utils.path import FilePath

user, host, port, identity, http_port, sock_dir = sys.argv[1:]


def make(index: int):
    return tunnel_module.SSHTunnel(
        destination=f"{user}@{host}",
        port=int(port),
        identity=FilePath(identity),
        forwarded_sockets=[
            tunnel_module.SocketPair(
                local=tunnel_module.UnixSocket(Path(sock_dir) / f"http{index}.sock"),
                remote=tunnel_module.IPSocket("localhost", int(http_port)),
            )
        ],
        batch_mode=True,
    )


def kill_master(tunnel) -> None:
    proc = subprocess.run(tunnel.check_command(), capture_output=True, text=True, timeout=10)
    os.kill(int(re.search(r"Master running \(pid=(\d+)\)", proc.stderr).group(1)), signal.SIGKILL)
    time.sleep(0.3)


async def main() -> None:
    for index in range(2):
        tunnel = make(index)
        await tunnel.aopen()
        await asyncio.sleep(1.5)  # open across a scrape
        await tunnel.aclose()
        await asyncio.sleep(1.0)
    tunnel = make(2)
    await tunnel.aopen()
    await asyncio.to_thread(kill_master, tunnel)
    await tunnel.aclose()  # dstack logs "Failed to close SSH tunnel" and returns
    Path(tunnel.control_sock_path).unlink(missing_ok=True)
    await asyncio.sleep(1.5)
    tunnel = make(3)
    await tunnel.aopen()
    await asyncio.to_thread(kill_master, tunnel)
    await tunnel.aclose()
    Path(tunnel.control_sock_path).unlink(missing_ok=True)


async def run() -> None:
    await asyncio.to_thread(ready)
    await main()
    await asyncio.to_thread(done)


asyncio.run(run())
stallwatch.shutdown(timeout=10)
