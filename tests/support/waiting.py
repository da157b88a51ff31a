"""Waiting on a condition, never on the clock: a poll with a generous deadline, so that a loaded machine only
makes a test slower, never wrong."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
DEADLINE = 30.0  # seconds: far beyond what any condition here takes on a loaded 2-core machine


def wait_until(predicate: Callable[[], T], what: str, timeout: float = DEADLINE, interval: float = 0.02) -> T:
    """The first truthy value of `predicate()`, polled every `interval` s; fails naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting until {what}"
        time.sleep(interval)
    return value


async def until(predicate: Callable[[], T], what: str, timeout: float = DEADLINE, interval: float = 0.01) -> T:
    """`wait_until` for a coroutine: the event loop keeps running between polls."""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting until {what}"
        await asyncio.sleep(interval)
    return value
