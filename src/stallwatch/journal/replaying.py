"""Replay: what the journals of dead processes say was still in flight when they died.

`replay()` runs at start-up, before this process journals anything. For each dead process (its pid
gone, reused or from an earlier boot), its host and watchdog segments are read together, then:

- every operation that started and never ended becomes a span with its original ids, parent, name,
  kind, attributes and start time, ended at the last evidence of life with status ERROR and
  `stallwatch.interrupted.reason` (`telemetry.INTERRUPTED_REASON`), for the tracer provider's span
  processors (if the host's sampler samples it) or a span exporter;
- every create/delete whose intent is durable and whose outcome is in neither file is logged as
  unconfirmed in the intent's span context (and sent to Sentry when the host uses it); each create
  stays a leak candidate (`leaks`) until someone confirms it.

Then the segments move to `archive/` (a journal is never deleted unarchived); a lock file makes
concurrent starts replay each journal once; nothing raises into the caller (`on_error`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import sdk_compat, telemetry
from .._version import __version__
from ..core.faults import to_sentry
from . import frames, leaks, ledger
from .writer import boot_id, start_ticks

INTERRUPTED = telemetry.INTERRUPTED.name
INTERRUPTED_REASON = telemetry.INTERRUPTED_REASON.name
ARCHIVE = "archive"
ARCHIVE_KEEP = 20
_LOCK = "replay.lock"
_log = logging.getLogger("stallwatch.journal")


@dataclass
class InterruptedOperation:
    """An operation a dead process started and never ended."""

    pid: int
    component: str
    name: str
    kind: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    parent_remote: bool
    sampled: bool
    start_ns: int
    end_ns: int
    reason: str
    attributes: dict[str, Any]


@dataclass
class UnconfirmedResource:
    """A create/delete whose intent is on disk and whose outcome never was: a leak candidate."""

    pid: int
    action: str
    resource_type: str
    rpc: str
    trace_id: str
    span_id: str
    resource_id: str | None
    number: int  # `ledger.Intent.number`: the intent's sequence number in its process
    intent_ns: int


@dataclass
class ProcessJournal:
    """Every segment of one process (host and watchdog roles), read and merged."""

    pid: int
    start_ticks: int
    paths: list[Path] = field(default_factory=list)
    host: list[dict[str, Any]] = field(default_factory=list)
    watchdog: list[dict[str, Any]] = field(default_factory=list)
    heartbeat_ns: int = 0
    corruption: list[frames.Corruption] = field(default_factory=list)
    state: str = "dead"  # alive, watchdog_alive, exited, pid_reused, rebooted

    @property
    def dead(self) -> bool:
        return self.state not in ("alive", "watchdog_alive")

    def last_alive_ns(self) -> int:
        """The last evidence of the host's life: a heartbeat or a record of its own."""
        times = [record.get("wall_ns") or record.get("end_ns") or record.get("start_ns") or 0 for record in self.host]
        return max([self.heartbeat_ns, *times])

    def interruption(self) -> tuple[str, int, dict[str, Any]]:
        """Why and when open operations stopped, and freeze attributes to add to them."""
        freeze: dict[str, Any] | None = None
        for record in self.watchdog:
            if record["type"] == "freeze":
                freeze = record
            elif record["type"] == "freeze_end" and freeze is not None:
                if record["outcome"] == "host_killed":
                    return "host_killed", record["wall_ns"], _freeze_attributes(freeze)
                freeze = None
        end = self.last_alive_ns()
        if freeze is not None:
            return "frozen", max(end, freeze["started_ns"]), _freeze_attributes(freeze)
        if any(record["type"] == "close" for record in self.host):
            return "shutdown", end, {}
        return "process_died", end, {}

    def interrupted(self) -> list[InterruptedOperation]:
        reason, end_ns, extra = self.interruption()
        return [
            InterruptedOperation(
                pid=self.pid,
                component=start["component"],
                name=start["name"],
                kind=start["kind"],
                trace_id=start["trace_id"],
                span_id=span_id,
                parent_span_id=start["parent_span_id"],
                parent_remote=start["parent_remote"],
                sampled=start["sampled"],
                start_ns=start["start_ns"],
                end_ns=max(end_ns, start["start_ns"]),
                reason=reason,
                attributes={**start["attributes"], **extra},
            )
            for span_id, start in _unclosed(self.host, "start", "end", "span_id").items()
        ]

    def unconfirmed(self) -> list[UnconfirmedResource]:
        return [
            UnconfirmedResource(
                pid=self.pid,
                action=intent["action"],
                resource_type=intent["resource_type"],
                rpc=intent["rpc"],
                trace_id=intent["trace_id"],
                span_id=intent["span_id"],
                resource_id=intent["resource_id"],
                number=intent["number"],
                intent_ns=intent["wall_ns"],
            )
            for intent in _unclosed(self.host + self.watchdog, "intent", "outcome", "key").values()
        ]

    def completed(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(intent, outcome) pairs: the creates and deletes the cloud answered."""
        outcomes = {r["key"]: r for r in self.host + self.watchdog if r["type"] == "outcome"}
        intents = {r["key"]: r for r in self.host + self.watchdog if r["type"] == "intent"}
        return [(intent, outcomes[key]) for key, intent in intents.items() if key in outcomes]


def _unclosed(records: list[dict[str, Any]], opened: str, closed: str, key: str) -> dict[str, dict[str, Any]]:
    """By their `key` value, the first record of type `opened` of each value that no record of type
    `closed` carries, wherever it stands."""
    first: dict[str, dict[str, Any]] = {}
    closed_keys: set[str] = set()
    for record in records:
        if record["type"] == opened:
            first.setdefault(record[key], record)
        elif record["type"] == closed:
            closed_keys.add(record[key])
    return {value: record for value, record in first.items() if value not in closed_keys}


@dataclass
class ReplayResult:
    """What one `replay()` found and did."""

    replayed: list[ProcessJournal] = field(default_factory=list)
    skipped: list[ProcessJournal] = field(default_factory=list)
    interrupted: list[InterruptedOperation] = field(default_factory=list)
    unconfirmed: list[UnconfirmedResource] = field(default_factory=list)
    spans_exported: int = 0
    busy: bool = False  # another process was replaying this directory

    @property
    def corruption(self) -> list[frames.Corruption]:
        return [c for journal in self.replayed + self.skipped for c in journal.corruption]

    def unconfirmed_creates(self) -> dict[str, int]:
        """Unconfirmed creates found by this replay, per resource type."""
        return dict(Counter(r.resource_type for r in self.unconfirmed if r.action == "create"))


def _freeze_attributes(freeze: dict[str, Any]) -> dict[str, Any]:
    return {"stallwatch.freeze.kind": freeze["kind"], "stallwatch.freeze.cause": freeze["cause"]}


def scan(journal_dir: str | os.PathLike[str]) -> list[ProcessJournal]:
    """Read every process's journal in `journal_dir` and say whether that process is alive."""
    directory = Path(journal_dir)
    journals: dict[tuple[int, int], ProcessJournal] = {}
    for name, path in frames.list_segments(directory):
        journal = journals.setdefault((name.pid, name.start_ticks), ProcessJournal(name.pid, name.start_ticks))
        segment = frames.read_segment(path)
        journal.paths.append(path)
        journal.corruption += segment.corruption
        journal.heartbeat_ns = max(journal.heartbeat_ns, segment.heartbeat_wall_ns or 0)
        records = [record for record in segment.records if isinstance(record.get("type"), str)]
        (journal.host if name.role == "host" else journal.watchdog).extend(records)
    this_boot = boot_id()
    for journal in journals.values():
        journal.state = _state(journal, this_boot)
    return list(journals.values())


def _state(journal: ProcessJournal, this_boot: str) -> str:
    identities = [r for r in journal.host + journal.watchdog if r["type"] == "open"]
    if any(r.get("boot_id") and r["boot_id"] != this_boot for r in identities):
        return "rebooted"
    running = start_ticks(journal.pid)
    if running == journal.start_ticks:
        return "alive"
    watchdog_closed = any(r["type"] == "close" for r in journal.watchdog)
    for identity in identities:  # the watchdog may still be writing its last records
        if (
            identity["role"] == "watchdog"
            and not watchdog_closed
            and start_ticks(identity["pid"]) == identity["start_ticks"]
        ):
            return "watchdog_alive"
    return "exited" if running is None else "pid_reused"


def replay(
    journal_dir: str | os.PathLike[str],
    *,
    tracer_provider: Any = None,
    span_exporter: Any = None,
    archive_keep: int = ARCHIVE_KEEP,
    on_error: Callable[[], None] | None = None,
) -> ReplayResult:
    """Replay the journals of dead processes in `journal_dir` (see the module docstring)."""
    result = ReplayResult()
    directory = Path(journal_dir)
    if not directory.is_dir():
        return result
    try:
        lock = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        _report(on_error)
        return result
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock)
        result.busy = True
        return result
    try:
        _replay_all(directory, result, tracer_provider, span_exporter, archive_keep, on_error)
    except Exception:  # e.g. a record of an unknown shape: the host starts anyway
        _report(on_error)
    finally:
        os.close(lock)
    return result


