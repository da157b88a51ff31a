"""Scenario for a host killed while frozen (incident 000's ending: the load balancer's health check killed it).

Usage: python dash_killed.py
Under uvloop: one spawn before "ready", then one whose forked child waits in a library's after-fork
handler before exec (the host holds the GIL meanwhile) until the test has seen the freeze and SIGKILLs
the host; the test then releases the child, which execs and exits. The watchdog reports the death in its
last scrape and exits.
"""

from dash_common import ready, setup_with_fork_hold

FORK_HOLD, session = setup_with_fork_hold("freeze")

import asyncio

import uvloop


async def spawn_true() -> None:
    child = await asyncio.create_subprocess_exec("/bin/true")
    await child.wait()


async def run() -> None:
    await spawn_true()  # a server that has spawned before: its spawn series are there at the first scrape
    await asyncio.to_thread(ready, watchdog_pid=session.watchdog_pid)
    FORK_HOLD.on = True
    await spawn_true()  # never returns: the test kills the host while it is frozen in here


uvloop.run(run())
