"""The cloud resource ledger: every create/delete call announces its intent before it is sent, and
its outcome once known, so that a host killed mid-call leaves evidence of what it asked for.

Instrumentations (Nebius) call `intent()` before the request leaves and `outcome()` when the answer
or the failure is known. The recorder is replaceable (`set_recorder()`): the journal plugs in a
durable one. The default writes one record per event to the `stallwatch.cloud` logger (INFO; a
failure at WARNING), with every known id as `stallwatch.cloud.*` attributes, inside the call's span;
`setup()`'s log handler exports them whatever `STALLWATCH_LOG_LEVEL` says.

Contract for a durable recorder: `intent()` returns once its record is on disk (a killed host leaves
an unconfirmed create); `outcome()` returns once its record is written to the page cache, and it
reaches the disk within the journal's flush period, so a host that dies after the answer never
leaves a false leak candidate. `EMIT_LATER` lets an instrumentation have the log records emitted
off the call's critical path, each in the span context it was recorded in.
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import logging
from collections.abc import Callable
from typing import Any, Protocol

from opentelemetry import context as context_api

from .. import telemetry
from .._record import Record
from ..core.scrub import clip_text
from .names import LOGGER_NAME

_log = logging.getLogger(LOGGER_NAME)
_log.setLevel(logging.INFO)
_ids = itertools.count(1)
MAX_FIELD_CHARS = 128  # per text field of an intent or outcome: ids, names and statuses are far shorter
EMIT_LATER: contextvars.ContextVar[Callable[[Callable[[], None]], None] | None] = contextvars.ContextVar(
    "stallwatch_ledger_emit_later", default=None
)
"""Set by an instrumentation around its recorder calls: `LogRecorder` then passes each log record, as a
callable that emits it in the span context it was recorded in, to this function instead of emitting it."""


class Intent(Record):
    """A create/delete about to be sent: what (`action` "create" or "delete", `resource_type` e.g.
    "compute.instance"), where (`rpc` e.g. "nebius.compute.v1.InstanceService/Create"), the span that
    carries it, the resource's id when known before the call (a delete's), and its number in this
    process. Text fields are normalised (`_required`, `_optional`)."""

    __slots__ = ("action", "number", "resource_id", "resource_type", "rpc", "span_id", "trace_id")
    action: str
    resource_type: str
    rpc: str
    trace_id: str
    span_id: str
    resource_id: str | None
    number: int

    def __init__(self, action: str, resource_type: str, rpc: str, trace_id: str, span_id: str,
                 resource_id: str | None = None, number: int | None = None) -> None:  # fmt: skip
        self._set(action=_required(action), resource_type=_required(resource_type), rpc=_required(rpc),
                  trace_id=_required(trace_id), span_id=_required(span_id), resource_id=_optional(resource_id),
                  number=next(_ids) if number is None else number)  # fmt: skip


class Outcome(Record):
    """What the cloud answered: the operation and resource ids, or the failure (`status`: a gRPC status
    name, or `timeout` / `cancelled` / an exception class). Text fields are normalised (`_required`,
    `_optional`)."""

    __slots__ = ("ok", "operation_id", "request_id", "resource_id", "status")
    ok: bool
    status: str
    operation_id: str | None
    resource_id: str | None
    request_id: str | None

    def __init__(self, ok: bool, status: str, operation_id: str | None = None, resource_id: str | None = None,
                 request_id: str | None = None) -> None:  # fmt: skip
        self._set(ok=ok, status=_required(status), operation_id=_optional(operation_id),
                  resource_id=_optional(resource_id), request_id=_optional(request_id))  # fmt: skip


# Every text field of an intent or outcome is made fit for a log record, a journal frame and an attribute:
# valid UTF-8 of at most `MAX_FIELD_CHARS` characters. A value that is no string (a buggy caller, a server
# answering odd metadata) becomes "?" for a required field and None for an optional one: the record is still
# written, since losing a create's intent is worse than losing one of its fields.
def _required(value: object) -> str:
    return clip_text(value, MAX_FIELD_CHARS) or "?"


def _optional(value: object) -> str | None:
    return clip_text(value, MAX_FIELD_CHARS)


class Recorder(Protocol):
    """Where intents and outcomes go (the default logs them; the journal will persist them)."""

    def intent(self, intent: Intent) -> None: ...

    def outcome(self, intent: Intent, outcome: Outcome) -> None: ...


_PAST = {"create": "created", "delete": "deleted"}


class LogRecorder:
    """Writes each intent and outcome as an INFO record of the `stallwatch.cloud` logger."""

    def intent(self, intent: Intent) -> None:
        _emit(logging.INFO, "cloud resource %s requested", (intent.action,), _attributes(intent))

    def outcome(self, intent: Intent, outcome: Outcome) -> None:
        message = (
            f"cloud resource {_PAST.get(intent.action, intent.action)}"
            if outcome.ok
            else (f"cloud resource {intent.action} failed")
        )
        attributes = {
            **_attributes(intent),
            telemetry.CLOUD_STATUS.name: outcome.status,
            **{
                key: value
                for key, value in (
                    (telemetry.CLOUD_OPERATION_ID.name, outcome.operation_id),
                    (telemetry.CLOUD_RESOURCE_ID.name, outcome.resource_id or intent.resource_id),
                    (telemetry.NEBIUS_REQUEST_ID.name, outcome.request_id),
                )
                if value
            },
        }
        _emit(logging.INFO if outcome.ok else logging.WARNING, message, (), attributes)


def _emit(level: int, message: str, args: tuple[Any, ...], attributes: dict[str, str]) -> None:
    """Emit one log record now, or hand it to `EMIT_LATER` with the current context (the call's span)."""
    later = EMIT_LATER.get()
    if later is None:
        _log.log(level, message, *args, extra=attributes)
    else:
        later(functools.partial(_emit_in, context_api.get_current(), level, message, args, attributes))


def _emit_in(context: context_api.Context, level: int, message: str, args: tuple[Any, ...],
             attributes: dict[str, str]) -> None:  # fmt: skip
    token = context_api.attach(context)
    try:
        _log.log(level, message, *args, extra=attributes)
    finally:
        context_api.detach(token)


def _attributes(intent: Intent) -> dict[str, str]:
    attributes = {
        telemetry.CLOUD_ACTION.name: intent.action,
        telemetry.CLOUD_RESOURCE_TYPE.name: intent.resource_type,
        telemetry.CLOUD_RPC.name: intent.rpc,
    }
    if intent.resource_id:
        attributes[telemetry.CLOUD_RESOURCE_ID.name] = intent.resource_id
    return attributes


_recorder: Recorder = LogRecorder()


def set_recorder(recorder: Recorder) -> Recorder:
    """Replace the recorder; returns the previous one."""
    global _recorder
    previous, _recorder = _recorder, recorder
    return previous


def recorder() -> Recorder:
    """The recorder in use."""
    return _recorder
