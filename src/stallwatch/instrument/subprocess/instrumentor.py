"""`SubprocessInstrumentor`: one CLIENT span and three metrics per child process, whichever way it is
spawned (`popen`, `posix_spawn`, `loops`; `os.fork()` is counted by the fork guard, not spanned).

What it switches on and off is `installation`'s, which `setup()` switches without this module.
"""

from __future__ import annotations

from collections.abc import Collection

from .._instrumentor import InstallationInstrumentor
from .installation import INSTALLATION


class SubprocessInstrumentor(InstallationInstrumentor, installation=INSTALLATION):
    """Spans and metrics for every child process (see `stallwatch.instrument.subprocess`).

    Keyword arguments of `instrument()`: `tracer_provider`, `meter_provider` (default: the global
    ones) and `settings` (a `stallwatch.Settings`: argument recording, scrub patterns, propagation
    to children; default: read from the environment).
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return ()  # the standard library's; uvloop's loop methods are wrapped when it is installed
