"""Scenario for tests/bench/alert_timeline.py: the incident timeline of one uvloop host, for the alerts.

Usage: python dash_timeline.py PLAN_JSON
PLAN_JSON holds the seconds of each step: "block_short" and "block_long" (sync code blocking the event
loop, not the GIL), "gil" (a C call that holds the GIL), "spawn" (each of two uvloop spawns whose forked
child waits that long in a library's after-fork handler before exec), "gap" (quiet time after each of
those), "wedge_held" (from the wedge to the final freeze), "overrun_after" (from the wedge to the
overrun) and "overrun" (executor work under a 0.5 s `execution_timeout` that runs that long), "final"
(how long the last spawn's child waits before exec: longer than the caller lets the host live).

stallwatch runs with its defaults and its watchdog; the caller sets STALLWATCH_GUARD_ASYNC_EXC=false, or
the stale SystemExit would be refused and there would be no wedge. Protocol of dash_common.py ("ready",
"go"); each step prints a JSON line {"event": name, "phase": "start" or "end", "t": Unix time}. After
"final_freeze" starts the host stays frozen until the caller kills it.
"""

import ctypes
import json
import os
import sys
import time

SPAWN_HOLD = {"seconds": 0.0}


def slow_library_child_handler() -> None:
    if SPAWN_HOLD["seconds"]:
        time.sleep(SPAWN_HOLD["seconds"])  # in the forked copy, before exec: the host holds the GIL meanwhile


os.register_at_fork(after_in_child=slow_library_child_handler)

import stallwatch

# uvloop's own fork, as in the freeze incident: the held spawns need the fork (by default stallwatch spawns
# by vfork under uvloop, and no at-fork handler runs in the child)
session = stallwatch.setup(uvloop_spawn="fork")
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"

import asyncio
import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import uvloop
from dash_common import ready, wedge

PLAN: dict[str, float] = json.loads(sys.argv[1])
RUNNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")
SLOW = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slow")
HOLD_GIL = ctypes.PyDLL(None).sleep  # a PyDLL call keeps the GIL for its whole duration


def mark(name: str, phase: str) -> None:
    print(json.dumps({"event": name, "phase": phase, "t": time.time()}), flush=True)


@contextlib.contextmanager
def event(name: str) -> Iterator[None]:
    mark(name, "start")
    yield
    mark(name, "end")


async def held_spawn(seconds: float) -> None:
    SPAWN_HOLD["seconds"] = seconds
    child = await asyncio.create_subprocess_exec("/bin/true")
    SPAWN_HOLD["seconds"] = 0.0
    await child.wait()


def overrun_work(seconds: float) -> None:
    time.sleep(seconds)
    mark("overrun", "end")


async def overrun(seconds: float) -> None:
    mark("overrun", "start")
    with contextlib.suppress(TimeoutError):
        async with stallwatch.execution_timeout(0.5, name="timeline"):
            await asyncio.get_running_loop().run_in_executor(SLOW, overrun_work, seconds)


async def main() -> None:
    for name, seconds in (("block_short", PLAN["block_short"]), ("block_long", PLAN["block_long"])):
        with event(name):
            time.sleep(seconds)  # blocks the event loop, not the GIL: a loop_blocked freeze
        await asyncio.sleep(PLAN["gap"])
    with event("gil_hold"):
        HOLD_GIL(round(PLAN["gil"]))
    await asyncio.sleep(PLAN["gap"])
    for name in ("spawn_1", "spawn_2"):
        with event(name):
            await held_spawn(PLAN["spawn"])
        await asyncio.sleep(PLAN["gap"])
    with event("sigsegv_child"):
        victim = await asyncio.create_subprocess_exec("sh", "-c", "kill -SEGV $$")  # not the server's signal
        await victim.wait()
    await asyncio.sleep(PLAN["gap"] / 3)
    mark("wedge", "start")
    wedged_at = time.monotonic()
    await asyncio.to_thread(wedge, RUNNER)
    await asyncio.sleep(PLAN["overrun_after"])
    await overrun(PLAN["overrun"])
    await asyncio.sleep(max(0.0, wedged_at + PLAN["wedge_held"] - time.monotonic()))
    mark("final_freeze", "start")
    await held_spawn(PLAN["final"])


async def run() -> None:
    await asyncio.to_thread(ready, watchdog_pid=session.watchdog_pid)
    await main()


uvloop.run(run())
