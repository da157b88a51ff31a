"""Scenario for the Wedges dashboard's state alerts: incident 002's wedge, left in place.

Usage: python dash_wedge_held.py
stallwatch runs with the raw async-exception guard off and healing off (the default). A stale
SystemExit kills the only worker of the 1-worker "runner" pool as it dequeues an item: the item is
orphaned and its future never completes. Two more items then wait with no live worker, and the
scenario holds that wedge until the test releases it (once the state alerts fire); it stays after that.
"""

import stallwatch

stallwatch.setup(guard_async_exc=False)

import ctypes
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dash_common import done, hold, ready

RUNNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")


def wedge(pool: ThreadPoolExecutor) -> list:
    idents = []
    pool.submit(lambda: idents.append(threading.get_ident())).result(2)
    time.sleep(0.05)
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(idents[0]), ctypes.py_object(SystemExit))
    orphaned = pool.submit(lambda: "B done")  # the worker dequeues it and dies
    time.sleep(0.5)
    return [orphaned, pool.submit(lambda: "C done"), pool.submit(lambda: "D done")]


ready()
futures = wedge(RUNNER)
hold("wedge")  # nothing heals it
done(pending=sum(not future.done() for future in futures))
