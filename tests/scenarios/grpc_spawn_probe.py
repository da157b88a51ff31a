"""Scenario: a gRPC client is busy while the server spawns children on uvloop.

Usage: python grpc_spawn_probe.py {stallwatch|none} SPAWNS
A probe at-fork handler registered before anything else reports the OS threads of each uvloop
child (from /proc/self/task/*/comm) over a pipe before the child execs. gRPC is initialised before
uvloop is imported, so gRPC's C-level child handler runs before uvloop's (pthread_atfork order)
and the probe sees any thread gRPC restarts in the child. Prints one JSON line.
"""

import json
import os
import sys
import threading

mode, spawns = sys.argv[1], int(sys.argv[2])
read_fd, write_fd = os.pipe()


def report_tasks() -> None:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            pass
    os.write(write_fd, (",".join(sorted(names)) + "\n").encode())


os.register_at_fork(after_in_child=report_tasks)

if mode == "stallwatch":
    import stallwatch  # before grpc, as a server would do

import grpc

from support.grpc_echo import start_echo_server

METHOD = "/probe.Echo/Echo"


server, port = start_echo_server("probe.Echo")
stop = threading.Event()
calls = [0]
ready = threading.Event()


def busy_aio_client() -> None:
    """A grpc.aio client on its own loop thread, as the Nebius SDK runs one."""
    import asyncio

    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(METHOD)
            assert await echo(b"ping", timeout=10) == b"ping"
            ready.set()
            while not stop.is_set():
                await echo(b"x" * 64, timeout=10)
                calls[0] += 1

    asyncio.run(run())


client = threading.Thread(target=busy_aio_client, name="grpc-aio-client", daemon=True)
client.start()
assert ready.wait(30), "the grpc.aio client never reached the local server"

import asyncio

import uvloop  # after gRPC initialised: see the docstring


async def main() -> list[int]:
    codes = []
    for _ in range(spawns):
        proc = await asyncio.create_subprocess_exec("/bin/true")
        codes.append(await proc.wait())
    return codes


loop = uvloop.new_event_loop()
codes = loop.run_until_complete(main())
stop.set()
client.join(30)
os.close(write_fd)
data = b""
while chunk := os.read(read_fd, 65536):
    data += chunk
children = [line.split(",") for line in data.decode().splitlines()]
result = {
    "exit_codes": codes,
    "rpc_calls": calls[0],
    "children": len(children),
    "grpc_threads_in_children": sum(1 for c in children for n in c if n in ("event_engine", "lifeguard")),
    "child_tasks": children[:3],
    "env": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"),
}
if mode == "stallwatch":
    from stallwatch.forksafe import guard

    result["fork_counts"] = [[list(k), v] for k, v in guard.fork_counts()]
print(json.dumps(result))
