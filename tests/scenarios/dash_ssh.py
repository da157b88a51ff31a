"""Scenario for the SSH panels of the Freezes dashboard: real dstack SSH tunnels to the sshd fixture.

Usage: python dash_ssh.py USER HOST PORT IDENTITY HTTP_PORT SOCK_DIR
Opens and closes tunnels twice (the first held open until a scrape sees it), then opens one, SIGKILLs
its ssh master and closes it (a failure).
Its spans go to an OTLP endpoint that refuses connections, so that the telemetry-dropped panel shows
the failed export and what was dropped after it.
"""

import os
import socket

import stallwatch

with socket.socket() as closed:  # a loopback port nothing listens on: connections are refused
    closed.bind(("127.0.0.1", 0))
    refused = f"http://127.0.0.1:{closed.getsockname()[1]}"
os.environ["OTEL_EXPORTER_OTLP_TIMEOUT"] = "1"  # the failed export ends within the scenario
stallwatch.setup(watchdog=False, traces_exporter="otlp", otlp_endpoint=refused)

import asyncio
import sys
from pathlib import Path

from dash_common import done, hold, ready
from dstack._internal.core.services.ssh import tunnel as tunnel_module  # loaded at start, as in a dstack server
from opentelemetry import trace

from support.ssh_tunnels import kill_master, loopback_tunnel

user, host, port, identity, http_port, sock_dir = sys.argv[1:]


def make(index: int):
    return loopback_tunnel(user, host, port, identity, http_port, Path(sock_dir) / f"http{index}.sock")


async def main() -> None:
    for index in range(2):
        tunnel = make(index)
        await tunnel.aopen()
        if index == 0:
            await asyncio.to_thread(hold, "tunnel")  # open until a scrape has seen it
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
    trace.get_tracer_provider().force_flush(5000)  # the tunnels' spans: one export, refused
    for index in range(20):  # made while the backend is taken to be down: dropped at once
        with trace.get_tracer("dash").start_as_current_span(f"after the failure {index}"):
            await asyncio.sleep(0.05)
    await asyncio.to_thread(done)


asyncio.run(run())
stallwatch.shutdown(timeout=10)
