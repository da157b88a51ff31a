"""`Budget`: the time a shutdown or flush gives the collector, or an export before it counts as slow,
extended by exporter builds.

Exporters built at their first export (`export.lazy`) may be built inside a shutdown, a flush or an
export: that is local work (imports, protobuf), not the collector's time, so every wait of a
shutdown or flush measures its budget with one of these, and so does the slow-export back-off
(`export.guarded`). Reads `export.lazy` only where it is loaded: a process that builds its
exporters at `setup()` gets a plain deadline, and no fork hook of `export.lazy`.
"""

from __future__ import annotations

import sys
import threading
import time


class Budget:
    """`timeout` seconds from now, plus the time exporters spend being built meanwhile, up to
    `export.lazy.BUILD_CAP` seconds more."""

    def __init__(self, timeout: float) -> None:
        self._lazy = sys.modules.get("stallwatch.export.lazy")
        self._end = time.monotonic() + timeout
        self._built_before = self._lazy.build_seconds() if self._lazy is not None else 0.0

    def _credit(self) -> float:
        lazy = self._lazy
        return min(lazy.build_seconds() - self._built_before, lazy.BUILD_CAP) if lazy is not None else 0.0

    def left(self) -> float:
        """Seconds left (negative once spent)."""
        return self._end + self._credit() - time.monotonic()

    def wait(self, done: threading.Event) -> bool:
        """Wait for `done` until the budget is spent; True if it was set. A build under way when the
        time is up is waited for on its lock, not polled: the poll would take CPU from the build."""
        while True:
            left = self.left()
            if left <= 0:
                return done.is_set()
            if done.wait(left):
                return True
            if self._lazy is not None:
                self._lazy.wait_for_build(self._lazy.BUILD_CAP - self._credit())
