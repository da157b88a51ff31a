"""Scenario: a bounded soak with every instrumentation on and gRPC busy.

Usage: python soak.py DIR SPAWNS ITEMS TUNNELS
uvloop spawns of /bin/true (SPAWNS) while a grpc.aio client hammers a local gRPC server, executor
items (ITEMS, through asyncio.to_thread and a ThreadPoolExecutor), and TUNNELS open/close pairs of a
tunnel-like class (instrumented with stallwatch.instrument_tunnel) whose open and close each spawn
a child. Prints one JSON line: host errors, RSS after warm-up and at the end, thread names, file
descriptors, stallwatch's shared-memory files before and after shutdown, and any freeze the
watchdog reported meanwhile (a loaded machine can block the loop past the threshold: reported, not
an error).
"""

import glob
import json
import os
import sys
import threading

import stallwatch

out, spawns, items, tunnels = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
stallwatch.setup(file_dir=out, metric_export_interval_ms=5000)

import asyncio
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import uvloop

METHOD = "/soak.Echo/Echo"
handler = grpc.method_handlers_generic_handler(
    "soak.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request)}
)
server = grpc.server(ThreadPoolExecutor(max_workers=4))
server.add_generic_rpc_handlers((handler,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
stop = threading.Event()
ready = threading.Event()


def busy_client() -> None:
    async def run() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(METHOD)
            await echo(b"ping", timeout=10)
            ready.set()
            while not stop.is_set():
                await echo(b"x" * 64, timeout=10)

    asyncio.run(run())


threading.Thread(target=busy_client, name="grpc-client", daemon=True).start()
assert ready.wait(30)


class Tunnel:
    def __init__(self, destination: str) -> None:
        self.destination = destination

    def open(self) -> int:
        return subprocess.run(["/bin/true"]).returncode

    def close(self) -> int:
        return subprocess.run(["/bin/true"]).returncode


stallwatch.instrument_tunnel(Tunnel, aopen=None, aclose=None)
errors: list[str] = []


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def thread_names() -> list[str]:
    return sorted(thread.name for thread in threading.enumerate())


def shm_files() -> list[str]:
    return sorted(glob.glob(f"/dev/shm/stallwatch-{os.getpid()}-*"))


async def spawn_batch(count: int) -> None:
    for _ in range(count):
        try:
            proc = await asyncio.create_subprocess_exec("/bin/true")
            if await proc.wait() != 0:
                errors.append("spawn exit status")
        except Exception as error:
            errors.append(f"spawn {type(error).__name__}")


async def items_batch(count: int, pool: ThreadPoolExecutor) -> None:
    loop = asyncio.get_running_loop()
    for number in range(count):
        try:
            if number % 2:
                assert await asyncio.to_thread(int, number) == number
            else:
                assert await loop.run_in_executor(pool, int, number) == number
        except Exception as error:
            errors.append(f"item {type(error).__name__}")


def tunnel_batch(count: int) -> None:
    for _ in range(count):
        tunnel = Tunnel("ops@127.0.0.1")
        if tunnel.open() != 0 or tunnel.close() != 0:
            errors.append("tunnel")


async def main() -> dict:
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="soak")
    warm = max(spawns // 20, 10)
    await spawn_batch(warm)
    await items_batch(max(items // 20, 10), pool)
    await asyncio.to_thread(tunnel_batch, max(tunnels // 20, 2))
    baseline = {"rss_mb": rss_mb(), "threads": thread_names(), "fds": len(os.listdir("/proc/self/fd"))}
    await spawn_batch(spawns - warm)
    await items_batch(items, pool)
    await asyncio.to_thread(tunnel_batch, tunnels)
    pool.shutdown()
    await asyncio.sleep(0.6)  # the wedge check takes its turn
    return {
        "baseline": baseline,
        "end": {"rss_mb": rss_mb(), "threads": thread_names(), "fds": len(os.listdir("/proc/self/fd"))},
    }


loop = uvloop.new_event_loop()
result = loop.run_until_complete(main())
loop.close()
stop.set()
server.stop(0)
result["shm_before_shutdown"] = [os.path.basename(name) for name in shm_files()]
result["freezes_reported"] = [open(name).read() for name in shm_files() if name.endswith(".freezes")]
stallwatch.shutdown(10)
result["shm_after_shutdown"] = shm_files()
result["errors"] = errors
print(json.dumps(result))
sys.stdout.flush()
os._exit(0)
