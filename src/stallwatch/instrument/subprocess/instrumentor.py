"""`SubprocessInstrumentor`: one CLIENT span and three metrics per child process, whichever way it is
spawned (`popen`, `posix_spawn`, `loops`; `os.fork()` is counted by the fork guard, not spanned).

Its state (tracer, instruments, settings) is made by each `instrument()` and held by the instrumentor;
`instrument`/`uninstrument` can alternate any number of times without stacking wrappers, and the
after-fork handler is registered on the first `instrument()`, never at import.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

from ... import telemetry
from ..._version import __version__
from ...core.faults import Counts
from .. import child_fate
from .._lifecycle import ForkReset, start_meter, start_settings
from . import children, loops, popen, posix_spawn
from .children import Active, SpawnDurations, State


def _forget_the_parents_children() -> None:
    """In a fork child that lives on: the parent's children are the parent's to report; this
    process would otherwise end them again at its own shutdown."""
    children.forget_all()
    posix_spawn.BY_PID.clear()


_FORK_RESET = ForkReset(_forget_the_parents_children)  # starts nothing: clears three maps


class SubprocessInstrumentor(BaseInstrumentor):
    """Spans and metrics for every child process (see `stallwatch.instrument.subprocess`).

    Keyword arguments of `instrument()`: `tracer_provider`, `meter_provider` (default: the global
    ones) and `settings` (a `stallwatch.Settings`: argument recording, scrub patterns, propagation
    to children; default: read from the environment).
    """

    _state: State | None = None

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # the standard library's; uvloop's loop methods are wrapped when it is installed

    def _instrument(self, **kwargs: Any) -> None:
        settings = start_settings(kwargs, "subprocess")
        if settings is None:
            return
        meter_ = start_meter(kwargs)
        spawn_duration = SpawnDurations(meter_, telemetry.SUBPROCESS_SPAWN_DURATION)
        self._state = children.ACTIVE = State(
            tracer=trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE, __version__, kwargs.get("tracer_provider")),
            spawn_duration=spawn_duration,
            exits=Counts(meter_, telemetry.SUBPROCESS_EXITS),  # counted as each child is reaped
            active=Active(meter_, before=spawn_duration.drain),
            record_args=settings.record_args,
            patterns=settings.scrub_patterns,
            propagate=settings.propagate_to_children,
        )
        popen.install()
        posix_spawn.install()
        loops.install()
        _FORK_RESET.register()
        child_fate.install()

    def _uninstrument(self, **kwargs: Any) -> None:
        self._state = children.ACTIVE = None
        child_fate.uninstall()
        popen.uninstall()
        posix_spawn.uninstall()
        loops.uninstall()
