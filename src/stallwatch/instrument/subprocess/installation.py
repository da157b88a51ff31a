"""Switching the subprocess instrumentation on and off (`INSTALLATION`), for `SubprocessInstrumentor`
and for `setup()`, which installs it without loading the instrumentor.

Its state (tracer, instruments, settings) is made by each `install()`; `install`/`uninstall` can
alternate any number of times without stacking wrappers, and the after-fork handler is registered on
the first `install()`, never at import.
"""

from __future__ import annotations

from typing import Any

from opentelemetry import trace

from ... import telemetry
from ..._version import __version__
from ...core.faults import Counts
from .. import child_fate
from .._lifecycle import ForkReset, Installation, start_meter, start_settings
from . import children, loops, popen, posix_spawn
from .children import Active, SpawnDurations, State


def _forget_the_parents_children() -> None:
    """In a fork child that lives on: the parent's children are the parent's to report; this
    process would otherwise end them again at its own shutdown."""
    children.forget_all()
    posix_spawn.BY_PID.clear()


_FORK_RESET = ForkReset(_forget_the_parents_children)  # starts nothing: clears three maps


def install(**kwargs: Any) -> None:
    """`SubprocessInstrumentor.instrument()`'s work, with its keyword arguments."""
    settings = start_settings(kwargs, "subprocess")
    if settings is None:
        return
    meter_ = start_meter(kwargs)
    spawn_duration = SpawnDurations(meter_, telemetry.SUBPROCESS_SPAWN_DURATION)
    children.ACTIVE = State(
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


def uninstall(**kwargs: Any) -> None:
    children.ACTIVE = None
    child_fate.uninstall()
    popen.uninstall()
    posix_spawn.uninstall()
    loops.uninstall()


INSTALLATION = Installation(install, uninstall)
