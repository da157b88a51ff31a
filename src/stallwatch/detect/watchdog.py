"""The freeze watchdog: a second process that sees a frozen host while the freeze lasts (docs/freezes.md).

Started by `setup()` through vfork/posix_spawn as `python -c BOOTSTRAP` (`heartbeat.BOOTSTRAP`), which runs
`stallwatch._watchdog` without the package's `__init__`. While the host beats on time it runs on the
standard library alone, on one thread; a heartbeat late by `PREPARE_NS` starts loading its telemetry
pipeline (`_Reporting`), ready before the lateness becomes a freeze (at once with a Prometheus
exporter, to serve scrapes). Every `POLL_SECONDS` it reads the heartbeats: an interpreter heartbeat
older than the threshold is `gil_held`, a loop heartbeat alone `loop_blocked`. A freeze is reported
while it lasts (WARNING log record, `stallwatch.freeze.active`, Sentry) with what `/proc` says the
host waits on, and at the thaw as a `stallwatch.freeze` span. A host that dies frozen leaves its last
word (`stallwatch.freeze.host_killed`, outcome `host_killed`; docs/watchdog-last-word.md). It leaves
when the host exits or execs another program, and at SIGTERM once the host's shutdown has removed the
heartbeat file; it runs in a session of its own, and its stderr lines start
`stallwatch watchdog (host pid N):`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._private import never_execed
from . import heartbeat

POLL_SECONDS = 0.1
FRESH_NS = int(3 * heartbeat.BEAT_SECONDS * 1e9)  # younger than this: the beating thread runs now
PREPARE_NS = int(1.5 * heartbeat.BEAT_SECONDS * 1e9)  # a heartbeat older than this: load the pipeline
REDIAGNOSE_SECONDS = 2.0
STACKS_GRACE = 1.0  # the longest a freeze report waits for the stacks faulthandler writes at the same moment
SYSCALLS_X86_64 = {0: "read", 7: "poll", 56: "clone", 58: "vfork", 61: "wait4", 202: "futex", 232: "epoll_wait",
                   281: "epoll_pwait", 435: "clone3", 441: "epoll_pwait2"}  # fmt: skip
_log = logging.getLogger("stallwatch.watchdog")


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


def _children(pid: int) -> list[int]:
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        kids += [int(c) for c in (_read(f"/proc/{pid}/task/{tid}/children") or "").split()]
    return kids


def _thread_names(pid: int) -> list[str]:
    names = []
    for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
        names.append((_read(f"/proc/{pid}/task/{tid}/comm") or "?").strip())
    return sorted(names)


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


def diagnose(pid: int) -> Diagnosis:
    """Read the host's main thread and children from `/proc` and name a cause."""
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
        found.syscall = SYSCALLS_X86_64.get(number, f"syscall {number}")
        if number == 0 and len(fields) > 1:
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
        if found.waits_on and found.waits_on.startswith("pipe:"):
            fds = os.listdir(f"/proc/{child}/fd") if os.path.isdir(f"/proc/{child}/fd") else []
            if any(_link(f"/proc/{child}/fd/{fd}") == found.waits_on for fd in fds):
                found.waits_on_child = child
        found.children.append(info)
    found.cause = _cause(found)
    return found


def _execed(pid: int, exe: str | None, host_exe: str | None) -> bool:
    """Whether a child of the host has exec'd: the kernel's flag for it, else (its `/proc/PID/stat`
    unreadable) whether it runs another executable than the host's. A host waiting on its own
    interpreter, exec'd again (`sys.executable`), is waiting on an exec'd child."""
    never = never_execed(pid)
    return not never if never is not None else exe is not None and exe != host_exe


def _cause(found: Diagnosis) -> str:
    if any(c["core_dumping"] for c in found.children):
        return "child_core_dump"
    if found.syscall in ("vfork", "clone", "clone3") or (found.wchan or "").startswith("kernel_clone"):
        return "vfork_child"
    waited = [c for c in found.children if c["pid"] == found.waits_on_child]
    if waited and not waited[0]["execed"]:
        return "child_before_exec"
    if found.syscall not in (None, "running"):
        return "blocked_syscall"
    return "unknown"


# ---- the watch loop --------------------------------------------------------------------------------


