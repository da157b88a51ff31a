"""What the freeze watchdog (`detect.watchdog`) loads when it has something to report: the `/proc`
diagnosis of a frozen host, the freeze's telemetry (WARNING log record, `stallwatch.freeze.active`,
Sentry event, journal records, and at the thaw a `stallwatch.freeze` span; a host that dies frozen
leaves its last word, `stallwatch.freeze.host_killed`, docs/watchdog-last-word.md), its telemetry
pipeline, and the naming of the lines it writes to the host's stderr.

The watchdog imports this module at the first late heartbeat (`Watchdog`), with a Prometheus
exporter at its start, or when it has a line to write: never while the host beats on time.

`Reporting.set_up` builds the pipeline, the watchdog's side of the journal and the freeze metrics and span
(when, and that once only, is `watchdog._Reporter`'s to say): a part that fails is said on one line of
the watchdog's stderr (why, and `STALLWATCH_WATCHDOG`), counted where a meter provider was installed
before it failed, and the freezes are reported by the parts that work (docs/freezes.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from .._private import never_execed
from . import heartbeat

STACKS_GRACE = 1.0  # the longest a freeze report waits for the stacks faulthandler writes at the same moment
# The calls a frozen main thread is usually found in, by number (`/proc/PID/syscall`), per architecture
# (asm/unistd_64.h, asm-generic/unistd.h); another architecture's numbers are reported as numbers.
_SYSCALL_NUMBERS = {
    "x86_64": {0: "read", 1: "write", 7: "poll", 23: "select", 35: "nanosleep", 42: "connect", 43: "accept",
               44: "sendto", 45: "recvfrom", 56: "clone", 58: "vfork", 61: "wait4", 73: "flock", 74: "fsync",
               202: "futex", 230: "clock_nanosleep", 232: "epoll_wait", 247: "waitid", 270: "pselect6",
               271: "ppoll", 281: "epoll_pwait", 288: "accept4", 435: "clone3", 441: "epoll_pwait2"},
    "aarch64": {22: "epoll_pwait", 32: "flock", 63: "read", 64: "write", 72: "pselect6", 73: "ppoll", 82: "fsync",
                95: "waitid", 98: "futex", 101: "nanosleep", 115: "clock_nanosleep", 202: "accept", 203: "connect",
                206: "sendto", 207: "recvfrom", 220: "clone", 242: "accept4", 260: "wait4", 435: "clone3",
                441: "epoll_pwait2"},
}  # fmt: skip
SYSCALLS = _SYSCALL_NUMBERS.get(os.uname().machine, {})
log = logging.getLogger("stallwatch.watchdog")


class Arguments(Protocol):
    """The watchdog's command line (`watchdog.Arguments`)."""

    pid: int
    heartbeat: str
    threshold: float
    journal_dir: str | None


# ---- /proc diagnosis ------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as handle:
            return handle.read()
    except OSError:
        return None


