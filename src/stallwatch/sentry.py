"""stallwatch for Sentry users: freezes, wedges, orphaned items, stale async exceptions and leak
candidates as Sentry events, grouped the way Sentry groups (`StallwatchIntegration`; docs/sentry.md).

Enabling: stallwatch adds the integration to the running client within a heartbeat of whichever of
`setup()` and `sentry_sdk.init` comes second (with the watchdog off, at the first incident), unless
sentry-sdk's own switches for auto-enabling integrations keep it off; `integrations=[...]` wins.

Events: one kind per `telemetry.SENTRY_EVENTS` entry. The fingerprint and title name only the kind
and its natural grouping; the other facts, those of the log record stallwatch writes for the same
incident and scrubbed the same way, go to tags and a `stallwatch` context, and the affected request's
OpenTelemetry ids to the `trace` context. Events carry the global scope only.

Freezes are sent by the watchdog, once each and while the host is still frozen, with a client of its
own made from what the host hands over (`handover()`, a 0600 file) (`capture_for_host`). This module
imports sentry_sdk; the rest of stallwatch does only once the host has (`core.faults.to_sentry`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import sentry_sdk
from sentry_sdk.integrations import Integration

from . import telemetry

FLUSH_SECONDS = 2.0  # how long the watchdog waits for a freeze event to leave
TAG_VALUE_CHARS = 200  # Sentry's limit for a tag value
HANDED_OVER = ("dsn", "environment", "release", "server_name")
_EVENTS = {event.kind: event for event in telemetry.SENTRY_EVENTS}
_lock = threading.Lock()
_watchdog_handover: dict[str, Any] | None = None  # the host options the watchdog's client was made from


class StallwatchIntegration(Integration):
    """stallwatch's incidents as Sentry events. Enabled automatically when stallwatch and Sentry
    are both set up; list it in `sentry_sdk.init(integrations=[...])` to choose what is sent, or
    in `disabled_integrations=[...]` to send nothing.

    Each keyword turns one family of events off: `freezes` (sent by the watchdog), `wedges` (dead
    workers, orphaned items, stalled queues, overdue work), `stale_async_exceptions`,
    `leak_candidates`.
    """

    identifier = "stallwatch"

    def __init__(
        self,
        *,
        freezes: bool = True,
        wedges: bool = True,
        stale_async_exceptions: bool = True,
        leak_candidates: bool = True,
    ) -> None:
        self.freezes = freezes
        self.wedges = wedges
        self.stale_async_exceptions = stale_async_exceptions
        self.leak_candidates = leak_candidates

    @staticmethod
    def setup_once() -> None:
        """Nothing to patch: stallwatch's detectors call `capture()`."""

    def sends(self, kind: str) -> bool:
        """Whether events of `kind` (a `telemetry.SENTRY_EVENTS` kind) are on."""
        return bool(getattr(self, _EVENTS[kind].option))


def integration(client: Any = None) -> StallwatchIntegration | None:
    """The integration of `client` (default: the running one), added to it first unless it is turned
    off; None when Sentry is not initialised (no DSN) or the integration is off."""
    client = sentry_sdk.get_client() if client is None else client
    if not client.is_active():
        return None
    found = client.get_integration(StallwatchIntegration)
    if found is None and _auto_enabled(client.options):
        with _lock:
            found = client.get_integration(StallwatchIntegration)
            if found is None:
                found = client.integrations[StallwatchIntegration.identifier] = StallwatchIntegration()
    return found


def _auto_enabled(options: Mapping[str, Any]) -> bool:
    """What sentry-sdk requires of its own auto-enabling integrations."""
    if not (options.get("default_integrations", True) and options.get("auto_enabling_integrations", True)):
        return False
    disabled = options.get("disabled_integrations") or ()
    return all(getattr(each, "identifier", None) != StallwatchIntegration.identifier for each in disabled)


def capture(
    kind: str, tags: Mapping[str, Any], context: Mapping[str, Any], trace_id: str = "", span_id: str = ""
) -> str | None:
    """Send one event of `kind` when the running client's integration has that kind on; its id."""
    found = integration()
    if found is None or not found.sends(kind):
        return None
    return sentry_sdk.get_client().capture_event(
        event(kind, tags, context, trace_id, span_id), scope=sentry_sdk.get_global_scope()
    )


def event(
    kind: str, tags: Mapping[str, Any], context: Mapping[str, Any], trace_id: str = "", span_id: str = ""
) -> dict[str, Any]:
    """The Sentry event of one incident: `tags` by attribute name, `context` by the kind's context keys
    (others are left out), the affected request's OpenTelemetry ids as hex (empty: unknown)."""
    spec = _EVENTS[kind]
    values = {telemetry.INCIDENT_KIND.name: kind}
    for attribute in spec.tags:
        if tags.get(attribute.name) is not None:
            values[attribute.name] = _tag_value(tags[attribute.name])
    grouping = [values.get(attribute.name, "unknown") for attribute in spec.grouping]
    title = spec.title
    for attribute, value in zip(spec.grouping, grouping, strict=True):
        title = title.replace(f"{{{attribute.name}}}", value)
    facts = {key: context[key] for key in spec.context if context.get(key) is not None}
    contexts: dict[str, Any] = {"stallwatch": facts}
    if _valid_id(trace_id, 32) and _valid_id(span_id, 16):
        values[telemetry.OTEL_TRACE_ID.name] = trace_id
        contexts["trace"] = {"trace_id": trace_id, "span_id": span_id}
    return {
        "level": spec.level,
        "logger": "stallwatch",
        "message": title,
        "fingerprint": ["stallwatch", kind, *grouping],
        "tags": values,
        "contexts": contexts,
    }


def _tag_value(value: Any) -> str:
    return " ".join(str(value).split())[:TAG_VALUE_CHARS] or "unknown"


def _valid_id(value: str, digits: int) -> bool:
    return len(value) == digits and value.strip("0") != "" and all(c in "0123456789abcdef" for c in value)


# ---- freezes: the host hands its Sentry options over, the watchdog sends ------------------------


def handover() -> dict[str, Any] | None:
    """In the host: what its watchdog needs to send its freezes (the client's DSN, environment,
    release and server name), or None when freezes are not to be sent."""
    client = sentry_sdk.get_client()
    found = integration(client)
    if found is None or not found.freezes:
        return None
    return {key: client.options.get(key) for key in HANDED_OVER}


def capture_for_host(
    handed: Mapping[str, Any],
    kind: str,
    tags: Mapping[str, Any],
    context: Mapping[str, Any],
    trace_id: str = "",
    span_id: str = "",
) -> str | None:
    """In the watchdog: send one event with a client made from the host's `handover()` (made
    again when the host's options changed), and wait up to `FLUSH_SECONDS` for it to leave."""
    global _watchdog_handover
    if dict(handed) != _watchdog_handover:
        options: dict[str, Any] = {key: handed.get(key) for key in HANDED_OVER}
        sentry_sdk.init(
            **options,
            default_integrations=False,
            integrations=[StallwatchIntegration()],
            auto_session_tracking=False,
        )
        _watchdog_handover = dict(handed)
    event_id = capture(kind, tags, context, trace_id, span_id)
    sentry_sdk.flush(FLUSH_SECONDS)
    return event_id