@dataclass
class Freeze:
    kind: str
    started_mono_ns: int
    started_wall_ns: int
    diagnosis: Diagnosis
    snapshot: dict[str, Any]
    diagnosed_at: float = 0.0
    host_exit: dict[str, Any] = field(default_factory=dict)


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


class Watchdog:
    """Watches one host process; `run()` returns when the host is gone."""

    def __init__(
        self,
        pid: int,
        heartbeat_path: Path,
        threshold: float,
        telemetry: Callable[[], Any],
        prepare: Callable[[], None],
        telemetry_ready: Any = None,
    ) -> None:
        """`telemetry()` makes what reports the freezes (a `FreezeTelemetry`), on this thread.
        `prepare()` does the slow part of that (imports) and runs on a thread of its own as soon as
        a heartbeat is late by `PREPARE_NS` (or the threshold, if shorter); `telemetry()` is called
        at the first poll after it has finished, freeze or not, or at a freeze that came first. Neither
        runs while the host beats on time. `telemetry_ready`: what `telemetry()` made before (with a
        Prometheus exporter, at start)."""
        self.pid = pid
        self.heartbeat_path = heartbeat_path
        self.threshold_ns = int(threshold * 1e9)
        self._make_telemetry = telemetry
        self._prepare_telemetry = prepare
        self._preparing: threading.Thread | None = None
        self._telemetry: Any = telemetry_ready
        self.freeze: Freeze | None = None
        self._first_beat_ns: int | None = None  # the interpreter heartbeat first read, until the host beats
        self._beating = False  # the host has begun to beat: its set-up is over
        self.host_left = False  # the host exec'd another program: nothing of stallwatch's is left to watch
        self._stopping = False  # a SIGTERM came while a freeze was being reported
        signal.signal(signal.SIGTERM, self._on_sigterm)  # before any setup(): this one, not its flush-and-die

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The host's shutdown removes its heartbeat file, then sends SIGTERM and does not wait: leave
        through `main`'s cleanup (which flushes a pipeline set up), at once or, during a freeze, once
        its report is made. A SIGTERM while the file is still there went to every process of the
        host's cgroup (systemd stopping a unit): keep watching, and leave when the host has gone."""
        if self.heartbeat_path.exists():
            return
        if self.freeze is None:
            raise SystemExit(0)
        self._stopping = True

    def run(self) -> None:
        pidfd = os.pidfd_open(self.pid)
        try:
            while not self.host_left and not self._stopping and not select.select([pidfd], [], [], POLL_SECONDS)[0]:
                self.check()
        finally:
            os.close(pidfd)
        if self._stopping:  # the freeze is reported: now leave as the SIGTERM asked
            raise SystemExit(0)
        if self.host_left:
            _log.info("stallwatch: host %d exec'd another program; its freeze watchdog leaves", self.pid)
        if self.freeze is not None:
            self.freeze.host_exit = host_exit_status(self.pid)
            self.thaw(outcome="host_killed")

    def check(self) -> None:
        snapshot = heartbeat.read(self.heartbeat_path)
        if snapshot is None:
            return
        if not self._beating:  # the file is made before the host's set-up, the heartbeats start after it
            if self._first_beat_ns is None:
                self._first_beat_ns = snapshot["interpreter_ns"]
            if snapshot["interpreter_ns"] == self._first_beat_ns:
                self.host_left = not heartbeat.in_use(self.heartbeat_path)  # exec'd before its first beat
                return
            self._beating = True
        if snapshot["watchdog_pid"] != os.getpid():  # it judges the heartbeats from now on, or the file is new
            heartbeat.mark_watched(self.heartbeat_path)
        now = time.monotonic_ns()
        interpreter_age = now - snapshot["interpreter_ns"]
        loop_age = now - snapshot["loop_ns"] if snapshot["loop_tracked"] else 0
        if max(interpreter_age, loop_age) > min(PREPARE_NS, self.threshold_ns):
            self._prepare()  # a freeze may be coming: be ready to report it at the threshold
        if self._telemetry is None and self._preparing is not None and not self._preparing.is_alive():
            self._set_up()  # the imports are done: set up between two polls
        kind = None
        if interpreter_age > self.threshold_ns:
            kind = "gil_held"
        elif snapshot["loop_tracked"] and now - snapshot["loop_ns"] > self.threshold_ns:
            # Only a *fresh* interpreter heartbeat proves other Python threads still run; one that
            # is merely under the threshold may be going stale too (GIL held): decide next poll.
            if interpreter_age > FRESH_NS:
                return
            kind = "loop_blocked"
        if kind is None:
            if self.freeze is not None:
                self.thaw(outcome="thawed")
            return
        if self.freeze is not None and self.freeze.kind != kind and kind == "gil_held":
            self.freeze.kind = kind  # a blocked loop that turned into a held GIL
            self.freeze.diagnosed_at = 0.0  # report the new kind at once
        if not heartbeat.in_use(self.heartbeat_path):  # stale because nobody writes it any more
            self.host_left = True
            self.thaw(outcome="thawed")
            return
        if self.freeze is None:
            last = snapshot["interpreter_ns"] if kind == "gil_held" else snapshot["loop_ns"]
            wall = time.time_ns() - (now - last)
            self.freeze = Freeze(kind, last, wall, diagnose(self.pid), snapshot, time.monotonic())
            self.telemetry.frozen(self.freeze, now)
        elif time.monotonic() - self.freeze.diagnosed_at >= REDIAGNOSE_SECONDS:
            self.freeze.diagnosis = diagnose(self.pid)
            self.freeze.diagnosed_at = time.monotonic()
            self.telemetry.still_frozen(self.freeze, now)

    def _prepare(self) -> None:
        if self._preparing is None:
            self._preparing = threading.Thread(target=self._prepare_telemetry, name="stallwatch-prepare", daemon=True)
            self._preparing.start()

    @property
    def telemetry(self) -> Any:
        """The freeze telemetry, made now (after the imports) if it is not ready yet."""
        if self._telemetry is None:
            self._prepare()
            assert self._preparing is not None
            self._preparing.join()
            self._set_up()
        return self._telemetry

    def _set_up(self) -> None:
        self._telemetry = self._make_telemetry()

    def thaw(self, outcome: str) -> None:
        freeze, self.freeze = self.freeze, None
        if freeze is not None:
            self.telemetry.thawed(freeze, outcome)


