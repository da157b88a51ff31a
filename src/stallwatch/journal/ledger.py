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
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import context as context_api

from .. import telemetry
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


@dataclass(frozen=True)
class Intent:
    """A create/delete about to be sent: what, where, and the span that carries it."""

    action: str  # "create" or "delete"
    resource_type: str  # e.g. "compute.instance"
    rpc: str  # e.g. "nebius.compute.v1.InstanceService/Create"
    trace_id: str
    span_id: str
    resource_id: str | None = None  # known before the call for a delete
    number: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self) -> None:
        _normalise(self, ("action", "resource_type", "rpc", "trace_id", "span_id"), ("resource_id",))


@dataclass(frozen=True)
class Outcome:
    """What the cloud answered: the operation and resource ids, or the failure."""

    ok: bool
    status: str  # gRPC status name, or `timeout` / `cancelled` / an exception class
    operation_id: str | None = None
    resource_id: str | None = None
    request_id: str | None = None

    def __post_init__(self) -> None:
        _normalise(self, ("status",), ("operation_id", "resource_id", "request_id"))


def _normalise(record: object, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    """Make every text field of a frozen `record` fit for a log record, a journal frame and an attribute:
    valid UTF-8 of at most `MAX_FIELD_CHARS` characters. A value that is no string (a buggy caller, a server
    answering odd metadata) becomes "?" for a required field and None for an optional one: the record is
    still written, since losing a create's intent is worse than losing one of its fields."""
    for name in required:
        object.__setattr__(record, name, clip_text(getattr(record, name), MAX_FIELD_CHARS) or "?")
    for name in optional:
        object.__setattr__(record, name, clip_text(getattr(record, name), MAX_FIELD_CHARS))


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
