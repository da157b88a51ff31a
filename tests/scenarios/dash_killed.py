"""Scenario for a host killed while frozen (incident 000's ending: the load balancer's health check killed it).

Usage: python dash_killed.py
Under uvloop: one spawn before "ready", then one whose forked child waits in a library's after-fork
handler before exec (the host holds the GIL meanwhile) until the test has seen the freeze and SIGKILLs
the host; the test then releases the child, which execs and exits. The watchdog reports the death in its
last scrape and exits.
"""

import os

HANG = {"on": False}


def slow_library_child_handler() -> None:
    if HANG["on"]:
        hold("freeze")  # in the forked copy, before exec: the host is frozen meanwhile


os.register_at_fork(after_in_child=slow_library_child_handler)

import stallwatch

# uvloop's own fork (the opt-out of the default vfork spawn): the library's handler runs in its child.
session = stallwatch.setup(freeze_threshold=0.5, uvloop_spawn="fork")
assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"

import asyncio

import uvloop
from dash_common import hold, ready


async def spawn_true() -> None:
    child = await asyncio.create_subprocess_exec("/bin/true")
    await child.wait()


async def run() -> None:
    await spawn_true()  # a server that has spawned before: its spawn series are there at the first scrape
    await asyncio.to_thread(ready, watchdog_pid=session.watchdog_pid)
    HANG["on"] = True
    await spawn_true()  # never returns: the test kills the host while it is frozen in here


uvloop.run(run())