def _link(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:
        return None


def _status_field(pid: int, name: str) -> str | None:
    for line in (_read(f"/proc/{pid}/status") or "").splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return None


def _listdir(path: str) -> list[str]:
    """The entries of a `/proc` directory, none once its process is gone or where `/proc` refuses: a
    child listed a moment ago may have been reaped since (the host runs between two reads), which a
    check before the read cannot rule out."""
    try:
        return os.listdir(path)
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for tid in _listdir(f"/proc/{pid}/task"):
        kids += [int(c) for c in (_read(f"/proc/{pid}/task/{tid}/children") or "").split()]
    return kids


def _thread_names(pid: int) -> list[str]:
    return sorted((_read(f"/proc/{pid}/task/{tid}/comm") or "?").strip() for tid in _listdir(f"/proc/{pid}/task"))


@dataclass
class Diagnosis:
    """What `/proc` says about a frozen host; fields it could not read are None."""

    state: str | None = None
    syscall: str | None = None
    wchan: str | None = None
    waits_on: str | None = None
    waits_on_child: int | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    cause: str = "unknown"
    unreadable: list[str] = field(default_factory=list)

    def attributes(self) -> dict[str, Any]:
        values = {
            "stallwatch.freeze.cause": self.cause,
            "stallwatch.freeze.main_thread.state": self.state,
            "stallwatch.freeze.main_thread.syscall": self.syscall,
            "stallwatch.freeze.main_thread.wchan": self.wchan,
            "stallwatch.freeze.waits_on": self.waits_on,
            "stallwatch.freeze.child.pid": self.waits_on_child,
        }
        return {k: v for k, v in values.items() if v is not None}


def diagnose(pid: int, dumped: frozenset[int] = frozenset()) -> Diagnosis:
    """Read the host's main thread and children from `/proc` and name a cause. `dumped`: children seen
    dumping core earlier in this freeze; one still there (exiting once its core is written: its memory
    unmapped, then its pipe closed) is still the cause."""
    found = Diagnosis()
    stat = _read(f"/proc/{pid}/stat")
    if stat:
        found.state = stat.rsplit(")", 1)[1].split()[0]
    syscall = _read(f"/proc/{pid}/syscall")
    if syscall is None:
        found.unreadable.append("syscall")
    wchan = _read(f"/proc/{pid}/wchan")
    found.wchan = wchan.strip() if wchan and wchan.strip() not in ("", "0") else None
    if wchan is None:
        found.unreadable.append("wchan")
    fields = (syscall or "").split()
    if fields and fields[0].lstrip("-").isdigit():
        number = int(fields[0])
        found.syscall = SYSCALLS.get(number, f"syscall {number}")
        if found.syscall == "read" and len(fields) > 1:
            found.waits_on = _link(f"/proc/{pid}/fd/{int(fields[1], 16)}")
    elif fields:
        found.syscall = fields[0]  # "running"
    host_exe = _link(f"/proc/{pid}/exe")
    for child in _children(pid):
        exe = _link(f"/proc/{child}/exe")
        info = {
            "pid": child,
            "comm": (_read(f"/proc/{child}/comm") or "?").strip(),
            "exe": exe,
            "state": (_status_field(child, "State") or "?").split()[0],
            "core_dumping": _status_field(child, "CoreDumping") == "1",
            "execed": _execed(child, exe, host_exe),
            "threads": _thread_names(child),
        }
        fds = _listdir(f"/proc/{child}/fd") if found.waits_on and found.waits_on.startswith("pipe:") else []
        if any(_link(f"/proc/{child}/fd/{fd}") == found.waits_on for fd in fds):
            found.waits_on_child = child
        found.children.append(info)
    found.cause = _cause(found, dumped)
    return found


def core_dumping_child(pid: int) -> bool:
    """Whether a child of the host is dumping core now: the one fact that changes a frozen host's cause
    within a poll, so the watchdog looks for it at every poll of a freeze, cheaply."""
    return any(_status_field(child, "CoreDumping") == "1" for child in _children(pid))


def _execed(pid: int, exe: str | None, host_exe: str | None) -> bool:
    """Whether a child of the host has exec'd: the kernel's flag for it, else (its `/proc/PID/stat`
    unreadable) whether it runs another executable than the host's. A host waiting on its own
    interpreter, exec'd again (`sys.executable`), is waiting on an exec'd child."""
    never = never_execed(pid)
    return not never if never is not None else exe is not None and exe != host_exe


def _cause(found: Diagnosis, dumped: frozenset[int]) -> str:
    if any(c["core_dumping"] or c["pid"] in dumped for c in found.children):
        return "child_core_dump"
    if found.syscall in ("vfork", "clone", "clone3") or (found.wchan or "").startswith("kernel_clone"):
        return "vfork_child"
    waited = [c for c in found.children if c["pid"] == found.waits_on_child]
    if waited and not waited[0]["execed"]:
        return "child_before_exec"
    if found.syscall not in (None, "running"):
        return "blocked_syscall"
    return "unknown"


def _main_thread(d: Diagnosis) -> str:
    """The main thread's part of a freeze's one-line description: running, or in which call and where
    the kernel holds it (`wchan`, where readable)."""
    if d.syscall == "running":
        return f"main thread running (state {d.state or '?'})"
    where = f" (wchan {d.wchan})" if d.wchan else ""
    return f"main thread {d.state or '?'} in {d.syscall or 'an unknown call'}{where}"


@dataclass
class Freeze:
    kind: str
    started_mono_ns: int
    started_wall_ns: int
    diagnosis: Diagnosis
    snapshot: dict[str, Any]
    diagnosed_at: float = 0.0
    host_exit: dict[str, Any] = field(default_factory=dict)
    dumped: frozenset[int] = frozenset()  # children seen dumping core during this freeze
    stacks: str | None = None  # the host's stacks dumped during this freeze, once read (`read_stacks`)
    stacks_awaited: bool = False  # their dump was waited for

    def rediagnose(self, pid: int) -> None:
        """Read `/proc` again; a child once seen dumping core stays the cause while it is there."""
        self.diagnosis = diagnose(pid, self.dumped)
        self.dumped |= {child["pid"] for child in self.diagnosis.children if child["core_dumping"]}
        self.diagnosed_at = time.monotonic()


def read_stacks(freeze: Freeze, heartbeat_path: str) -> None:
    """Keep the host's stacks dumped since `freeze` began in `freeze.stacks`, for its records: read at its
    detection (before the pipeline is set up, which may outlast the host, whose exit removes the file) and at
    each later diagnosis. faulthandler's timer and the detection both fire one threshold after the last
    heartbeat: the first read without them gives the timer's thread STACKS_GRACE to write."""
    path = heartbeat.stacks_path(Path(heartbeat_path))
    stacks = heartbeat.last_stacks(path, since_wall_ns=freeze.started_wall_ns)
    if stacks is None and not freeze.stacks_awaited and path.exists():
        freeze.stacks_awaited = True
        deadline = time.monotonic() + STACKS_GRACE
        while stacks is None and time.monotonic() < deadline:
            time.sleep(0.02)
            stacks = heartbeat.last_stacks(path, since_wall_ns=freeze.started_wall_ns)
    if stacks:
        freeze.stacks = stacks


def host_exit_status(pid: int) -> dict[str, Any]:
    """How the host ended, read from its zombie's `/proc/PID/stat` (`exit_code`, field 52).

    The watchdog is not the host's parent, so it cannot wait for it, and only ptrace (which would
    stop the host at every signal) reports the exit otherwise. The kernel keeps the wait status in
    the zombie until the parent reaps it. A parent that reaps at once (most process managers)
    leaves nothing to read, and then the signal stays unknown (attribute absent).
    """
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return {}
    if len(fields) < 50 or fields[0] != "Z":
        return {}
    status = int(fields[49])
    if os.WIFSIGNALED(status):
        from ..core.faults import signal_name  # footprint: not in the idle watchdog (loads wrapt and the SDK)

        return {"stallwatch.freeze.host.exit_signal": signal_name(os.WTERMSIG(status))}
    if os.WIFEXITED(status):
        return {"stallwatch.freeze.host.exit_code": os.WEXITSTATUS(status)}
    return {}


def _spawn(freeze: Freeze) -> dict[str, Any]:
    """The operation the host was spawning when it froze (executable name and argument count)."""
    if not freeze.snapshot.get("spawn_ns"):
        return {}
    return {"stallwatch.freeze.spawn": freeze.snapshot["spawn_command"]}


class FreezeTelemetry:
    """What reports the freezes: the journal's records and the watchdog's stderr lines from the start, its
    metrics and span once `export()` has returned. Through a pipeline each record is exported immediately:
    flushed as it is made, on a thread of its own (`flush`), so a slow or silent collector never delays the next
    look at the heartbeats."""

    def __init__(self, pid: int, heartbeat_path: Path) -> None:
        self._pid = pid
        self.journal: Any = None  # the host's journal, watchdog side: freeze records survive the host
        self._sentry_handover = heartbeat.sentry_path(heartbeat_path)
        self._active: dict[tuple[str, str], int] = {}
        self._killed: dict[tuple[str, str], float] = {}  # seconds frozen at the death
        self.exported = False  # `export()` has returned: its metrics and span go to the global providers
        self.pipeline = False  # a pipeline is set up: what is recorded is flushed through it at once
        self._flush_lock = threading.Lock()
        self._flushing = False  # a flush thread runs
        self._flush_again = False  # a record was made while it ran: it flushes once more

    def export(self) -> None:
        """Make its instruments and tracer, from OpenTelemetry's global providers (the pipeline's, once set up)."""
        from opentelemetry import metrics, trace

        from .. import telemetry  # footprint: not in the idle watchdog
        from ..core.faults import Deferred, instrument  # footprint: not in the idle watchdog

        # Every kind and cause at 0 from the start: "not frozen" is a value, and a first freeze an increase.
        kinds = [(kind, cause) for kind in telemetry.FREEZE_KIND.values for cause in telemetry.FREEZE_CAUSE.values]
        self._active = dict.fromkeys(kinds, 0)
        self._killed = dict.fromkeys(kinds, 0.0)
        meter = metrics.get_meter(telemetry.INSTRUMENTATION_SCOPE)
        self._duration = Deferred(meter, telemetry.FREEZE_DURATION, owner=("watchdog", "STALLWATCH_WATCHDOG"))
        for kind, cause in kinds:
            self._duration.zero({"stallwatch.freeze.kind": kind, "stallwatch.freeze.cause": cause})
        instrument(meter, telemetry.FREEZE_ACTIVE, self._observe)
        instrument(meter, telemetry.FREEZE_HOST_KILLED, self._observe_killed)
        self._tracer = trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE)
        self.exported = True

    def _observe(self, options: Any) -> list[Any]:
        from opentelemetry.metrics import Observation

        return [
            Observation(value, {"stallwatch.freeze.kind": kind, "stallwatch.freeze.cause": cause})
            for (kind, cause), value in self._active.items()
        ]

    def _observe_killed(self, options: Any) -> list[Any]:
        from opentelemetry.metrics import Observation

        return [
            Observation(seconds, {"stallwatch.freeze.kind": kind, "stallwatch.freeze.cause": cause})
            for (kind, cause), seconds in self._killed.items()
        ]

    @property
    def host_died_frozen(self) -> bool:
        """Whether the host died during a freeze: the watchdog then has a last word to deliver."""
        return any(self._killed.values())

    def _describe(self, freeze: Freeze, now_ns: int) -> str:
        d = freeze.diagnosis
        child = next((c for c in d.children if c["pid"] == d.waits_on_child), None)
        parts = [
            f"host {self._pid} frozen ({freeze.kind}) for {(now_ns - freeze.started_mono_ns) / 1e9:.1f}s",
            f"cause {d.cause}",
            _main_thread(d),
        ]
        if d.waits_on:
            parts.append(f"waiting on {d.waits_on}")
        if child is not None:
            parts.append(
                f"child {child['pid']} {child['comm']} state {child['state']} core_dumping {child['core_dumping']} "
                f"exec'd {child['execed']} threads {child['threads']}"
            )
        if freeze.snapshot.get("spawn_ns"):
            parts.append(f"spawning {freeze.snapshot['spawn_command']!r} (span {freeze.snapshot['span_id']})")
        if d.unreadable:
            parts.append(f"unreadable without ptrace rights: {', '.join(d.unreadable)}")
        return "; ".join(parts)

    def _record_attributes(self, freeze: Freeze) -> dict[str, Any]:
        attributes = freeze.diagnosis.attributes() | {"stallwatch.freeze.kind": freeze.kind} | _spawn(freeze)
        if freeze.stacks:
            attributes["stallwatch.freeze.stacks"] = freeze.stacks
        return attributes

    def frozen(self, freeze: Freeze, now_ns: int) -> None:
        self._active[(freeze.kind, freeze.diagnosis.cause)] = 1
        if self.journal is not None:  # durable before anything else: the host may be killed any moment
            self.journal.freeze_started(
                freeze.kind, freeze.diagnosis.cause, freeze.started_wall_ns, self._record_attributes(freeze)
            )
        with self._in_host_span(freeze):
            log.warning("stallwatch: freeze detected: %s", self._describe(freeze, now_ns),
                         extra=self._record_attributes(freeze))  # fmt: skip
        self.flush()
        self._to_sentry(freeze, now_ns)

    def still_frozen(self, freeze: Freeze, now_ns: int) -> None:
        self._active = dict.fromkeys(self._active, 0) | {(freeze.kind, freeze.diagnosis.cause): 1}
        with self._in_host_span(freeze):
            log.warning("stallwatch: still frozen: %s", self._describe(freeze, now_ns),
                         extra=self._record_attributes(freeze))  # fmt: skip
        self.flush()

    def thawed(self, freeze: Freeze, outcome: str) -> None:
        self._active = dict.fromkeys(self._active, 0)
        if self.journal is not None:
            self.journal.freeze_ended(outcome)
        seconds = (time.time_ns() - freeze.started_wall_ns) / 1e9
        attributes = (
            freeze.diagnosis.attributes()
            | _spawn(freeze)
            | freeze.host_exit
            | {
                "stallwatch.freeze.kind": freeze.kind,
                "stallwatch.freeze.outcome": outcome,
                "stallwatch.freeze.host.pid": self._pid,
            }
        )
        if outcome == "host_killed":
            self._killed[(freeze.kind, freeze.diagnosis.cause)] = max(seconds, 1e-9)  # never 0: it happened
        if self.exported:
            self._span_and_duration(freeze, seconds, attributes)
        say = log.warning if outcome == "host_killed" else log.info
        with self._in_host_span(freeze):
            say("stallwatch: freeze over after %.1fs (%s, outcome %s)", seconds, freeze.kind, outcome, extra=attributes)
        self.flush()

    def _span_and_duration(self, freeze: Freeze, seconds: float, attributes: dict[str, Any]) -> None:
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        with self._in_host_span(freeze):  # an exemplar of the duration leads to the frozen span
            self._duration.record_now(seconds, {"stallwatch.freeze.kind": freeze.kind,
                                                "stallwatch.freeze.cause": freeze.diagnosis.cause})  # fmt: skip
        links = []
        trace_id, span_id = heartbeat.frozen_span(freeze.snapshot)
        if trace_id:
            links.append(Link(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))))
        span = self._tracer.start_span("stallwatch.freeze", start_time=freeze.started_wall_ns, links=links,
                                       attributes=attributes)  # fmt: skip
        span.end()

    def _in_host_span(self, freeze: Freeze) -> contextlib.AbstractContextManager[Any]:
        """The host's span that froze, made current (`_in_host_span`) when a pipeline exports what is recorded."""
        return _in_host_span(freeze) if self.pipeline else contextlib.nullcontext()

    def _to_sentry(self, freeze: Freeze, now_ns: int) -> None:
        """Send the freeze to Sentry when the host handed its Sentry options over: once per freeze,
        while the host is frozen, with the facts of the freeze's log record."""
        handed = heartbeat.read_sentry_handover(self._sentry_handover)
        if handed is None:
            return
        from ..core.scrub import scrub_value  # footprint: not in the idle watchdog

        record = self._record_attributes(freeze)
        found = freeze.diagnosis
        trace_id, span_id = heartbeat.frozen_span(freeze.snapshot)
        child = next((c for c in found.children if c["pid"] == found.waits_on_child), None)
        context = {
            "description": scrub_value(self._describe(freeze, now_ns)),  # names what the host ran
            "host_pid": self._pid,
            "frozen_seconds": round((now_ns - freeze.started_mono_ns) / 1e9, 3),
            "main_thread_state": found.state,
            "main_thread_syscall": found.syscall,
            "main_thread_wchan": found.wchan,
            "waits_on": found.waits_on,
            "child": {k: v for k, v in child.items() if k != "exe"} if child else None,  # as the log line has it
            "stacks": record.get("stallwatch.freeze.stacks"),
        }
        try:
            # optional: sentry-sdk, when the host handed its options over
            from .. import sentry

            sentry.capture_for_host(
                handed,
                "freeze",
                record,
                context,
                f"{trace_id:032x}" if trace_id else "",
                f"{span_id:016x}" if trace_id else "",
            )
        except Exception:  # sentry-sdk missing or odd here: the freeze still went to OpenTelemetry
            from ..core.faults import FAULTS, SENTRY_COMPONENT, SENTRY_OFF, SENTRY_SETTING  # footprint: as above

            FAULTS.record(SENTRY_COMPONENT, SENTRY_SETTING, off=SENTRY_OFF)

    def flush(self) -> None:
        """Export what was recorded, now, on the flush thread: one at a time, and once more after it
        for what was recorded meanwhile. The watchdog's own shutdown flushes what is left."""
        if not self.pipeline:
            return
        with self._flush_lock:
            if self._flushing:
                self._flush_again = True
                return
            self._flushing = True
        threading.Thread(target=self._flush_while_asked, name="stallwatch-watchdog-flush", daemon=True).start()

    def _flush_while_asked(self) -> None:
        while True:
            self._flush_now()
            with self._flush_lock:
                if not self._flush_again:
                    self._flushing = False
                    return
                self._flush_again = False

    def _flush_now(self) -> None:
        """Export now. Push readers only: a collect on a pull (Prometheus) reader would queue a
        second copy of every series for the next scrape."""
        from opentelemetry import _logs, metrics, trace
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        from .. import sdk_compat  # footprint: the SDK loads with the pipeline, at the first late heartbeat

        for provider in (trace.get_tracer_provider(), _logs.get_logger_provider()):
            flush = getattr(provider, "force_flush", None)
            if flush is not None:
                flush()
        for reader in sdk_compat.metric_readers(metrics.get_meter_provider()):
            if isinstance(reader, PeriodicExportingMetricReader):
                reader.force_flush()


