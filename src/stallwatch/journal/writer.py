"""The journal writer: one process's append-only record of the operations it has in flight.

One `Journal` per role and process, each in its own file (`<pid>-<start>.host.<n>.journal`, the
watchdog's `<host pid>-<host start>.watchdog.<n>.journal`); `<start>`, the process start time in
clock ticks, tells a dead process from a new one with its pid. A fork child that records anything
gets its own file and flusher on first use, never in a fork handler. Nothing here raises: an
`OSError` goes to `on_error` and loses that record. Three kinds of record:

- **durable** (cloud intent, tunnel open, freeze, host killed): written in the caller's thread after
  everything buffered before it, then `fdatasync`; the call returns once the record is on disk.
- **written** (cloud outcome): the same without the `fdatasync`: it survives the process (page
  cache) and reaches the disk with the next durable record or the flusher's next pass.
- **buffered** (operation start/end): a dict appended to a bounded deque (overflow dropped and
  counted), written by a daemon flusher every `flush_seconds`, which also stamps the header's
  heartbeat slot. A start not yet written when its end comes is elided with it (one `dict.pop` decides).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan

from .._private import make_directories
from ..core.light_span import LightSpan
from ..core.scrub import scrub_attributes, scrub_value
from . import frames, ledger

_RECORDING = (ReadableSpan, LightSpan)
# Fields that hold ids (what replay and the postmortem join on): random-looking, never secret, never scrubbed.
_ID_FIELDS = frozenset({"trace_id", "span_id", "parent_span_id", "key", "resource_id", "operation_id", "request_id",
                        "boot_id"})  # fmt: skip  # the spans that record (SDK spans are ReadableSpans)

_log = logging.getLogger("stallwatch.journal")

SEGMENT_BYTES = 16 << 20
KEEP_SEGMENTS = 2
BUFFER_RECORDS = 10_000
FLUSH_SECONDS = 0.1
# Segments grow by zero-filled chunks: a durable record is a `pwrite` into allocated blocks plus `fdatasync`
# (no size change to commit), and a full disk shows when a chunk is reserved, not in the middle of a record.
PREALLOCATE_BYTES = 1 << 20
ROLES = ("host", "watchdog")


def boot_id() -> str:
    """This boot's id: pids and start times only mean something within one boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (`/proc/<pid>/stat` field 22); None if gone.

    A zombie counts as gone: it has exited, only its parent (or an init that is slow to reap) has
    not collected it yet.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    fields = stat.rsplit(b")", 1)[1].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass
class _State:
    """Everything that belongs to one writing process (a fork child gets a fresh one)."""

    pid: int
    lock: threading.Lock = field(default_factory=threading.Lock)  # the file, its offset, rotation
    start_lock: threading.Lock = field(default_factory=threading.Lock)  # starting the flusher only
    buffer: deque[dict[str, Any]] = field(default_factory=deque)
    fd: int = -1
    number: int = 0
    offset: int = 0
    allocated: int = 0
    open_spans: dict[str, bytes] = field(default_factory=dict)
    open_intents: dict[str, bytes] = field(default_factory=dict)
    dropped: int = 0
    dropped_journaled: int = 0
    unsynced: bool = False  # a written record is not on disk yet: the flusher's next pass syncs it
    flusher: threading.Thread | None = None
    stopping: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)  # flush before the period is up
    closed: bool = False


