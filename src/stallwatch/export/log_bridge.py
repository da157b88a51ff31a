"""Hands the host's log records to OpenTelemetry without putting a handler on the root logger.

A handler on the root logger changes what the host prints: Python writes WARNING and above to
stderr only while no handler saw a record (`logging.lastResort`), so a root handler of ours
silences a host that never configured logging, and keeping `lastResort` there instead prints every
line twice once the host adds its own handler. The bridge wraps `Logger.callHandlers`, the step
every record takes once it passed its logger's level and filters, and gives stallwatch's handler
exactly the records a root handler would have received, after the host's handlers had them.
`logging` has no hook for this: a record factory sees records before the level and filter checks.

Invariants: the host's handlers see the same records in the same order, `lastResort` still fires
when the host has no handler, and a record is handed over at most once (a record logged while the
bridge's handler runs, by the SDK or an exporter, goes to the host's handlers only). A record that
an OpenTelemetry logging handler of the host's took on its way to the root logger (dstack's, with
`DSTACK_OTEL_LOGS_ENABLED`) is the host's to export, and is not handed over: one export per record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import wrapt

from ..forksafe import otel_compat

_handler: logging.Handler | None = None
_installed = False
_busy = threading.local()  # set while the bridge's handler runs in this thread


_exports: dict[type, bool] = {}  # handler class -> whether it is an OpenTelemetry logging handler


def _exported_by_host(handler: logging.Handler) -> bool:
    kind = type(handler)
    exports = _exports.get(kind)
    if exports is None:
        exports = _exports[kind] = otel_compat.logging_handler_provider(handler) is not None
    return exports


def _to_hand_over(logger: logging.Logger, level: int) -> bool:
    """Whether a record of `level` handled by `logger` propagates up to the root logger's handlers
    without an OpenTelemetry logging handler of the host's taking it on the way."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(level >= handler.level and _exported_by_host(handler) for handler in current.handlers):
            return False
        if not current.propagate:
            return current.parent is None
        current = current.parent
    return True


def _call_handlers(
    wrapped: Callable[..., None], instance: logging.Logger, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    wrapped(*args, **kwargs)
    handler = _handler
    if handler is None or getattr(_busy, "on", False):
        return
    record = args[0] if args else kwargs["record"]
    if record.levelno < handler.level or not _to_hand_over(instance, record.levelno):
        return
    _busy.on = True
    try:
        handler.handle(record)
    finally:
        _busy.on = False


def install(handler: logging.Handler) -> None:
    """Give `handler` every record that reaches the root logger, from now on, without adding it there."""
    global _handler, _installed
    _handler = handler
    if not _installed:
        wrapt.wrap_function_wrapper(logging.Logger, "callHandlers", _call_handlers)
        _installed = True


def uninstall() -> None:
    """Stop handing records over and restore `Logger.callHandlers`."""
    global _handler, _installed
    _handler = None
    if _installed:
        # footprint: the module loads the propagators; only an uninstall needs it
        from opentelemetry.instrumentation.utils import unwrap

        unwrap(logging.Logger, "callHandlers")
        _installed = False


def installed_handler() -> logging.Handler | None:
    """The handler records are handed to, or None."""
    return _handler
