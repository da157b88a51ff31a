"""Scenario: incident 002 in its smallest form, on a 1-worker ThreadPoolExecutor.

Usage: python executor_wedge.py {guard|noguard} {heal|noheal} DIR
Item A parks in sock.recv; the peer closes, so A ends by another path and the worker goes idle;
then, as NDIF's kill_thread does, SystemExit is injected into that worker with ctypes. Item B is
submitted next, then C. Prints one JSON line: what B and C gave, how long B took and B's trace id.
"""

import ctypes
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

import stallwatch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.waiting import wait_until

guard, heal, out = sys.argv[1] == "guard", sys.argv[2] == "heal", sys.argv[3]
stallwatch.setup(file_dir=out, guard_async_exc=guard, executor_heal=heal, metric_export_interval_ms=200)

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11

from opentelemetry import trace

pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")
near, far = socket.socketpair()
worker = {}


def execute() -> bytes:
    worker["ident"] = threading.get_ident()
    return near.recv(10)


def waiting_in(function: str) -> bool:
    """The worker's innermost Python frame is `function`'s: it is blocked in the C call that function made."""
    frame = sys._current_frames().get(worker.get("ident", 0))
    return frame is not None and frame.f_code.co_name == function


def outcome(future, timeout: float) -> str:
    try:
        return str(future.result(timeout=timeout))
    except FutureTimeout:
        return "hung"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


with trace.get_tracer("scenario").start_as_current_span("request A"):
    item_a = pool.submit(execute)
wait_until(lambda: waiting_in("execute"), "item A waits in recv")
far.close()  # the runner went away: A ends with a ConnectionError-free EOF, the worker goes idle
item_a.result(timeout=30)
wait_until(lambda: waiting_in("_worker"), "the worker waits for its next item")
returned = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(worker["ident"]), ctypes.py_object(SystemExit))
started = time.monotonic()
with trace.get_tracer("scenario").start_as_current_span("request B") as request_b:
    item_b = pool.submit(lambda: "B done")
# Without the guard or healing B never completes: 3 s show it hangs. Otherwise it completes, however loaded.
patience = 30.0 if guard or heal else 3.0
b = outcome(item_b, patience)
b_seconds = time.monotonic() - started
c = outcome(pool.submit(lambda: "C done"), patience)
stallwatch.shutdown(timeout=5)
b_trace = format(request_b.get_span_context().trace_id, "032x")
print(
    json.dumps(
        {"set_async_exc_returned": returned, "B": b, "B_seconds": round(b_seconds, 3), "C": c, "B_trace": b_trace}
    )
)
sys.stdout.flush()
os._exit(0)  # a wedged pool would also hang interpreter exit (concurrent.futures joins its workers)