def _in_host_span(freeze: Freeze) -> contextlib.AbstractContextManager[Any]:
    """Makes the host's span that froze (`heartbeat.frozen_span`) current in the watchdog, so the
    log records made inside carry its trace and span ids (the SDK's handler reads them there)."""
    from opentelemetry import trace
    from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

    trace_id, span_id = heartbeat.frozen_span(freeze.snapshot)
    if not trace_id:
        return contextlib.nullcontext()
    host_span = NonRecordingSpan(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1)))
    return trace.use_span(host_span, end_on_exit=False)


class _SourceFormatter(logging.Formatter):
    """Starts every line of a record (its traceback's too) with `prefix`, in place of the usual
    "stallwatch: " at the start of the message."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record).removeprefix("stallwatch: ")
        return "\n".join(self.prefix + line for line in text.splitlines())


_named = threading.Lock()  # held once the watchdog's stderr lines are named


def name_the_source(host_pid: int) -> None:
    """Say on every line the watchdog writes to its stderr, which is the host's, that it is the
    watchdog's: WARNING and above of every logger (the SDK's too, as Python's last-resort handler
    would print them), Python warnings, and an uncaught exception's traceback. Once per process;
    before the first record of this module's or the pipeline's."""
    if not _named.acquire(blocking=False):
        return
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_SourceFormatter(f"stallwatch watchdog (host pid {host_pid}): "))
    logging.getLogger().addHandler(handler)
    logging.captureWarnings(True)
    sys.excepthook = lambda kind, error, trace: log.critical("stallwatch: failed", exc_info=(kind, error, trace))


def poll_failed(host_pid: int, first: bool, counted: bool) -> None:
    """In the watchdog's `except Exception` around one poll (`Watchdog.run`), which goes on watching:
    the `first` failure is logged with its traceback on the watchdog's stderr lines, and each one is
    counted as a fault of the watchdog's (`stallwatch.instrumentation.errors`) when its telemetry is
    set up (`counted`)."""
    if first:
        log.warning("stallwatch: a poll of the freeze watchdog of host %d failed; it goes on watching. Set %s=false "
                    "to turn this part off.", host_pid, heartbeat.SETTING, exc_info=True)  # fmt: skip
    if counted:
        from ..core.faults import FAULTS  # footprint: not in the idle watchdog (loads wrapt and the SDK)

        FAULTS.count(heartbeat.COMPONENT)


def serve_last_word(session: Any, host_pid: int) -> None:
    """Keep the Prometheus endpoint up until a scrape has carried the host's death (OTLP has it
    already), for `STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT` seconds at most."""
    if session is None:  # its pipeline was never set up (`Reporting.set_up`): there is no endpoint
        return
    timeout = session.settings.watchdog_last_scrape_timeout if session.settings is not None else 0.0
    if session.prometheus_address is None or timeout <= 0:
        return
    if not session.wait_for_scrape(timeout):
        log.warning("stallwatch: host %d died frozen and no Prometheus scrape came within %g s to carry it; "
                     "STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT sets how long to wait", host_pid, timeout)  # fmt: skip


class Reporting:
    """The watchdog's telemetry pipeline, its side of the host's journal and the freeze telemetry (`set_up`).
    The package's `__init__` never runs here (`heartbeat.watchdog_command`): it would load every
    instrumentation, and the watchdog instruments nothing. `setup`, `shutdown` and `prepare` come from the
    caller (`stallwatch._watchdog`): they build, stop and load the pipeline of a layer above this one."""

    def __init__(
        self,
        args: Arguments,
        setup: Callable[..., Any],
        shutdown: Callable[[], object],
        prepare: Callable[[], None],
    ) -> None:
        self._args = args
        self._setup = setup
        self._shutdown = shutdown
        self._prepare = prepare
        self.session: Any = None
        self.telemetry = FreezeTelemetry(args.pid, Path(args.heartbeat))  # on its lines until `set_up` adds more

    def prepare(self) -> None:
        """The imports `set_up()` needs, on any thread: most of its time. One that fails is left to
        `set_up()`, which meets it again and says so on the watchdog's lines (this thread's traceback would
        go to the host's stderr unnamed)."""
        with contextlib.suppress(Exception):
            self._prepare()
            if self._args.journal_dir is not None:
                from .. import journal  # noqa: F401  # footprint: loaded at the first late heartbeat

    def set_up(self) -> None:
        """Set up the pipeline, the journal's watchdog side and the freeze metrics and span, on the main thread
        (`setup()` installs its SIGTERM flush only there). A part that fails is said once, and the freezes are
        reported by the others (module docstring)."""
        failed: list[tuple[str, Exception]] = []
        try:
            self.session = self._set_up_pipeline()
            self.telemetry.pipeline = True
        except Exception as exc:
            failed.append(("telemetry pipeline", exc))
        if self._args.journal_dir is not None:
            try:
                from ..journal import Journal  # footprint: loaded at the first late heartbeat

                self.telemetry.journal = Journal(Path(self._args.journal_dir), role="watchdog", host_pid=self._args.pid)
            except Exception as exc:
                failed.append(("side of the host's journal", exc))
        try:
            self.telemetry.export()
        except Exception as exc:
            failed.append(("freeze metrics and span", exc))
        for part, error in failed:
            self._not_set_up(part, error)
        if failed:
            self._count(len(failed))

    def _set_up_pipeline(self) -> Any:
        from .. import telemetry  # footprint: loaded at the first late heartbeat
        from ..config import Settings  # footprint: loaded at the first late heartbeat

        # The host's resource attributes (its service.instance.id among them) and the watchdog's own.
        inherited = Settings.load().resource_attributes
        own = {telemetry.RESOURCE_PROCESS_ROLE.name: "watchdog", "stallwatch.watched.pid": str(self._args.pid)}
        return self._setup(resource_attributes={**inherited, **own})

    def _not_set_up(self, part: str, error: Exception) -> None:
        """One line for a part that failed, naming where the freezes are reported instead; with the traceback
        unless it is a setting refused, which the message names."""
        from ..config import ConfigError  # footprint: loaded at the first late heartbeat

        outlets = ["on these lines"]
        if self.telemetry.journal is not None:
            outlets.append("in the host's journal")
        if self.telemetry.pipeline:
            outlets.append("through its telemetry pipeline")
        where = f"{', '.join(outlets[:-1])} and {outlets[-1]}" if len(outlets) > 1 else outlets[0]
        log.warning("stallwatch: the freeze watchdog of host %d cannot set up its %s (%s: %s) and will not try "
                    "again; it reports freezes %s only. Set %s=false to turn this part off.", self._args.pid, part,
                    type(error).__name__, error, where, heartbeat.SETTING,
                    exc_info=(type(error), error, error.__traceback__) if not isinstance(error, ConfigError) else None,
                    )  # fmt: skip

    @staticmethod
    def _count(faults: int) -> None:
        """Count the failed parts as faults of the watchdog's, where a meter provider was installed before a
        failure; the count needs the SDK, whose import may be what failed (the line has said so)."""
        with contextlib.suppress(Exception):
            from ..core.faults import FAULTS  # footprint: loaded at the first late heartbeat

            for _ in range(faults):
                FAULTS.count(heartbeat.COMPONENT)

    def close(self) -> None:
        if self.telemetry.journal is not None:
            self.telemetry.journal.close()
        if self.session is not None:
            self._shutdown()
