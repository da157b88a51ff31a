"""Scenario for the Freezes dashboard: a GIL-held freeze (incident 000) and the spawns around it.

Usage: python dash_freeze.py
Under uvloop: quick spawns, a child that kills itself with SIGSEGV, an os.fork() child that lives on, a
3 s event-loop block (shorter than a scrape interval: seen afterwards, by its count and duration), then
one spawn whose forked child waits in a library's after-fork handler before exec until the test releases
it (the host holds the GIL meanwhile, its scrape endpoint cannot answer, the watchdog's can), then more
spawns.
"""

import os
import time

from dash_common import done, ready, setup_with_fork_hold

SHORT_FREEZE_SECONDS = 3.0
FORK_HOLD, session = setup_with_fork_hold("freeze")

import asyncio

import uvloop

import stallwatch


async def spawn_true(count: int) -> None:
    for _ in range(count):
        child = await asyncio.create_subprocess_exec("/bin/true")
        await child.wait()
        await asyncio.sleep(0.2)


async def main() -> None:
    await spawn_true(3)
    await asyncio.sleep(1.5)
    victim = await asyncio.create_subprocess_exec("sh", "-c", "kill -SEGV $$")  # not the server's signal
    await victim.wait()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    await spawn_true(3)
    time.sleep(SHORT_FREEZE_SECONDS)  # blocks the event loop, not the GIL: a loop_blocked freeze
    await asyncio.sleep(1.5)
    FORK_HOLD.on = True
    child = await asyncio.create_subprocess_exec("/bin/true")
    FORK_HOLD.on = False
    await child.wait()
    await spawn_true(5)
    await asyncio.sleep(2.0)  # the watchdog sees the thaw and records the freeze's duration


async def run() -> None:
    await spawn_true(1)  # a server that has spawned before: its spawn series are there at the first scrape
    await asyncio.to_thread(ready, watchdog_pid=session.watchdog_pid)
    await main()
    await asyncio.to_thread(done)


uvloop.run(run())
stallwatch.shutdown(timeout=5)
