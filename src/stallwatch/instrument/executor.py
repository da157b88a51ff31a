"""`ExecutorInstrumentor`: every `concurrent.futures.ThreadPoolExecutor`, including an event loop's
default executor (see `pools`, which holds the instrumentation and the other names this module passes
on; `setup()` installs it through `pools.INSTALLATION`, without this module)."""

from __future__ import annotations

from collections.abc import Collection

from ._instrumentor import InstallationInstrumentor
from .pools import (
    EXECUTORS,
    INSTALLATION,
    WorkerDeath,
    drain_histograms,
    end_span_orphaned,
    executor_name,
    on_worker_death,
    state_of,
)


class ExecutorInstrumentor(InstallationInstrumentor, installation=INSTALLATION):
    """Instruments every ThreadPoolExecutor built after `instrument()` (and the death hook for all).

    Keyword arguments of `instrument()`: `meter_provider`, `tracer_provider` (default: the global
    ones) and `settings` (a `stallwatch.Settings`; default: read from the environment), which set
    the raw `SetAsyncExc` guard. The wedge detector is started separately (`detect.wedge.install`).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()


__all__ = [
    "EXECUTORS",
    "INSTALLATION",
    "ExecutorInstrumentor",
    "WorkerDeath",
    "drain_histograms",
    "end_span_orphaned",
    "executor_name",
    "on_worker_death",
    "state_of",
]
