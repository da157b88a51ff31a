"""Subprocess instrumentation: one CLIENT span and three metrics per child process.

Every path a server spawns through is covered once: `subprocess.Popen` (`popen`), a loop's
`subprocess_exec`/`subprocess_shell` on the standard loop and on uvloop (`loops`), and `os.posix_spawn*`
called directly (`posix_spawn`); `children` keeps each child's record from its spawn to its reaping,
and `installation` switches it all on and off (for `setup()`, and for `instrumentor`'s
`SubprocessInstrumentor`, loaded at its first lookup here). Every wrapper hands the host the same result,
exception, pid and pipes as the bare call, and the span is ended before the host hears of the exit.
A failure inside stallwatch is counted
(`stallwatch.instrumentation.errors{stallwatch.component=subprocess}`) and logged once, naming
`STALLWATCH_INSTRUMENT_SUBPROCESS`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .arguments import popen_command, popen_method
from .children import COMPONENT, EARLY_SIGNAL_SECONDS, SETTING, describe, end_open_spans, unrecorded
from .installation import INSTALLATION

if TYPE_CHECKING:
    from .instrumentor import SubprocessInstrumentor


def __getattr__(name: str) -> Any:
    """`SubprocessInstrumentor`, whose module loads at its first lookup (`BaseInstrumentor` loads
    `packaging` and the semantic conventions, which `setup()` does without)."""
    if name != "SubprocessInstrumentor":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # footprint: the instrumentor loads when asked for
    from .instrumentor import SubprocessInstrumentor

    return SubprocessInstrumentor


__all__ = [
    "COMPONENT",
    "EARLY_SIGNAL_SECONDS",
    "INSTALLATION",
    "SETTING",
    "SubprocessInstrumentor",
    "describe",
    "end_open_spans",
    "popen_command",
    "popen_method",
    "unrecorded",
]