def _replay_all(
    directory: Path,
    result: ReplayResult,
    tracer_provider: Any,
    span_exporter: Any,
    archive_keep: int,
    on_error: Callable[[], None] | None,
) -> None:
    for journal in scan(directory):
        if not journal.dead:
            result.skipped.append(journal)
            continue
        try:
            _replay_one(directory, journal, result, tracer_provider, span_exporter)
        except Exception:  # its spans or warnings are lost; archiving it anyway keeps it from coming back
            _report(on_error)
        try:
            _archive(directory, journal.paths)
        except OSError:
            _report(on_error)
        result.replayed.append(journal)
    try:
        _prune(directory / ARCHIVE, archive_keep)
    except OSError:
        _report(on_error)


def _replay_one(
    directory: Path, journal: ProcessJournal, result: ReplayResult, tracer_provider: Any, span_exporter: Any
) -> None:
    interrupted = journal.interrupted()
    unconfirmed = journal.unconfirmed()
    result.interrupted += interrupted
    result.unconfirmed += unconfirmed
    leaks.record(directory, journal.start_ticks, unconfirmed)  # before the journal leaves for the archive
    spans = [to_span(op, _resource(tracer_provider, journal.pid)) for op in interrupted if op.sampled]
    if spans and tracer_provider is not None:
        processor = sdk_compat.active_span_processor(tracer_provider)
        for span in spans:
            processor.on_end(span)
    if spans and span_exporter is not None:
        span_exporter.export(spans)
    if tracer_provider is not None or span_exporter is not None:
        result.spans_exported += len(spans)
    for resource in unconfirmed:
        _warn_unconfirmed(resource)


