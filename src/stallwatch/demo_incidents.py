"""The hosts `stallwatch demo` runs in child processes, one per incident stage (demo only).

`python -c BOOTSTRAP ROLE OUT ...` (see `command()`) with ROLE:

- `freeze OUT SECONDS`: a fork handler registered before stallwatch was imported, which the
  exec-bound guard cannot skip, sleeps SECONDS in the child of one uvloop spawn before exec, while
  the host's loop thread waits holding the GIL. The watchdog reports it while it lasts.
- `create OUT ADDRESS`: a Nebius instance create against `UnansweredCloud` at ADDRESS, which never
  answers; the demo SIGKILLs this host while the create is in flight.
- `restart OUT`: the next start: `setup()` replays the dead host's journal, then shuts down.
- `wedge OUT guard|noguard heal|noheal`: `executor_wedge()`, the wedge in its smallest form.

Each prints one JSON line. The runtime never imports this module (it imports uvloop, grpc and
nebius); the tests import `sdk_for()` and `executor_wedge()` from it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

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


INSTANCE_CREATE = "/nebius.compute.v1.InstanceService/Create"


def sdk_for(address: str, **overrides: Any) -> Any:
    """The real `nebius.sdk.SDK`, every service resolved to `address`, plaintext, no credentials.

    Works with nebius 0.6.13 through 0.6.29 (same option names). `overrides` go to `SDK(...)` (e.g.
    `interceptors=`, `event_loop=`). Close it: `sdk.sync_close()` from a plain thread, `await sdk.close()`
    (or `async with sdk:`) in a loop. The SDK starts its own daemon loop thread `nebius-sdk-loop` and
    lazily `nebius-sdk-worker_N` executor threads; close stops them.
    """
    # optional: the demo extra
    from nebius.aio.channel import NoCredentials
    from nebius.base.options import INSECURE
    from nebius.base.resolver import Constant
    from nebius.sdk import SDK

    options: dict[str, Any] = {
        "credentials": NoCredentials(),
        "resolver": Constant(address),
        "options": [
            (INSECURE, True),
            # The SDK sends with wait_for_ready=True: reconnect quickly after a server restarts.
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 500),
        ],
        "keepalive": False,
        "user_agent_prefix": "stallwatch-demo/1",
    }
    options.update(overrides)
    return SDK(**options)


class UnansweredCloud:
    """A gRPC endpoint on 127.0.0.1 where `InstanceService/Create` is accepted and never answered.

    All the `create` stage needs of a cloud: the call leaves the host and stays in flight until the
    host is killed. Every other method answers UNIMPLEMENTED. Leaving the `with` block ends the
    waiting calls with UNAVAILABLE and stops the server.
    """

    def __init__(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        # optional: the grpc extra
        import grpc

        self._released = threading.Event()
        self._server = grpc.server(ThreadPoolExecutor(max_workers=2, thread_name_prefix="demo-cloud"))
        self._server.add_generic_rpc_handlers([self])  # type: ignore[list-item]  # a GenericRpcHandler by protocol
        self._port = self._server.add_insecure_port("127.0.0.1:0")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self._port}"

    def service(self, details: Any) -> Any:
        """`grpc.GenericRpcHandler`: the handler for Create; None (UNIMPLEMENTED) for any other method."""
        # optional: the grpc extra
        import grpc

        return grpc.unary_unary_rpc_method_handler(self._create) if details.method == INSTANCE_CREATE else None

    def _create(self, request: bytes, context: Any) -> bytes:
        # optional: the grpc extra
        import grpc

        self._released.wait()
        context.abort(grpc.StatusCode.UNAVAILABLE, "the demo's cloud stopped")
        return b""

    def __enter__(self) -> UnansweredCloud:
        self._server.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._released.set()
        self._server.stop(0)


def freeze(out: str, seconds: float) -> dict[str, object]:
    import asyncio

    # optional: the demo extra
    import uvloop

    # fork safety: each stage's host loads stallwatch itself, `freeze` after its fork handler
    import stallwatch

    session = stallwatch.setup(
        file_dir=out, freeze_threshold=1.0, metric_export_interval_ms=3_600_000, uvloop_spawn="fork"
    )

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

    # fork safety: each stage's host loads stallwatch itself, `freeze` after its fork handler
    import stallwatch

    stallwatch.setup(file_dir=out, watchdog=False)
    # optional: the demo extra
    from nebius.api.nebius.common.v1 import ResourceMetadata
    from nebius.api.nebius.compute.v1 import CreateInstanceRequest, InstanceServiceClient
    from opentelemetry import trace

    async def main() -> None:
        async with sdk_for(address) as sdk:
            with trace.get_tracer("stallwatch.demo").start_as_current_span("provision h200 instance"):
                request = CreateInstanceRequest(metadata=ResourceMetadata(name="h200-worker", parent_id="project-demo"))
                print('{"creating": true}', flush=True)
                await InstanceServiceClient(sdk).create(request, timeout=600)

    asyncio.run(main())


def restart(out: str) -> dict[str, object]:
    # fork safety: each stage's host loads stallwatch itself, `freeze` after its fork handler
    import stallwatch

    stallwatch.setup(file_dir=out, watchdog=False)
    stallwatch.shutdown(5)
    return {}


def executor_wedge(out: str, guard: bool, heal: bool, metric_export_interval_ms: int) -> dict[str, object]:
    """Incident 002 on a 1-worker ThreadPoolExecutor named "runner", in a fresh interpreter.

    Request A parks in `sock.recv`; the peer closes, so A ends by another path and the worker goes
    idle; then, as NDIF's kill_thread does, SystemExit is injected into that worker with ctypes.
    Request B is submitted next, then C. Returns what the injection returned ("set_async_exc_returned"),
    what B and C gave ("B", "C": the result, "hung", or "ErrorType: message"), how long B took
    ("B_seconds") and B's trace id ("B_trace"). Calls `stallwatch.setup()` and `shutdown()`; the pool
    is left as the incident left it, so the caller must end the process with `os._exit` (interpreter
    exit joins the workers).
    """
    import ctypes
    import socket
    import threading
    from concurrent.futures import Future, ThreadPoolExecutor
    from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11

    from opentelemetry import trace

    # fork safety: each stage's host loads stallwatch itself, `freeze` after its fork handler
    import stallwatch

    stallwatch.setup(
        file_dir=out,
        watchdog=False,
        guard_async_exc=guard,
        executor_heal=heal,
        metric_export_interval_ms=metric_export_interval_ms,
    )
    tracer = trace.get_tracer("stallwatch.demo")
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")
    near, far = socket.socketpair()
    worker: dict[str, int] = {}

    def execute() -> bytes:
        worker["ident"] = threading.get_ident()
        return near.recv(10)

    def outcome(future: Future[object], timeout: float) -> str:
        try:
            return str(future.result(timeout=timeout))
        except FutureTimeout:
            return "hung"
        except Exception as error:
            return f"{type(error).__name__}: {error}"

    def waiting_in(function: str) -> bool:
        """The worker's innermost Python frame is `function`'s: it is blocked in the C call that function made."""
        frame = sys._current_frames().get(worker.get("ident", 0))
        return frame is not None and frame.f_code.co_name == function

    def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 30
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(what)
            time.sleep(0.005)

    with tracer.start_as_current_span("request A"):
        request_a = pool.submit(execute)
    wait_for(lambda: waiting_in("execute"), "request A waits in recv")
    far.close()  # the runner went away: A ends with an EOF, the worker goes idle
    request_a.result(timeout=30)
    wait_for(lambda: waiting_in("_worker"), "the worker waits for its next item")
    returned = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker["ident"]), ctypes.py_object(SystemExit))
    started = time.monotonic()
    with tracer.start_as_current_span("request B") as span_b:
        request_b: Future[object] = pool.submit(lambda: "B done")
    # Unguarded and unhealed, B never completes: 3 s show that it hangs. Otherwise it completes, however loaded.
    patience = 30.0 if guard or heal else 3.0
    b = outcome(request_b, patience)
    b_seconds = round(time.monotonic() - started, 3)
    c = outcome(pool.submit(lambda: "C done"), patience)
    stallwatch.shutdown(timeout=5)
    b_trace = format(span_b.get_span_context().trace_id, "032x")
    return {"set_async_exc_returned": returned, "B": b, "B_seconds": b_seconds, "C": c, "B_trace": b_trace}


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
        result = executor_wedge(out, argv[2] == "guard", argv[3] == "heal", 3_600_000)
    else:
        raise SystemExit(f"unknown demo role {role!r}")
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # a wedged pool would also hang interpreter exit (concurrent.futures joins its workers)