class FreezeTelemetry:
    """What the watchdog exports, immediately: each record is flushed as it is made, on a thread of its
    own (`flush`), so a slow or silent collector never delays the next look at the heartbeats."""

    def __init__(self, pid: int, heartbeat_path: Path, journal: Any = None) -> None:
        from opentelemetry import metrics, trace

        from .. import telemetry  # footprint: not in the idle watchdog
        from ..core.faults import Deferred, instrument  # footprint: not in the idle watchdog

        self._pid = pid
        self._journal = journal  # the host's journal, watchdog side: freeze records survive the host
        self._sentry_handover = heartbeat.sentry_path(heartbeat_path)
        self._stacks = heartbeat.stacks_path(heartbeat_path)
        self._stacks_awaited: set[int] = set()  # freezes (by start) whose stacks were waited for
        # Every kind and cause at 0 from the start: "not frozen" is a value, and a first freeze an increase.
        kinds = [(kind, cause) for kind in telemetry.FREEZE_KIND.values for cause in telemetry.FREEZE_CAUSE.values]
        self._active: dict[tuple[str, str], int] = dict.fromkeys(kinds, 0)
        self._killed: dict[tuple[str, str], float] = dict.fromkeys(kinds, 0.0)  # seconds frozen at the death
        meter = metrics.get_meter(telemetry.INSTRUMENTATION_SCOPE)
        self._duration = Deferred(meter, telemetry.FREEZE_DURATION, owner=("watchdog", "STALLWATCH_WATCHDOG"))
        for kind, cause in kinds:
            self._duration.zero({"stallwatch.freeze.kind": kind, "stallwatch.freeze.cause": cause})
        instrument(meter, telemetry.FREEZE_ACTIVE, self._observe)
        instrument(meter, telemetry.FREEZE_HOST_KILLED, self._observe_killed)
        self._tracer = trace.get_tracer(telemetry.INSTRUMENTATION_SCOPE)
        self._flush_lock = threading.Lock()
        self._flushing = False  # a flush thread runs
        self._flush_again = False  # a record was made while it ran: it flushes once more

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
            f"main thread {d.state or '?'} in {d.syscall or '?'} (wchan {d.wchan or '?'})",
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
        stacks = heartbeat.last_stacks(self._stacks, since_wall_ns=freeze.started_wall_ns)
        if stacks is None and self._stacks.exists() and freeze.started_wall_ns not in self._stacks_awaited:
            # faulthandler's timer and this detection both fire one threshold after the last heartbeat:
            # give the timer's thread STACKS_GRACE to write, once per freeze
            self._stacks_awaited.add(freeze.started_wall_ns)
            deadline = time.monotonic() + STACKS_GRACE
            while stacks is None and time.monotonic() < deadline:
                time.sleep(0.02)
                stacks = heartbeat.last_stacks(self._stacks, since_wall_ns=freeze.started_wall_ns)
        if stacks:
            attributes["stallwatch.freeze.stacks"] = stacks
        return attributes

    def frozen(self, freeze: Freeze, now_ns: int) -> None:
        self._active[(freeze.kind, freeze.diagnosis.cause)] = 1
        if self._journal is not None:  # durable before anything else: the host may be killed any moment
            self._journal.freeze_started(
                freeze.kind, freeze.diagnosis.cause, freeze.started_wall_ns, self._record_attributes(freeze)
            )
        with _in_host_span(freeze):
            _log.warning("stallwatch: freeze detected: %s", self._describe(freeze, now_ns),
                         extra=self._record_attributes(freeze))  # fmt: skip
        self.flush()
        self._to_sentry(freeze, now_ns)

    def still_frozen(self, freeze: Freeze, now_ns: int) -> None:
        self._active = dict.fromkeys(self._active, 0) | {(freeze.kind, freeze.diagnosis.cause): 1}
        with _in_host_span(freeze):
            _log.warning("stallwatch: still frozen: %s", self._describe(freeze, now_ns),
                         extra=self._record_attributes(freeze))  # fmt: skip
        self.flush()

    def thawed(self, freeze: Freeze, outcome: str) -> None:
        from opentelemetry.trace import Link, SpanContext, TraceFlags

        self._active = dict.fromkeys(self._active, 0)
        if self._journal is not None:
            self._journal.freeze_ended(outcome)
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
        with _in_host_span(freeze):  # an exemplar of the duration leads to the frozen span
            self._duration.record_now(seconds, {"stallwatch.freeze.kind": freeze.kind,
                                                "stallwatch.freeze.cause": freeze.diagnosis.cause})  # fmt: skip
        if outcome == "host_killed":
            self._killed[(freeze.kind, freeze.diagnosis.cause)] = max(seconds, 1e-9)  # never 0: it happened
        links = []
        trace_id, span_id = heartbeat.frozen_span(freeze.snapshot)
        if trace_id:
            links.append(Link(SpanContext(trace_id, span_id, is_remote=True, trace_flags=TraceFlags(1))))
        span = self._tracer.start_span("stallwatch.freeze", start_time=freeze.started_wall_ns, links=links,
                                       attributes=attributes)  # fmt: skip
        span.end()
        log = _log.warning if outcome == "host_killed" else _log.info
        with _in_host_span(freeze):
            log("stallwatch: freeze over after %.1fs (%s, outcome %s)", seconds, freeze.kind, outcome, extra=attributes)
        self.flush()

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