class Journal:
    """A crash-safe record of one process's operations in flight (see the module docstring).

    Args:
        directory: where the segment files go (created 0700 if missing).
        role: `host` (the process itself) or `watchdog` (writes for `host_pid`).
        host_pid: the watched host, for the `watchdog` role.
        on_error: called inside the `except` block of every failed write; the default logs the
            first failure at WARNING.
        segment_bytes: past this size the next record starts a new segment, which opens with a copy
            of every operation and intent still open, so dropping the oldest of `keep_segments`
            loses nothing in flight.
        buffer_records: buffered records beyond this are dropped and counted (the count is journaled).
        flush_seconds: the flusher's period: what a kill can lose of the buffered records, and when a
            written record reaches the disk at the latest.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        role: str = "host",
        host_pid: int | None = None,
        on_error: Callable[[], None] | None = None,
        segment_bytes: int = SEGMENT_BYTES,
        keep_segments: int = KEEP_SEGMENTS,
        buffer_records: int = BUFFER_RECORDS,
        flush_seconds: float = FLUSH_SECONDS,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {role!r}")
        if (role == "watchdog") != (host_pid is not None):
            raise ValueError("host_pid is required for the watchdog role, and only for it")
        self.directory = Path(directory)
        self.role = role
        self._host_pid = host_pid
        self._host_start = start_ticks(host_pid) if host_pid is not None else None
        self._on_error = on_error
        self._segment_bytes = max(segment_bytes, 4096)
        self._keep_segments = max(keep_segments, 1)
        self._buffer_records = buffer_records
        self._flush_seconds = flush_seconds
        self._boot_id = boot_id()
        self._state: _State | None = None
        self._states: dict[int, _State] = {}
        self.errors = 0

    # ---- what instrumentations call -----------------------------------------------------------

    def span_started(self, span: Any, component: str, *, durable: bool = False) -> dict[str, Any] | None:
        """Record a span that just started: the SDK's or a `LightSpan` (no-op for one that does not record).

        The hot path keeps the span and the time; whoever writes the record (the flusher, or
        this call for a durable one) reads the span's name, kind, ids, parent, start and
        attributes then and turns them into JSON, so a record that is never written (see
        `span_ended`) costs no more than that. Returns the start's token for
        `span_ended(started=...)` (None when nothing was recorded)."""
        if not isinstance(span, _RECORDING):
            return None
        record = {
            "type": "start",
            "pending": True,  # taken by the flusher (written) or by `span_ended` (elided)
            "component": component,
            "span": span,
            "mono_ns": time.monotonic_ns(),
        }
        self._record(record, durable)
        return record

    def span_ended(self, span: Any, *, durable: bool = False, started: dict[str, Any] | None = None) -> None:
        """Record that a span ended, with its status and every attribute it learned. With `started` (what
        `span_started` returned), an operation whose start was not written yet is not written at all."""
        if started is not None and started.pop("pending", None) is not None:
            return
        if not isinstance(span, _RECORDING):
            return
        try:
            record = {
                "type": "end",
                "context": span.get_span_context(),
                "status": span.status,
                "end_ns": span.end_time or time.time_ns(),
                "mono_ns": time.monotonic_ns(),
                "attributes": span.attributes.copy(),  # type: ignore[union-attr]  # an SDK span's: a mappingproxy
            }
        except Exception:
            self._failed()
            return
        self._record(record, durable)

    def cloud_intent(self, intent: ledger.Intent) -> None:
        """A create/delete is about to be sent: durable before this returns."""
        self._record({**_intent_fields(intent), "type": "intent", **_now()}, durable=True)

    def cloud_outcome(self, intent: ledger.Intent, outcome: ledger.Outcome) -> None:
        """What the cloud answered for `intent`: written before this returns, on disk within `flush_seconds`."""
        record = {
            "type": "outcome",
            "key": _intent_key(intent),
            "ok": outcome.ok,
            "status": outcome.status,
            "operation_id": outcome.operation_id,
            "resource_id": outcome.resource_id or intent.resource_id,
            "request_id": outcome.request_id,
            **_now(),
        }
        self._record(record, durable=True, sync=False)

    # ---- what the watchdog calls --------------------------------------------------------------

    def freeze_started(self, kind: str, cause: str, started_wall_ns: int, attributes: Mapping[str, Any]) -> None:
        """The host froze (last heartbeat at `started_wall_ns`): durable before this returns."""
        record = {"type": "freeze", "kind": kind, "cause": cause, "started_ns": started_wall_ns,
                  "attributes": dict(attributes), **_now()}  # fmt: skip
        self._record(record, durable=True)

    def freeze_ended(self, outcome: str) -> None:
        """The freeze is over: `thawed`, or `host_killed` when the host died frozen."""
        self._record({"type": "freeze_end", "outcome": outcome, **_now()}, durable=True)

    def heartbeat(self, wall_ns: int | None = None) -> None:
        """Stamp the last evidence of the host's life (`wall_ns`, default now) into the header.

        The host's flusher does this itself; the watchdog calls it with the host heartbeat it saw.
        """
        state = self._current()
        with state.lock:
            if state.closed:
                return
            try:
                self._ensure_open(state)
                os.pwrite(state.fd, frames.heartbeat(wall_ns or time.time_ns(), time.monotonic_ns()),
                          frames.HEARTBEAT_OFFSET)  # fmt: skip
            except Exception:
                self._failed()

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def dropped(self) -> int:
        """Buffered records this process dropped because the buffer was full."""
        return self._current().dropped

    def flush(self) -> None:
        """Write everything buffered now (without fdatasync)."""
        self._flush(self._current())

    def close(self, timeout: float = 1.0) -> None:
        """Stop the flusher, write what is buffered and a `close` record, fdatasync, close the file."""
        state = self._current()
        state.stopping.set()
        state.wake.set()
        flusher = state.flusher
        if flusher is not None and flusher is not threading.current_thread():
            flusher.join(timeout)
        with state.lock:
            if state.closed:
                return
            records = self._drain(state)
            if records or state.fd >= 0:
                self._write(state, [*records, {"type": "close", **_now()}], sync=True)
            state.closed = True
            if state.fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(state.fd)
                state.fd = -1

    # ---- internals ----------------------------------------------------------------------------

    def _current(self) -> _State:
        pid = os.getpid()
        state = self._state
        if state is not None and state.pid == pid:
            return state
        state = self._states.setdefault(pid, _State(pid))  # atomic: racing threads agree
        for other in list(self._states.values()):
            if other.pid != pid and other.fd >= 0:  # the parent's file, inherited by a fork child
                with contextlib.suppress(OSError):
                    os.close(other.fd)
                other.fd = -1
        self._state = state
        return state

    def _record(self, record: dict[str, Any], durable: bool, sync: bool = True) -> None:
        """Buffer `record`, or write it now (`durable`), then `fdatasync` (`sync`) or leave that to the flusher."""
        state = self._current()
        if state.closed:
            return
        if durable:
            with state.lock:
                self._write(state, [*self._drain(state), record], sync=sync)
                state.unsynced = state.unsynced or not sync
            if not sync and state.flusher is None:
                self._start_flusher(state)
            return
        queued = len(state.buffer)
        if queued >= self._buffer_records:
            state.dropped += 1
            return
        state.buffer.append(record)
        if state.flusher is None:
            self._start_flusher(state)
        elif queued == self._buffer_records // 2:  # a burst: flush now rather than drop later
            state.wake.set()

    def _start_flusher(self, state: _State) -> None:
        with state.start_lock:
            if state.flusher is not None:
                return
            state.flusher = threading.Thread(
                target=self._flush_loop, args=(state,), name="stallwatch-journal", daemon=True
            )
            try:
                state.flusher.start()
            except RuntimeError:  # interpreter shutting down: records wait for close(), or are dropped
                self._failed()

    def _flush_loop(self, state: _State) -> None:
        while True:
            state.wake.wait(self._flush_seconds)
            state.wake.clear()
            if state.stopping.is_set():
                return
            self._flush(state)

    def _flush(self, state: _State) -> None:
        with state.lock:
            if state.closed:
                return
            records = self._drain(state)
            if records or state.dropped != state.dropped_journaled:
                self._write(state, records, sync=False)
            if state.unsynced and state.fd >= 0:
                try:
                    os.fdatasync(state.fd)
                    state.unsynced = False
                except OSError:
                    self._failed()
            if self.role == "host" and state.fd >= 0:
                try:
                    os.pwrite(state.fd, frames.heartbeat(time.time_ns(), time.monotonic_ns()), frames.HEARTBEAT_OFFSET)
                except OSError:
                    self._failed()

    @staticmethod
    def _drain(state: _State) -> list[dict[str, Any]]:
        buffer = state.buffer
        return [buffer.popleft() for _ in range(len(buffer))]

    def _write(self, state: _State, records: list[dict[str, Any]], sync: bool) -> None:
        """Append `records` (lock held); on an OSError they are lost and `on_error` is told."""
        if state.dropped != state.dropped_journaled:
            records.append({"type": "dropped", "count": state.dropped, **_now()})
            state.dropped_journaled = state.dropped
        try:
            self._ensure_open(state)  # first: a new segment's checkpoint must not repeat `records`
            chunk = b"".join(self._encode_each(state, records))
            if state.offset + len(chunk) > self._segment_bytes:
                self._rotate(state)
            self._reserve(state, len(chunk))
            self._pwrite_all(state.fd, chunk, state.offset)
            state.offset += len(chunk)
            if sync:
                os.fdatasync(state.fd)
                state.unsynced = False
        except Exception:  # OSError above all (full disk, size limit, directory gone); never the host's problem
            self._failed()

    def _encode_each(self, state: _State, records: list[dict[str, Any]]) -> list[bytes]:
        """The frames of `records`, but for starts already ended (see `span_ended`); one that cannot be
        encoded (a value whose `str()` raises, a record over `frames.MAX_RECORD_BYTES`) is lost alone and
        reported, never the records written with it."""
        encoded = []
        for record in records:
            if record["type"] == "start" and record.pop("pending", None) is None:
                continue
            try:
                encoded.append(self._encode(state, record))
            except Exception:
                self._failed()
        return encoded

    @staticmethod
    def _encode(state: _State, record: dict[str, Any]) -> bytes:
        kind = record["type"]
        if kind in ("start", "end"):
            record = _span_fields(record)
        frame = frames.encode(_scrubbed(record))
        if kind == "start":
            state.open_spans[record["span_id"]] = frame
        elif kind == "end":
            state.open_spans.pop(record["span_id"], None)
        elif kind == "intent":
            state.open_intents[record["key"]] = frame
        elif kind == "outcome":
            state.open_intents.pop(record["key"], None)
        return frame

    def _segment_name(self, number: int) -> str:
        pid = self._host_pid if self._host_pid is not None else os.getpid()
        ticks = self._host_start if self._host_pid is not None else start_ticks(os.getpid())
        return frames.segment_name(pid, ticks or 0, self.role, number)

    def _ensure_open(self, state: _State) -> None:
        if state.fd >= 0:
            return
        self._open_segment(state, state.number + 1)

    def _open_segment(self, state: _State, number: int) -> None:
        """Create segment `number` with its header, identity and the operations still open, and
        make it the current one (lock held). On an OSError the current segment stays as it was."""
        if not self.directory.is_dir():
            make_directories(self.directory)
        path = self.directory / self._segment_name(number)
        identity = {
            "type": "open",
            "role": self.role,
            "pid": state.pid,
            "start_ticks": start_ticks(state.pid),
            "host_pid": self._host_pid if self._host_pid is not None else state.pid,
            "boot_id": self._boot_id,
            "segment": number,
            **_now(),
        }
        checkpoint = b"".join([*state.open_spans.values(), *state.open_intents.values()])
        initial = frames.header() + frames.encode(identity) + checkpoint
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchmod(fd, 0o600)
            allocated = max(PREALLOCATE_BYTES, len(initial))
            try:
                self._pwrite_all(fd, initial + bytes(allocated - len(initial)), 0)
            except OSError:  # no room to preallocate: the header and identity may still fit
                allocated = len(initial)
                self._pwrite_all(fd, initial, 0)
            os.fdatasync(fd)
            directory_fd = os.open(self.directory, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(directory_fd)  # the new name itself survives a crash
            finally:
                os.close(directory_fd)
        except OSError:
            os.close(fd)
            raise
        old_fd = state.fd
        state.fd, state.number, state.offset, state.allocated = fd, number, len(initial), allocated
        if old_fd >= 0:
            if state.unsynced:  # a written record in the segment being left reaches the disk first
                try:
                    os.fdatasync(old_fd)
                except OSError:
                    self._failed()
                state.unsynced = False
            os.close(old_fd)

    def _rotate(self, state: _State) -> None:
        self._open_segment(state, state.number + 1)
        expired = state.number - self._keep_segments
        if expired >= 1:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.directory / self._segment_name(expired))

    @staticmethod
    def _reserve(state: _State, size: int) -> None:
        """Zero-fill ahead of `offset` so records land in allocated blocks (best effort)."""
        if state.offset + size <= state.allocated:
            return
        start = max(state.allocated, state.offset)  # never zero what is written
        grow = max(PREALLOCATE_BYTES, size)
        try:
            Journal._pwrite_all(state.fd, bytes(grow), start)
            state.allocated = start + grow
        except OSError:
            state.allocated = state.offset  # the record itself may still fit: let its own write say

    @staticmethod
    def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
        view = memoryview(data)
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written

    def _failed(self) -> None:
        """Call inside an `except` block: count the failure, tell `on_error` (or log the first)."""
        self.errors += 1
        if self._on_error is not None:
            try:
                self._on_error()
            except Exception:
                _log.debug("stallwatch: the journal's error callback failed", exc_info=True)
        elif self.errors == 1:
            _log.warning("stallwatch: cannot write the journal in %s; the host goes on without it "
                         "(set STALLWATCH_JOURNAL_DIR to a writable directory).", self.directory,
                         exc_info=True)  # fmt: skip


def _span_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A start/end record as the hot path kept it (span objects) -> JSON-ready fields, in place
    (the record belongs to the journal once buffered). A start record's fields are read from its
    span now: what it knows when the record is written (its attributes may have grown since it
    started)."""
    if record["type"] == "start":
        span = record.pop("span")
        context, parent = span.get_span_context(), span.parent
        record["name"] = span.name
        record["kind"] = span.kind.name
        record["start_ns"] = span.start_time
        record["attributes"] = span.attributes.copy()  # one C call: safe while the span's thread sets more
        record["sampled"] = context.trace_flags.sampled
        record["parent_span_id"] = f"{parent.span_id:016x}" if parent is not None else None
        record["parent_remote"] = parent.is_remote if parent is not None else False
    else:
        context = record.pop("context")
        record["status"] = record["status"].status_code.name
        record["error_type"] = record["attributes"].get("error.type")
    record["trace_id"] = f"{context.trace_id:032x}"
    record["span_id"] = f"{context.span_id:016x}"
    return record


