"""`LazyExporter`: an OTLP exporter built at its first use, on the thread that exports.

Building an OTLP/HTTP exporter loads the SDK's exporter modules, protobuf and `requests`, none of
which the host needs before the first export (`OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BLRP_SCHEDULE_DELAY`,
`OTEL_METRIC_EXPORT_INTERVAL` after `setup()` at the earliest, unless a batch fills first). The
pipeline wraps one only when building it could not refuse the settings in force (`pipeline`), so a
bad setting is still reported by `setup()`; should the build fail all the same, the batch fails
(counted by the guarded exporter around it), one WARNING says why, and the next export tries again
(a build that failed once, e.g. on an import racing the host's, may succeed then).

Contract: built at most once per process, under `_BUILDING` (a flush may race the export thread),
and never while the process forks: a fork waits for a build under way (at most `_FORK_WAIT`
seconds), so that no child inherits a module half imported by a thread it does not have. A shutdown
or flush before the first build builds nothing (there is nothing to send). A build is local work,
left out of a shutdown's budget on the collector up to `BUILD_CAP` seconds more (`export.budget`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

_log = logging.getLogger("stallwatch")
_BUILDING = threading.Lock()  # held while an exporter is built, and across a fork
_FORK_WAIT = 5.0  # seconds a fork waits for a build under way, then goes ahead
_held_across_fork = [False]
# The longest a shutdown waits for exporter builds beyond its budget: twice the slowest build seen on
# a loaded 2-core machine, and short enough that an exit with the default budget ends within docker
# stop's grace period.
BUILD_CAP = 5.0
# (seconds spent on finished builds, monotonic start of the build under way or 0), replaced whole
_clock = [(0.0, 0.0)]


def _before_fork() -> None:
    _held_across_fork[0] = _BUILDING.acquire(timeout=_FORK_WAIT)


def _after_fork() -> None:
    if _held_across_fork[0]:
        _held_across_fork[0] = False
        _BUILDING.release()


def build_seconds() -> float:
    """Seconds this process has spent building exporters, the build under way included."""
    spent, since = _clock[0]
    return spent + (time.monotonic() - since if since else 0.0)


def wait_for_build(timeout: float) -> None:
    """Wait up to `timeout` seconds for a build under way (none: return at once)."""
    if _clock[0][1] and _BUILDING.acquire(timeout=max(timeout, 0.0)):
        _BUILDING.release()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork, after_in_child=_after_fork)


class LazyExporter:
    """A span, log record or metric exporter made by `build()` at its first `export`; `failure` is
    the export result returned while it cannot be built. `preferences` (metrics only): the preferred
    temporality and aggregation the built exporter will have, for the reader made before it."""

    def __init__(self, build: Callable[[], Any], failure: Any, preferences: tuple[Any, Any] | None = None) -> None:
        self._build = build
        self._failure = failure
        self._built: Any = None
        self._warned = False
        if preferences is not None:
            self._preferred_temporality, self._preferred_aggregation = preferences

    def built(self) -> Any:
        """The exporter, built now if it was not yet; None if it cannot be built (now)."""
        if self._built is not None:
            return self._built
        with _BUILDING:
            if self._built is None:
                spent = _clock[0][0]
                _clock[0] = (spent, time.monotonic())
                try:
                    self._built = self._build()
                except Exception as exc:
                    if not self._warned:
                        self._warned = True
                        _log.warning("stallwatch: %s; this signal's batches fail until it can be built.", exc)
                finally:
                    _clock[0] = (spent + time.monotonic() - _clock[0][1], 0.0)
        return self._built

    def export(self, batch: Any, *args: Any, **kwargs: Any) -> Any:
        exporter = self.built()
        return self._failure if exporter is None else exporter.export(batch, *args, **kwargs)

    def force_flush(self, *args: Any, **kwargs: Any) -> bool:
        exporter = self._built
        return True if exporter is None else bool(exporter.force_flush(*args, **kwargs))

    def shutdown(self, *args: Any, **kwargs: Any) -> None:
        exporter = self._built
        if exporter is not None:
            exporter.shutdown(*args, **kwargs)
