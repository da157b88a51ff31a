"""The hosts `stallwatch demo` runs in child processes, one per incident stage (demo only).

`python -c BOOTSTRAP ROLE OUT ...` (see `command()`) with ROLE:

- `freeze OUT SECONDS`: a library registered an after-fork handler before stallwatch was imported,
  so the exec-bound guard cannot skip it. In the child of one uvloop spawn it sleeps SECONDS
  before exec, and the host's loop thread waits holding the GIL (incident 000's freeze, without
  the crash). The watchdog reports it while it lasts.
- `create OUT ADDRESS`: a Nebius instance create against the fake server at ADDRESS, which
  delays its answer; the demo kills this host with SIGKILL while the create is in flight, as the
  health check did in incident 000.
- `restart OUT`: the next start after the kill: `setup()` replays the dead host's journal (its
  create becomes an interrupted span and a leak candidate), then shuts down.
- `wedge OUT guard|noguard heal|noheal`: incident 002 in its smallest form. A stale
  `PyThreadState_SetAsyncExc(SystemExit)` aimed at an idle executor worker, then the next
  request's item.

Each prints one JSON line. The runtime never imports this module: it imports uvloop, grpc and
nebius.
"""

from __future__ import annotations

import os
import sys
import time

# The after-fork handler of "a library imported before stallwatch": registered by the bootstrap
# before `import stallwatch` (which installs the guard), so the guard cannot skip it. HANG is the
# bootstrap's global; the forked child reads the value the parent set before forking.
BOOTSTRAP = """
import os, sys, time
HANG = [0.0]
os.register_at_fork(after_in_child=lambda: HANG[0] and time.sleep(HANG[0]))
from stallwatch.demo_incidents import main
main(sys.argv[1:])
"""


def command(*args: str) -> list[str]:
    """The argv that runs one demo role in a fresh interpreter."""
    return [sys.executable, "-c", BOOTSTRAP, *args]


def freeze(out: str, seconds: float) -> dict[str, object]:
    import asyncio

    import uvloop

    import stallwatch

    session = stallwatch.setup(file_dir=out, freeze_threshold=1.0, metric_export_interval_ms=3_600_000)

    hang = sys.modules["__main__"].HANG

    async def main() -> dict[str, object]:
        await asyncio.sleep(0.5)  # the watchdog is up and the loop heartbeat flows
        hang[0] = seconds
        started = time.time_ns()
        child = await asyncio.create_subprocess_exec("/bin/true")
        ended = time.time_ns()
        hang[0] = 0.0
        await child.wait()
        await asyncio.sleep(1.5)  # the watchdog sees the thaw
        return {"frozen_from_ns": started, "frozen_until_ns": ended, "watchdog_pid": session.watchdog_pid}

    loop = uvloop.new_event_loop()
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()
        stallwatch.shutdown(5)


def create(out: str, address: str) -> None:
    import asyncio

    import stallwatch

    stallwatch.setup(file_dir=out, watchdog=False)
    from nebius.api.nebius.common.v1 import ResourceMetadata
    from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient
    from opentelemetry import trace

    from .fake_nebius import sdk_for

    async def main() -> None:
        async with sdk_for(address) as sdk:
            with trace.get_tracer("stallwatch.demo").start_as_current_span("provision h200 instance"):
                request = CreateInstanceRequest(metadata=ResourceMetadata(name="h200-worker", parent_id="project-demo"))
                print('{"creating": true}', flush=True)
                await InstanceServiceClient(sdk).create(request, timeout=600)

    asyncio.run(main())


def restart(out: str) -> dict[str, object]:
    import stallwatch

    stallwatch.setup(file_dir=out, watchdog=False)
    stallwatch.shutdown(5)
    return {}


def wedge(out: str, guard: bool, heal: bool) -> dict[str, object]:
    import ctypes
    import socket
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout

    import stallwatch

    stallwatch.setup(
        file_dir=out, watchdog=False, guard_async_exc=guard, executor_heal=heal, metric_export_interval_ms=3_600_000
    )
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")
    near, far = socket.socketpair()
    worker: dict[str, int] = {}

    def execute() -> bytes:
        worker["ident"] = threading.get_ident()
        return near.recv(10)

    def outcome(future: object, timeout: float) -> str:
        try:
            return str(future.result(timeout=timeout))  # type: ignore[attr-defined]
        except FutureTimeout:
            return "hung"
        except Exception as error:
            return f"{type(error).__name__}"

    request_a = pool.submit(execute)
    time.sleep(0.1)
    far.close()  # the runner went away: request A ends, the worker goes idle
    request_a.result(timeout=2)
    time.sleep(0.05)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker["ident"]), ctypes.py_object(SystemExit))
    started = time.monotonic()
    request_b = outcome(pool.submit(lambda: "done"), 3.0)
    seconds = round(time.monotonic() - started, 2)
    request_c = outcome(pool.submit(lambda: "done"), 3.0)
    time.sleep(0.2)
    stallwatch.shutdown(5)
    return {"request_b": request_b, "request_b_seconds": seconds, "request_c": request_c}


def main(argv: list[str]) -> None:
    import json

    role, out = argv[0], argv[1]
    if role == "freeze":
        result: object = freeze(out, float(argv[2]))
    elif role == "create":
        create(out, argv[2])
        result = {}
    elif role == "restart":
        result = restart(out)
    elif role == "wedge":
        result = wedge(out, argv[2] == "guard", argv[3] == "heal")
    else:
        raise SystemExit(f"unknown demo role {role!r}")
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a wedged pool would also hang interpreter exit (concurrent.futures joins its workers)
