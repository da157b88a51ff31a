"""Shared protocol of the dash_*.py scenarios that tests/test_dashboards.py runs under a real Prometheus.

A scenario sets stallwatch up (OTEL_METRICS_EXPORTER=prometheus and the ports come from the
environment), prints a JSON line with "ready", waits for a line on stdin (Prometheus scrapes it by
then), does its work, prints a JSON line with "done" and keeps serving its metrics until stdin closes.
A state that a 15 s scrape must see is held with `hold(name)` until the test releases it.
"""

import ctypes
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


def ready(**info: object) -> None:
    print(json.dumps({"ready": True, **info}), flush=True)
    sys.stdin.readline()


def done(**info: object) -> None:
    print(json.dumps({"done": True, **info}), flush=True)
    sys.stdin.read()


def hold(name: str, timeout: float = 240.0) -> None:
    """Print a JSON line {"holding": name} and wait until the file $DASH_RELEASE_DIR/name exists (the test
    creates it once Prometheus has seen what is held), or `timeout` passes."""
    release = os.path.join(os.environ["DASH_RELEASE_DIR"], name)
    print(json.dumps({"holding": name}), flush=True)
    deadline = time.monotonic() + timeout
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.1)


class ForkHold:
    """A library's after-fork handler: while `on`, each forked child waits in `hold(name)` before it execs, and
    a host spawning with uvloop's own fork waits for that exec holding the GIL, frozen meanwhile."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.on = False
        os.register_at_fork(after_in_child=self._in_child)

    def _in_child(self) -> None:
        if self.on:
            hold(self.name)  # in the forked copy, before exec


def setup_with_fork_hold(name: str) -> tuple[ForkHold, Any]:
    """A `ForkHold(name)` registered before stallwatch is imported (the fork guard then cannot skip it, as a
    library imported first), then stallwatch set up with uvloop's own fork (the opt-out of the default vfork
    spawn, so that the handler runs in its child) and a 0.5 s freeze threshold; returns the hold and the
    session once its freeze watchdog watches. Call it before anything imports stallwatch."""
    assert "stallwatch" not in sys.modules, "the hold must be registered before stallwatch is imported"
    fork_hold = ForkHold(name)
    import stallwatch

    session = stallwatch.setup(freeze_threshold=0.5, uvloop_spawn="fork")
    assert session.wait_for_watchdog(30), "the freeze watchdog is not watching"
    return fork_hold, session


def wedge(pool: ThreadPoolExecutor) -> list[Future]:
    """Incident 002's wedge in a 1-worker `pool` (run with STALLWATCH_GUARD_ASYNC_EXC=false): a stale SystemExit
    kills its only worker as it dequeues an item, which is orphaned; two more items then wait with no live worker.
    Returns the three futures, none of which completes."""
    idents = []
    pool.submit(lambda: idents.append(threading.get_ident())).result(2)
    time.sleep(0.05)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(idents[0]), ctypes.py_object(SystemExit))
    orphaned = pool.submit(lambda: "B done")  # the worker dequeues it and dies
    time.sleep(0.5)
    return [orphaned, pool.submit(lambda: "C done"), pool.submit(lambda: "D done")]
