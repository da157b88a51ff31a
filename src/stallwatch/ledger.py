"""The cloud resource ledger: every create/delete call announces its intent before it is sent, and
its outcome once known.

A host killed during a freeze exports nothing it held in memory. Incident 000 left 5 instances
running for days because nothing recorded that they had been asked for. Instrumentations (Nebius
today) call `intent()` before the request leaves and `outcome()` when the answer (or the failure)
is known. The recorder behind this interface is replaceable with `set_recorder()`, so a durable
one (the journal) can plug in. The default recorder writes one log record per event to the
`stallwatch.cloud` logger at INFO:
`cloud resource create requested`, `cloud resource created`, `cloud resource create failed` (WARNING),
and the same for `delete`.
Each record carries every id known in its attributes (`stallwatch.cloud.*`) and is emitted inside
the call's span, so it carries that span's trace and span ids.
The OpenTelemetry log handler that `setup()` installs exports these records whatever
`STALLWATCH_LOG_LEVEL` says.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Protocol

from . import telemetry

LOGGER_NAME = "stallwatch.cloud"
_log = logging.getLogger(LOGGER_NAME)
_log.setLevel(logging.INFO)
_ids = itertools.count(1)


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


@dataclass(frozen=True)
class Outcome:
    """What the cloud answered: the operation and resource ids, or the failure."""

    ok: bool
    status: str  # gRPC status name, or `timeout` / `cancelled` / an exception class
    operation_id: str | None = None
    resource_id: str | None = None
    request_id: str | None = None


class Recorder(Protocol):
    """Where intents and outcomes go (the default logs them; the journal will persist them)."""

    def intent(self, intent: Intent) -> None: ...

    def outcome(self, intent: Intent, outcome: Outcome) -> None: ...


_PAST = {"create": "created", "delete": "deleted"}


class LogRecorder:
    """Writes each intent and outcome as an INFO record of the `stallwatch.cloud` logger."""

    def intent(self, intent: Intent) -> None:
        _log.info("cloud resource %s requested", intent.action, extra=_attributes(intent))

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
        level = logging.INFO if outcome.ok else logging.WARNING
        _log.log(level, message, extra=attributes)


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