def _scrubbed(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every string stallwatch recorded from the host (span names, attribute values, causes)
    checked for secrets once more, in place; ids stay as they are."""
    for name, value in record.items():
        if name in _ID_FIELDS:
            continue
        if type(value) is str:
            record[name] = scrub_value(value)
        elif name == "attributes" and isinstance(value, Mapping):
            record[name] = scrub_attributes(value)
    return record


def _now() -> dict[str, int]:
    return {"wall_ns": time.time_ns(), "mono_ns": time.monotonic_ns()}


def _intent_key(intent: ledger.Intent) -> str:
    return f"{intent.span_id}/{intent.number}"


def _intent_fields(intent: ledger.Intent) -> dict[str, Any]:
    return {
        "key": _intent_key(intent),
        "action": intent.action,
        "resource_type": intent.resource_type,
        "rpc": intent.rpc,
        "trace_id": intent.trace_id,
        "span_id": intent.span_id,
        "resource_id": intent.resource_id,
        "number": intent.number,
    }


class JournalRecorder:
    """A ledger `Recorder` that makes each intent durable and writes each outcome, then passes it on.

    `chain` (normally the recorder in place before, which logs) still sees every call, so the
    `stallwatch.cloud` log records continue; a journal failure never stops them.
    """

    def __init__(self, journal: Journal, chain: ledger.Recorder | None = None) -> None:
        self.journal = journal
        self.chain = chain

    def intent(self, intent: ledger.Intent) -> None:
        self.journal.cloud_intent(intent)
        if self.chain is not None:
            self.chain.intent(intent)

    def outcome(self, intent: ledger.Intent, outcome: ledger.Outcome) -> None:
        self.journal.cloud_outcome(intent, outcome)
        if self.chain is not None:
            self.chain.outcome(intent, outcome)


def install_recorder(journal: Journal) -> JournalRecorder:
    """Make `journal` the ledger's recorder, chained to the one in place; returns it."""
    recorder = JournalRecorder(journal, ledger.recorder())
    ledger.set_recorder(recorder)
    return recorder
