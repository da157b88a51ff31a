"""Subprocess instrumentation: one CLIENT span and three metrics per child process."""

from .children import (
    COMPONENT,
    EARLY_SIGNAL_SECONDS,
    SETTING,
    SubprocessInstrumentor,
    _popen_command,
    describe,
    end_open_spans,
    popen_method,
    unrecorded,
)

__all__ = [
    "COMPONENT",
    "EARLY_SIGNAL_SECONDS",
    "SETTING",
    "SubprocessInstrumentor",
    "_popen_command",
    "describe",
    "end_open_spans",
    "popen_method",
    "unrecorded",
]