def _name_the_source(host_pid: int) -> None:
    """Say on every line the watchdog writes to its stderr, which is the host's, that it is the
    watchdog's: WARNING and above of every logger (the SDK's too, as Python's last-resort handler
    would print them), Python warnings, and an uncaught exception's traceback."""
    handler = logging.StreamHandler()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(_SourceFormatter(f"stallwatch watchdog (host pid {host_pid}): "))
    logging.getLogger().addHandler(handler)
    logging.captureWarnings(True)
    sys.excepthook = lambda kind, error, trace: _log.critical("stallwatch: failed", exc_info=(kind, error, trace))


def _serve_last_word(session: Any, host_pid: int) -> None:
    """Keep the Prometheus endpoint up until a scrape has carried the host's death (OTLP has it
    already), for `STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT` seconds at most."""
    timeout = session.settings.watchdog_last_scrape_timeout if session.settings is not None else 0.0
    if session.prometheus_address is None or timeout <= 0:
        return
    if not session.wait_for_scrape(timeout):
        _log.warning("stallwatch: host %d died frozen and no Prometheus scrape came within %g s to carry it; "
                     "STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT sets how long to wait", host_pid, timeout)  # fmt: skip


class _Reporting:
    """The watchdog's telemetry pipeline, its side of the host's journal and the freeze telemetry,
    set up on first need: when a heartbeat is late (`Watchdog`), or at once when a scraper pulls
    the metrics (the watchdog then serves its scrape endpoint from the start). The package's
    `__init__` never runs here (`heartbeat.BOOTSTRAP`): it would load every instrumentation, and the watchdog
    instruments nothing. `setup`, `shutdown` and `prepare` come from the caller (`stallwatch._watchdog`):
    they build, stop and load the pipeline of a layer above this one."""

    def __init__(
        self,
        args: argparse.Namespace,
        setup: Callable[..., Any],
        shutdown: Callable[[], object],
        prepare: Callable[[], None],
    ) -> None:
        self._args = args
        self._setup = setup
        self._shutdown = shutdown
        self._prepare = prepare
        self.session: Any = None
        self._journal: Any = None
        self.telemetry: FreezeTelemetry | None = None

    def prepare(self) -> None:
        """The imports `make()` needs, on any thread: most of its time."""
        self._prepare()
        if self._args.journal_dir is not None:
            from .. import journal  # noqa: F401  # footprint: loaded at the first late heartbeat

    def make(self) -> FreezeTelemetry:
        """Set up on the main thread (`setup()` installs its SIGTERM flush only there)."""
        if self.telemetry is None:
            from .. import telemetry  # footprint: loaded at the first late heartbeat
            from ..config import Settings  # footprint: loaded at the first late heartbeat

            # The host's resource attributes (its service.instance.id among them) and the watchdog's own.
            inherited = Settings.load().resource_attributes
            own = {telemetry.RESOURCE_PROCESS_ROLE.name: "watchdog", "stallwatch.watched.pid": str(self._args.pid)}
            self.session = self._setup(resource_attributes={**inherited, **own})
            if self._args.journal_dir is not None:
                from ..journal import Journal  # footprint: loaded at the first late heartbeat

                self._journal = Journal(self._args.journal_dir, role="watchdog", host_pid=self._args.pid)
            self.telemetry = FreezeTelemetry(self._args.pid, self._args.heartbeat, self._journal)
        return self.telemetry

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
        if self.session is not None:
            self._shutdown()


