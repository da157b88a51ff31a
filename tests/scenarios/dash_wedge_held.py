"""Scenario for the Wedges dashboard's state alerts: incident 002's wedge, left in place.

Usage: python dash_wedge_held.py
stallwatch runs with the raw async-exception guard off and healing off (the default). A stale
SystemExit kills the only worker of the 1-worker "runner" pool as it dequeues an item: the item is
orphaned and its future never completes. Two more items then wait with no live worker, and the
scenario holds that wedge until the test releases it (once the state alerts fire); it stays after that.
"""

import stallwatch

stallwatch.setup(guard_async_exc=False)

from concurrent.futures import ThreadPoolExecutor

from dash_common import done, hold, ready, wedge

RUNNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runner")


ready()
futures = wedge(RUNNER)
hold("wedge")  # nothing heals it
done(pending=sum(not future.done() for future in futures))