def _resource(tracer_provider: Any, pid: int) -> Any:
    from opentelemetry.sdk.resources import Resource

    base = getattr(tracer_provider, "resource", None) or Resource.get_empty()
    return base.merge(Resource({"process.pid": pid}))


def to_span(op: InterruptedOperation, resource: Any) -> Any:
    """An SDK `ReadableSpan` for `op`, with its original ids, ready for `SpanProcessor.on_end`."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope
    from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

    flags = TraceFlags(TraceFlags.SAMPLED)
    trace_id = int(op.trace_id, 16)
    parent = (
        SpanContext(trace_id, int(op.parent_span_id, 16), is_remote=op.parent_remote, trace_flags=flags)
        if op.parent_span_id
        else None
    )
    return ReadableSpan(
        name=op.name,
        context=SpanContext(trace_id, int(op.span_id, 16), is_remote=False, trace_flags=flags),
        parent=parent,
        resource=resource,
        attributes={**op.attributes, INTERRUPTED: True, INTERRUPTED_REASON: op.reason},
        kind=SpanKind[op.kind],
        status=Status(StatusCode.ERROR, f"interrupted: {op.reason}"),
        start_time=op.start_ns,
        end_time=op.end_ns,
        instrumentation_scope=InstrumentationScope(telemetry.INSTRUMENTATION_SCOPE, __version__),
    )


def _warn_unconfirmed(resource: UnconfirmedResource) -> None:
    from opentelemetry import context, trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    attributes = {
        telemetry.CLOUD_ACTION.name: resource.action,
        telemetry.CLOUD_RESOURCE_TYPE.name: resource.resource_type,
        telemetry.CLOUD_RPC.name: resource.rpc,
        "process.pid": resource.pid,
    }
    if resource.resource_id:
        attributes[telemetry.CLOUD_RESOURCE_ID.name] = resource.resource_id
    span_context = SpanContext(int(resource.trace_id, 16), int(resource.span_id, 16), is_remote=True,
                               trace_flags=TraceFlags(TraceFlags.SAMPLED))  # fmt: skip
    token = context.attach(trace.set_span_in_context(NonRecordingSpan(span_context)))
    try:
        logging.getLogger(ledger.LOGGER_NAME).warning(f"cloud resource {resource.action} unconfirmed", extra=attributes)
    finally:
        context.detach(token)
    _leak_to_sentry(resource, attributes)


def _leak_to_sentry(resource: UnconfirmedResource, attributes: dict[str, Any]) -> None:
    described = f" {resource.resource_id}" if resource.resource_id else ""
    to_sentry(
        "leak_candidate",
        attributes,
        {
            "description": f"cloud resource {resource.action} unconfirmed: {resource.resource_type}{described} "
            f"({resource.rpc}) asked for by process {resource.pid}, which died before the outcome was recorded.",
            "dead_process_pid": resource.pid,
            "intent_time": datetime.fromtimestamp(resource.intent_ns / 1e9, timezone.utc).isoformat(),
        },
        resource.trace_id,
        resource.span_id,
    )


def _archive(directory: Path, paths: list[Path]) -> None:
    archive = directory / ARCHIVE
    archive.mkdir(mode=0o700, exist_ok=True)
    for path in paths:
        os.replace(path, archive / path.name)


def _prune(archive: Path, keep: int) -> None:
    """Keep the segments of the newest `keep` processes in the archive."""
    newest: dict[tuple[int, int], float] = {}
    segments = frames.list_segments(archive)
    for name, path in segments:
        key = (name.pid, name.start_ticks)
        newest[key] = max(newest.get(key, 0.0), path.stat().st_mtime)
    expired = set(sorted(newest, key=newest.__getitem__, reverse=True)[keep:])
    for name, path in segments:
        if (name.pid, name.start_ticks) in expired:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def _report(on_error: Callable[[], None] | None) -> None:
    """Call inside an `except` block."""
    if on_error is not None:
        with contextlib.suppress(Exception):
            on_error()
    else:
        _log.warning("stallwatch: journal replay failed; the host goes on.", exc_info=True)