def main(
    setup: Callable[..., Any],
    shutdown: Callable[[], object],
    prepare: Callable[[], None],
    argv: list[str] | None = None,
) -> int:
    """Run the watchdog process (`stallwatch._watchdog`, started as `python -c BOOTSTRAP`). `setup` and
    `shutdown` build and stop its own telemetry pipeline, `prepare` imports what `setup` needs; all three
    are handed down by the caller and run only when the pipeline is needed (`_Reporting`)."""
    parser = argparse.ArgumentParser(prog="stallwatch watchdog", description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True, help="the host process to watch")
    parser.add_argument("--heartbeat", type=Path, required=True, help="the host's heartbeat file")
    parser.add_argument("--threshold", type=float, default=1.0, help="seconds without a heartbeat = frozen")
    parser.add_argument("--journal-dir", type=Path, help="the host's journal directory (STALLWATCH_JOURNAL_DIR)")
    args = parser.parse_args(argv)
    if args.threshold <= 0:
        parser.error("--threshold must be positive (STALLWATCH_FREEZE_THRESHOLD)")
    _name_the_source(args.pid)
    os.environ["STALLWATCH_WATCHDOG"] = "false"  # the watchdog never watches itself
    for part in ("EXECUTOR", "SUBPROCESS", "SSH", "NEBIUS"):  # it runs none of these
        os.environ[f"STALLWATCH_INSTRUMENT_{part}"] = "false"
    reporting = _Reporting(args, setup, shutdown, prepare)
    try:
        if "prometheus" in os.environ.get("OTEL_METRICS_EXPORTER", "").split(","):
            reporting.make()
        Watchdog(args.pid, args.heartbeat, args.threshold, reporting.make, reporting.prepare, reporting.telemetry).run()
        if reporting.telemetry is not None and reporting.telemetry.host_died_frozen:
            _serve_last_word(reporting.session, args.pid)
    except ProcessLookupError:
        pass
    finally:
        reporting.close()
    heartbeat.remove_files(args.heartbeat)  # the host is gone: a killed host could not remove them
    return 0
