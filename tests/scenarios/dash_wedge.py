"""Scenario for the Wedges dashboard: incident 002's dead worker, a busy queue, interrupts and an overrun.

Usage: python dash_wedge.py
stallwatch runs with the raw async-exception guard off and healing on. A stale SystemExit kills the
1-worker "runner" pool's worker (worker death, orphaned item, healed, wedges); a 1-worker "busy" pool
gets a queue; interrupt_thread() delivers, is revoked (target parked in C) and refused (idle); an
execution_timeout expires while its executor work keeps running until the test releases it.
"""

import stallwatch

stallwatch.setup(guard_async_exc=False, executor_heal=True)

import asyncio
import contextlib
import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dash_common import done, hold, ready

RUNNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")
BUSY = ThreadPoolExecutor(max_workers=1, thread_name_prefix="busy")
INTERRUPTS = ThreadPoolExecutor(max_workers=2, thread_name_prefix="interrupts")
SLOW = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow")


def stale_exception_kills_a_worker(pool: ThreadPoolExecutor) -> None:
    idents = []
    pool.submit(lambda: idents.append(threading.get_ident())).result(2)
    time.sleep(0.05)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(idents[0]), ctypes.py_object(SystemExit))
    item = pool.submit(lambda: "B done")
    with contextlib.suppress(stallwatch.WorkerDied):  # healed
        item.result(timeout=3)


def busy_queue(pool: ThreadPoolExecutor) -> list:
    return [pool.submit(time.sleep, 3.0), *(pool.submit(time.sleep, 0.2) for _ in range(3))]


def python_loop(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pass


def interrupts(pool: ThreadPoolExecutor) -> list[str]:
    outcomes = []
    for work, wait in ((lambda: python_loop(2.0), 1.0), (lambda: time.sleep(1.0), 0.2)):
        handle = {}

        def target(work=work, handle=handle) -> None:
            handle["work"] = stallwatch.current_work()
            work()

        future = pool.submit(target)
        time.sleep(0.2)
        outcomes.append(stallwatch.interrupt_thread(handle["work"], timeout=wait))
        with contextlib.suppress(stallwatch.Interrupted):
            future.result(5)
        outcomes.append(stallwatch.interrupt_thread(handle["work"], timeout=wait))  # idle now: refused
    return outcomes


async def overrun(pool: ThreadPoolExecutor) -> None:
    try:
        async with stallwatch.execution_timeout(0.5, name="trace"):
            await asyncio.get_running_loop().run_in_executor(pool, hold, "overrun")
    except TimeoutError:
        pass


async def main() -> dict:
    await asyncio.to_thread(stale_exception_kills_a_worker, RUNNER)
    queued = busy_queue(BUSY)
    outcomes = await asyncio.to_thread(interrupts, INTERRUPTS)
    await overrun(SLOW)
    for future in queued:
        future.result(5)
    # The one-worker pool runs this once the held overrun has ended and been recorded: "done" comes after
    # it, and the test's last scrape, after "done", carries the overrun's duration.
    await asyncio.get_running_loop().run_in_executor(SLOW, int)
    return {"interrupts": outcomes}


async def run() -> None:
    await asyncio.to_thread(ready)
    result = await main()
    await asyncio.to_thread(done, **result)


asyncio.run(run())
stallwatch.shutdown(timeout=5)
