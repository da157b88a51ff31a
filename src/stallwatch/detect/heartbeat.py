"""Heartbeats in shared memory, read by the watchdog process (docs/freezes.md).

The host writes into a small mmap'd file (0600), with aligned 8-byte stores and no locks (the
watchdog re-reads a torn value): an *interpreter* heartbeat from stallwatch's worker thread (stale
when no Python thread runs: `gil_held`), a *loop* heartbeat from each running event loop (stale
while that loop is blocked: `loop_blocked`), what an exec-bound spawn runs before it starts, and the
span current on the main thread (`track_current_span`), so a freeze names its operation and trace.
The watchdog writes its pid once it watches (`heartbeat_file.mark_watched`, read by `HeartbeatArea.watched_by`).
No library does this, hence the hand-written layout.

The host holds an exclusive `flock` on the file while it lives (the kernel drops it even on
SIGKILL); the watchdog removes the files when the host exits, and `sweep()` at the next `setup()`
removes what a killed host and watchdog left. The watchdog reads the file through `heartbeat_file`
(its layout, which this module re-exports), and imports this module only when it has a freeze to
report.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import json
import mmap
import os
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._private import opener
from ..core import background
from .heartbeat_file import (
    BEAT_SECONDS,
    FLAG_LOOP_TRACKED,
    LAYOUT,
    LOOP_KINDS,
    MAGIC,
    OFFSET_COMMAND,
    OFFSET_CURRENT,
    OFFSET_INTERP,
    OFFSET_LOOP,
    OFFSET_LOOP_KIND,
    OFFSET_SPAN,
    OFFSET_SPAWN,
    OFFSET_TRACE,
    OFFSET_WATCHDOG,
    in_use,
    remove_files,
)
from .heartbeat_file import (
    read as read,
)

if TYPE_CHECKING:
    import asyncio

SPAN_IDS = struct.Struct(">QQQ")  # trace id (high, low 64 bits), span id: one store of 24 bytes
_LOW_64 = (1 << 64) - 1
SWEEP_AGE_SECONDS = 10.0  # an unlocked file younger than this may be one a host is creating now
# The watchdog's bootstrap (`watchdog_command`): takes the interpreter's state that `site` would make from its first
# arguments, puts an empty `stallwatch` package in `sys.modules` and runs `stallwatch._watchdog` with the rest.
# Here, not there: the host loads this module, never the watchdog's.
_BOOTSTRAP = """import sys
handed = int(sys.argv[1])
sys.prefix, sys.exec_prefix, package_path, *path = sys.argv[2 : 2 + handed]
del sys.argv[1 : 2 + handed]
sys.path[:] = path
package = sys.modules["stallwatch"] = type(sys)("stallwatch")
package.__path__ = [package_path]
from stallwatch._watchdog import main
sys.exit(main())
"""


def watchdog_command() -> list[str]:
    """How `setup()` starts the watchdog (`detect.watchdog`): this interpreter with `-S`, a bootstrap and
    what it is handed, to which `setup()` adds the watchdog's options.

    Without `site`, neither the `.pth` files of site-packages (their import hooks) nor `sitecustomize`
    run in the watchdog. It is handed this process's `sys.path` (what `site` and the `.pth` files made,
    a virtual environment's site-packages among them) and `sys.prefix`, so the pipeline it loads at a
    freeze comes from where the host's does; a module that only an import hook finds (a `.pth` file's
    finder) is not found there, but for stallwatch, whose package directory it is handed. Its
    `stallwatch` is an empty package (its `__init__` not run, its submodules found as usual). One
    argument per entry: the kernel bounds each argument, not only all of them. Not `-E` or `-I`: the
    host's `PYTHON*` variables (`PYTHONHOME`, `PYTHONPYCACHEPREFIX`, ...) apply to it too.
    """
    package = os.path.dirname(os.path.dirname(__file__))
    path = [entry for entry in sys.path if isinstance(entry, str) and "\0" not in entry]  # no argument holds a NUL
    handed = [sys.prefix, sys.exec_prefix, package, *path]
    return [sys.executable, "-S", "-c", _BOOTSTRAP, str(len(handed)), *handed]


_chosen_directory: Path | None = None


def use_directory(directory: Path | None) -> None:
    """Put this process's heartbeat files in `directory` from now on (None: the usual places).

    `stallwatch doctor` points it at its temporary directory, so that its `setup()` neither sweeps
    nor writes the directory the hosts on the machine share.
    """
    global _chosen_directory
    _chosen_directory = directory


def area_directory() -> Path:
    """Where heartbeat files live: the one `use_directory` chose, else the runtime dir, /dev/shm,
    or the temp dir."""
    if _chosen_directory is not None:
        return _chosen_directory
    for candidate in (os.environ.get("XDG_RUNTIME_DIR"), "/dev/shm"):
        if candidate and os.path.isdir(candidate) and os.access(candidate, os.W_OK):
            return Path(candidate)
    import tempfile  # footprint: seldom needed

    return Path(tempfile.gettempdir())


def sweep(directory: Path) -> int:
    """Remove the heartbeat files in `directory` whose host is gone; return how many hosts' files.

    A file is in use while some process holds its lock (`HeartbeatArea`); one that nobody locks and
    that is older than `SWEEP_AGE_SECONDS` belongs to a host that died without `shutdown()`.
    Another user's files are left alone (the open fails). Never raises.
    """
    removed = 0
    try:
        candidates = list(directory.glob("stallwatch-*-*.hb"))
    except OSError:
        return 0
    for path in candidates:
        try:
            young = time.time() - path.stat().st_mtime < SWEEP_AGE_SECONDS
        except OSError:  # removed meanwhile
            continue
        if not young and not in_use(path):
            with contextlib.suppress(OSError):
                remove_files(path)
                removed += 1
    return removed


class HeartbeatArea:
    """The host's side: creates the file and writes into it.

    Writes never raise: in a fork child they do nothing (it shares the mapping), and after
    `close()` (stallwatch's shutdown, possibly from inside the host's event loop) neither.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or area_directory() / f"stallwatch-{os.getpid()}-{os.urandom(4).hex()}.hb"
        self.inode: int | None  # the file's inode; None once it is gone and cannot be made again
        self._fd, self._map, self.inode = self._create()
        now = time.monotonic_ns()
        self.owner = os.getpid()  # a forked child shares the mapping: it must never write to it
        self._map[:] = LAYOUT.pack(MAGIC, self.owner, 0, now, now, 0, 0, 0, b"", b"", b"", b"", b"")

    def _create(self) -> tuple[int, mmap.mmap, int]:
        """Create the file, locked (held open for the lock: see `sweep`) and mapped."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # waits only for an `in_use` that opened it this instant
            os.ftruncate(fd, LAYOUT.size)
            return fd, mmap.mmap(fd, LAYOUT.size), os.fstat(fd).st_ino
        except BaseException:
            os.close(fd)
            raise

    def recreate(self) -> None:
        """Make the file again at its path, with the current contents: the watchdog reads it by name.

        For a file removed under the running host (a /dev/shm or tmp cleaner). Raises OSError when
        the path cannot be created (e.g. something else took the name).
        """
        fd, new, inode = self._create()
        contents = bytearray(self._map)
        contents[OFFSET_WATCHDOG : OFFSET_WATCHDOG + 4] = bytes(4)  # until the watchdog has read the new file
        new[:] = contents
        # The old mapping is left to the garbage collector: a writer may hold it for one more store.
        old, (self._fd, self._map, self.inode) = self._fd, (fd, new, inode)
        os.close(old)

    @property
    def writable(self) -> bool:
        return os.getpid() == self.owner

    def _write(self, offset: int, data: bytes) -> None:
        if os.getpid() != self.owner:
            return
        with contextlib.suppress(ValueError):  # closed by stop() meanwhile: the heartbeats are over
            self._map[offset : offset + len(data)] = data

    def watched_by(self) -> int:
        """The pid of the watchdog that reads this file from its poll loop, 0 until one does (or
        after `close()`)."""
        try:
            return int.from_bytes(self._map[OFFSET_WATCHDOG : OFFSET_WATCHDOG + 4], "little")
        except ValueError:  # closed
            return 0

    def _store(self, offset: int, value: int) -> None:
        self._write(offset, value.to_bytes(8, "little", signed=True))

    def beat_interpreter(self) -> None:
        self._store(OFFSET_INTERP, time.monotonic_ns())

    def beat_loop(self) -> None:
        self._store(OFFSET_LOOP, time.monotonic_ns())

    def track_loop(self, kind: str | None) -> None:
        """Say whether a loop heartbeat is expected (`kind`) or not (None)."""
        flags = FLAG_LOOP_TRACKED if kind else 0
        self._write(OFFSET_LOOP_KIND, LOOP_KINDS.get(kind or "none", 0).to_bytes(4, "little"))
        self.beat_loop()
        self._write(12, flags.to_bytes(4, "little"))

    def spawning(self, command: str, trace_id: int, span_id: int) -> None:
        """Before an exec-bound spawn: what is spawned (checked for secrets once more) and under which span."""
        from ..core.scrub import scrub_value  # footprint: host side only

        command = scrub_value(command)
        self._write(OFFSET_COMMAND, command.encode(errors="replace")[:256].ljust(256, b"\0"))
        self._write(OFFSET_TRACE, trace_id.to_bytes(16, "big"))
        self._write(OFFSET_SPAN, span_id.to_bytes(8, "big"))
        self._store(OFFSET_SPAWN, time.monotonic_ns())

    def spawned(self) -> None:
        self._store(OFFSET_SPAWN, 0)

    def current_span(self, trace_id: int, span_id: int) -> None:
        """The span now current on the host's main thread (zeros: none, or not known)."""
        if os.getpid() != self.owner:
            return
        with contextlib.suppress(ValueError):  # closed meanwhile
            SPAN_IDS.pack_into(self._map, OFFSET_CURRENT, trace_id >> 64, trace_id & _LOW_64, span_id)

    def close(self) -> None:
        """Unmap, remove and unlock the file (once; in a fork child, nothing)."""
        if self.writable and self._fd >= 0:
            self._map.close()
            self.path.unlink(missing_ok=True)
            fd, self._fd = self._fd, -1
            os.close(fd)


def sentry_path(path: Path) -> Path:
    """Where the host hands its Sentry options to the watchdog, which sends the freezes
    (`stallwatch.sentry.handover`): JSON, present while the host's Sentry wants them."""
    return path.with_suffix(".sentry")


def read_sentry_handover(path: Path) -> dict[str, Any] | None:
    """The watchdog's side: the host's Sentry options, or None (none handed over, or unreadable)."""
    try:
        handed = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return handed if isinstance(handed, dict) and handed.get("dsn") else None


def stacks_path(path: Path) -> Path:
    """Where the host's stacks are written during a freeze: by faulthandler's timer when the GIL is
    held, by the interpreter heartbeat when the loop is blocked (`STALLWATCH_FAULTHANDLER`)."""
    return path.with_suffix(".stacks")


def last_stacks(path: Path, since_wall_ns: int, limit: int = 8192) -> str | None:
    """The last dump in `path` (faulthandler's, or the heartbeat's in its format) if written after
    `since_wall_ns`, truncated."""
    try:
        if path.stat().st_mtime_ns < since_wall_ns:
            return None
        text = path.read_text(errors="replace")
    except OSError:
        return None
    start = text.rfind("Timeout (")
    return text[start:][:limit] if start >= 0 else None


def frozen_span(snapshot: dict[str, Any]) -> tuple[int, int]:
    """The (trace id, span id) a freeze seen in `snapshot` happened in, (0, 0) if not known: the
    span of the spawn in progress, else the span current on the host's main thread."""
    if snapshot["spawn_ns"]:
        ids = snapshot["trace_id"], snapshot["span_id"]
    else:
        ids = snapshot["current_trace_id"], snapshot["current_span_id"]
    trace_id, span_id = int(ids[0] or "0", 16), int(ids[1] or "0", 16)
    return (trace_id, span_id) if trace_id and span_id else (0, 0)


# ---- host-side writers --------------------------------------------------------------------------

AREA: HeartbeatArea | None = None
_beating: background.Task | None = None  # this process's interpreter heartbeat (`ensure_beating`)
_stacks_file: Any = None  # open file the stacks are written into (STALLWATCH_FAULTHANDLER)
# faulthandler's timer is re-armed by the interpreter heartbeat, a thread that needs the GIL: it
# fires only when no thread has let that thread run for its timeout, so while the GIL is held in C
# and every thread's frames stand still. Its dump reads those frames without the GIL, so fired while
# Python code runs it can read freed memory and crash the host (docs/freezes.md). A loop blocked by
# Python code is dumped by the heartbeat itself, under the GIL (`_dump_blocked_loops`).
# The pid of the process that armed faulthandler's timer. CPython's timer thread does not survive a
# fork, and `cancel_dump_traceback_later` waits for it: in a child forked while the timer was armed,
# that call blocks forever, and the interpreter makes it at exit (3.10 to 3.13, tested). So the
# timer is cancelled before a plain fork and armed again after it (`disarm_for_fork`), and a child
# that finds it armed by its parent (forked without the guard) never touches it.
_armed_by = 0
_rearm = False  # `disarm_for_fork` cancelled the timer: `rearm_after_fork` arms it again
_forking = False  # between `disarm_for_fork` and the fork's end: the heartbeat must not arm it
# Held to arm, cancel or write the stacks file, so that the heartbeat never arms the timer after
# `disarm_for_fork` or `stop()` (whose thread may let it run before the fork or the close).
_arming = threading.Lock()
_threshold = 1.0
# The timer's timeout outlasts several heartbeat periods: a beat late by scheduling alone must not
# let it fire while Python code runs.
TIMER_MIN_SECONDS = 5 * BEAT_SECONDS
_watchdog: Any = None  # the watchdog's subprocess.Popen, to notice that it died
_stopping = threading.Lock()  # stop() against the heartbeat task making the file again
# Starts a heartbeat file and watchdog for a fork child that lives on (`_watch_this_child`)
_start_for_child: Callable[[], tuple[HeartbeatArea, Any] | None] | None = None
_child_tried = 0  # the pid of the last process that called it
COMPONENT, SETTING = "watchdog", "STALLWATCH_WATCHDOG"


def start(
    area: HeartbeatArea,
    lag_histogram: Any,
    threshold: float,
    stacks: bool,
    watchdog: Any = None,
    start_for_child: Callable[[], tuple[HeartbeatArea, Any] | None] | None = None,
) -> None:
    """Begin the interpreter heartbeat (a task on stallwatch's worker thread) and watch event loops as they start.

    With `stacks`, each interpreter heartbeat re-arms `faulthandler.dump_traceback_later` (the
    threshold, at least `TIMER_MIN_SECONDS`): a C timer that writes every thread's stack when the GIL
    has been held that long. A loop blocked past the threshold gets its stacks from the heartbeat.
    `watchdog` (its `subprocess.Popen`) is checked on every beat: its death is reported once.
    `start_for_child` makes a heartbeat file and starts a watchdog for the calling process: it is
    called when a fork child that lives on starts an event loop (gunicorn-style workers).
    """
    global AREA, _lag_histogram, _stacks_file, _threshold, _watchdog, _start_for_child, _span_writer
    global _child_handler_registered
    AREA = area
    _lag_histogram = lag_histogram
    _threshold = threshold
    _watchdog = watchdog
    _start_for_child = start_for_child
    from ..forksafe import guard  # footprint: host side only (the guard loads wrapt)

    if guard.installed():
        guard.listen(guard.ForkListener(disarm_for_fork, rearm_after_fork, forked_child, _spawn_notes))
    if stacks:
        _stacks_file = open(stacks_path(area.path), "w", opener=opener)  # noqa: SIM115 - lives as long as the heartbeats
        if not guard.installed():  # STALLWATCH_FORK_GUARD=false: no guard handler to call them
            os.register_at_fork(before=disarm_for_fork, after_in_parent=rearm_after_fork)
    if not guard.installed() and not _child_handler_registered:  # as above, for `forked_child`
        os.register_at_fork(after_in_child=forked_child)
        _child_handler_registered = True
    ensure_beating()
    _watch_loops()
    _span_writer = area
    track_current_span()


def _spawn_notes() -> HeartbeatArea | None:
    """Where the fork guard notes a uvloop spawn for the watchdog: this process's heartbeat file."""
    return AREA


def ensure_beating() -> None:
    """Run the interpreter heartbeat on stallwatch's worker (`background`) in this process, if it
    does not yet (fork-aware)."""
    global _beating
    if AREA is None or (_beating is not None and _beating.pid == os.getpid()):
        return
    _beating = background.every(BEAT_SECONDS, _InterpreterBeats(AREA).beat)


class _InterpreterBeats:
    """The interpreter heartbeat of one heartbeat file: a task every `BEAT_SECONDS` that also asks
    each running loop for its beat, keeps the watchdog's copy of the Sentry options current and
    checks that the watchdog and the file are still there."""

    def __init__(self, area: HeartbeatArea) -> None:
        self.area = area
        self.handed: dict[str, Any] | None = None

    def beat(self) -> None:
        area = self.area
        if AREA is not area:  # stopped, or a fork child's own file replaced it
            return
        area.beat_interpreter()
        _send_loop_beats()
        try:  # the task failing on every beat would stop the heartbeat: the watchdog would report a freeze
            if area.writable:
                _arm_timer()
                _dump_blocked_loops()
                self.handed = _hand_over_sentry(area, self.handed)
                _check_watchdog(area)
        except Exception:
            from ..core.faults import FAULTS  # footprint: host side only (loads wrapt and the SDK)

            FAULTS.record(COMPONENT, SETTING)


def _check_watchdog(area: HeartbeatArea) -> None:
    """Report (component `watchdog`, once per episode) a watchdog that died and a heartbeat file
    that vanished under the running host (a /dev/shm cleaner, systemd's RemoveIPC); the file is
    made again, so that the watchdog sees the heartbeats again."""
    process = _watchdog
    if process is not None and process.poll() is not None:
        _lost_watchdog(area, process)
    try:
        inode: int | None = os.stat(area.path).st_ino
    except OSError:
        inode = None
    if inode != area.inode:
        _lost_file(area, inode)


def _lost_watchdog(area: HeartbeatArea, process: Any) -> None:
    global _watchdog
    with _stopping:
        if AREA is not area:  # stop() came first: the shutdown ended the watchdog
            return
        _watchdog = None
    from ..core.faults import FAULTS, signal_name  # footprint: host side only (loads wrapt and the SDK)

    code = process.returncode
    how = f"was killed by {signal_name(-code)}" if code < 0 else f"exited with status {code}"
    FAULTS.record(COMPONENT, SETTING, f"the freeze watchdog (pid {process.pid}) {how}; freezes go unreported")


def _lost_file(area: HeartbeatArea, inode: int | None) -> None:
    with _stopping:
        if AREA is not area:  # stop() removed it
            return
        try:
            area.recreate()
            problem = f"the heartbeat file {area.path} was removed under the host; it was made again"
        except OSError as error:
            area.inode = inode  # reported once, not on every beat
            problem = (
                f"the heartbeat file {area.path} was removed and cannot be made again ({error}); freezes go unreported"
            )
    from ..core.faults import FAULTS  # footprint: host side only (loads wrapt and the SDK)

    FAULTS.record(COMPONENT, SETTING, problem)


def _hand_over_sentry(area: HeartbeatArea, handed: dict[str, Any] | None) -> dict[str, Any] | None:
    """Keep the watchdog's copy of the host's Sentry options (`sentry_path`) current: written when
    they change, removed when freezes are not to be sent, never after `stop()`. Returns the options
    now handed over. Looks only once the host has imported sentry_sdk."""
    if "sentry_sdk" not in sys.modules:
        return handed
    try:
        # optional: sentry-sdk, once the host has imported it
        from .. import sentry

        current = sentry.handover()
    except Exception:  # an odd sentry-sdk version: freezes still reach OpenTelemetry
        # footprint: host side only (loads wrapt and the SDK)
        from ..core.faults import FAULTS, SENTRY_COMPONENT, SENTRY_OFF, SENTRY_SETTING

        FAULTS.record(SENTRY_COMPONENT, SENTRY_SETTING, off=SENTRY_OFF)
        return handed
    if current == handed:
        return handed
    path = sentry_path(area.path)
    with _stopping:
        if AREA is not area:  # stop() removed the files: this one would stay behind
            return handed
        if current is None:
            path.unlink(missing_ok=True)
        else:
            written = path.with_suffix(".sentry-new")  # then renamed: the watchdog never reads half of it
            with open(written, "w", opener=opener) as file:
                json.dump(current, file, default=str)
            os.replace(written, path)
    return current


def stop() -> None:
    """Stop writing heartbeats and remove the files (at shutdown). In a fork child that lives on
    (and exits through `atexit`), the files are its parent's: they stay."""
    global AREA, _stacks_file, _armed_by, _span_writer, _beating
    with _stopping:
        area, AREA = AREA, None
    _span_writer = None
    untrack_current_span()
    if _beating is not None:
        background.cancel(_beating)
        _beating = None
    if _stacks_file is not None:
        with _arming:
            if _armed_by == os.getpid():
                faulthandler.cancel_dump_traceback_later()
                _armed_by = 0
            _stacks_file.close()
            _stacks_file = None
    if area is not None and area.writable:
        area.close()
        remove_files(area.path)


def _watch_loops() -> None:
    import wrapt

    wrapt.wrap_function_wrapper("asyncio.base_events", "BaseEventLoop.run_forever", _run_forever)
    wrapt.register_post_import_hook(
        lambda module: wrapt.wrap_function_wrapper(module, "Loop.run_forever", _run_forever), "uvloop"
    )


_child_handler_registered = False


def track_current_span() -> None:
    """From now on, write the span current on the main thread into the heartbeat whenever a
    context is attached or detached there, and zeros at each loop heartbeat (between callbacks no
    span is current, and a task that resumes inside a span attaches nothing: unknown, not stale).

    `opentelemetry.context.attach`/`detach` are noted through `sdk_compat.note_context_changes`, a
    fast path; with `STALLWATCH_FAST_PATHS=false`, the spans of stallwatch's tracer provider are
    noted as they start and end instead (`current_span_processor`). `untrack_current_span()` stops it."""
    from opentelemetry.trace import get_current_span  # footprint: host side only

    from .. import sdk_compat  # footprint: host side only (the watchdog imports this module too)

    get_ident = threading.get_ident

    def noted(context: Any) -> None:
        if _span_writer is not None and get_ident() == _MAIN_THREAD:
            _write_current_span(get_current_span(context))

    sdk_compat.note_context_changes(noted)


def current_span_processor() -> Any:
    """A span processor (public SDK API) that writes a span starting on the main thread into the
    heartbeat as its current span, and when that span ends (in any thread) its parent: the current
    span as `start_as_current_span` and `use_span` nest them, for the fast paths off, where
    `attach`/`detach` are not noted. A span started there without being made current (an executor
    item's, ended by its worker) is taken as current until it ends."""
    from opentelemetry.sdk.trace import SpanProcessor  # footprint: host side only
    from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan  # footprint: host side only

    get_ident = threading.get_ident

    class CurrentSpanNoter(SpanProcessor):
        noted = 0  # the span id last written

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            if _span_writer is not None and get_ident() == _MAIN_THREAD:
                _write_current_span(span)
                self.noted = span.get_span_context().span_id

        def on_end(self, span: Any) -> None:
            if _span_writer is not None and self.noted and span.context.span_id == self.noted:
                parent = span.parent or INVALID_SPAN_CONTEXT
                _write_current_span(NonRecordingSpan(parent))
                self.noted = parent.span_id

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True  # nothing held; the base class returns None in older SDKs, which ends a provider's flush

    return CurrentSpanNoter()


def untrack_current_span() -> None:
    """Stop writing the current span into the heartbeat (see `track_current_span`)."""
    from .. import sdk_compat  # footprint: host side only

    sdk_compat.stop_noting_context_changes()


def forked_child() -> None:
    """In every fork child, at once (an after-fork handler): the parent's heartbeat is not this
    process's to write; a child that lives on and runs a loop gets its own (`_watch_this_child`).
    The parent's heartbeat thread may have held `_arming` at the fork: a new one."""
    global _span_writer, _forking, _arming
    _span_writer = None
    _forking, _arming = False, threading.Lock()


def _write_current_span(span: Any) -> None:
    area = _span_writer
    if area is None:  # stopped meanwhile
        return
    try:
        ids = span.get_span_context()
        trace_id = ids.trace_id
        SPAN_IDS.pack_into(area._map, OFFSET_CURRENT, trace_id >> 64, trace_id & _LOW_64, ids.span_id)
    except ValueError:  # closed by stop() meanwhile
        pass
    except Exception:
        from ..core.faults import FAULTS  # footprint: host side only (loads wrapt and the SDK)

        FAULTS.record(COMPONENT, SETTING)


_MAIN_THREAD = threading.main_thread().ident  # the thread whose event loop the watchdog watches
_span_writer: HeartbeatArea | None = None  # the heartbeat this process writes its current span into
_lag_histogram: Any = None


class _LoopBeats:
    """One running event loop's heartbeat: at most one `_beat` callback is waiting on it at a time."""

    __slots__ = ("area", "beaten", "dumped", "kind", "loop", "sent", "waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop, area: HeartbeatArea, kind: str, sent: float,
                 waiting: bool, beaten: float) -> None:  # fmt: skip
        self.loop = loop
        self.area = area
        self.kind = kind
        self.sent = sent  # when the waiting callback was handed to the loop (monotonic)
        self.waiting = waiting
        self.beaten = beaten  # when the loop last beat (monotonic)
        self.dumped = False  # its stacks were written since (`_dump_blocked_loops`)


_loops: dict[int, _LoopBeats] = {}


def _run_forever(wrapped: Any, loop: asyncio.AbstractEventLoop, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    area = AREA
    if area is None or threading.current_thread() is not threading.main_thread():
        return wrapped(*args, **kwargs)
    if not area.writable:  # a fork child that lives on: it serves, so it is watched as a host of its own
        area = _watch_this_child()
        if area is None:
            return wrapped(*args, **kwargs)
    from ..forksafe.loop import loop_kind  # footprint: host side only

    now = time.monotonic()
    beats = _LoopBeats(loop, area, loop_kind(loop), now, waiting=True, beaten=now)
    _loops[id(loop)] = beats
    loop.call_soon(_beat, beats)
    area.track_loop(beats.kind)
    try:
        return wrapped(*args, **kwargs)
    finally:
        area.track_loop(None)
        _loops.pop(id(loop), None)


def disarm_for_fork() -> None:
    """Before a fork that is not exec-bound (the fork guard's handler): cancel faulthandler's timer
    if this process armed it, so that the child can exit (see `_armed_by`); with the timer not armed
    (`STALLWATCH_FAULTHANDLER`) it costs a `getpid()`."""
    global _armed_by, _rearm, _forking
    with _arming:
        _forking = True
        _rearm = _armed_by == os.getpid()
        if _rearm:
            faulthandler.cancel_dump_traceback_later()
            _armed_by = 0


def rearm_after_fork() -> None:
    """After that fork, in the parent: arm the timer again at once, not at the next heartbeat."""
    global _forking, _rearm
    with _arming:
        _forking = False
        if _rearm:
            _rearm = False
            _arm_locked()


def _arm_timer() -> None:
    """From the interpreter heartbeat: re-arm faulthandler's timer (`STALLWATCH_FAULTHANDLER`),
    unless a fork is under way or the timer is a parent's."""
    if _stacks_file is not None:
        with _arming:
            if not _forking:
                _arm_locked()


def _arm_locked() -> None:
    """Arm the timer, replacing the previous one (with `_arming` held)."""
    global _armed_by
    pid = os.getpid()
    if _stacks_file is not None and _armed_by in (0, pid):
        faulthandler.dump_traceback_later(max(_threshold, TIMER_MIN_SECONDS), file=_stacks_file)
        _armed_by = pid


def _dump_blocked_loops() -> None:
    """From the interpreter heartbeat: write the stacks of each loop's thread blocked past the
    threshold into the stacks file, once per block, in faulthandler's format (that thread first).

    Taken under the GIL, so safe whatever the blocked thread runs. The file then holds this dump
    alone: the watchdog reads only the last one."""
    if _stacks_file is None:
        return
    now = time.monotonic()
    for beats in list(_loops.values()):
        if beats.waiting and not beats.dumped and now - beats.beaten >= _threshold:
            beats.dumped = True
            text = format_stacks(now - beats.beaten, _MAIN_THREAD)
            with _arming:
                if _stacks_file is not None:  # stop() closed it meanwhile
                    _stacks_file.seek(0)
                    _stacks_file.truncate()
                    _stacks_file.write(text)
                    _stacks_file.flush()


MAX_FRAMES = 100  # per thread, as faulthandler


def format_stacks(blocked_seconds: float, first: int | None) -> str:
    """Every thread's Python stack but the caller's, as faulthandler dumps them on a timeout,
    thread `first` (by ident) first: a report keeps only the start of a long dump."""
    frames = sys._current_frames()
    me = threading.get_ident()
    whole = int(blocked_seconds * 1_000_000)
    seconds, micros = divmod(whole, 1_000_000)
    clock = f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" + (f".{micros:06d}" if micros else "")
    lines = [f"Timeout ({clock})!"]
    for ident in sorted((i for i in frames if i != me), key=lambda i: i != first):
        lines.append(f"{'Current thread' if ident == first else 'Thread'} 0x{ident:016x} (most recent call first):")
        frame: Any = frames[ident]
        for _ in range(MAX_FRAMES):
            if frame is None:
                break
            code = frame.f_code
            lines.append(f'  File "{code.co_filename}", line {frame.f_lineno or "???"} in {code.co_name}')
            frame = frame.f_back
        else:
            if frame is not None:
                lines.append("  ...")
        lines.append("")
    return "\n".join(lines) + "\n"


def _watch_this_child() -> HeartbeatArea | None:
    """In a fork child that lives on, on its main thread as its first event loop starts: its own
    heartbeat file, watchdog and heartbeat task (once per process; None if that fails).

    Not in an after-fork handler (no process or thread starts there): a child that only execs, or
    never runs a loop, costs nothing. The parent's file and watchdog are left to the parent.
    """
    global AREA, _child_tried, _stacks_file, _watchdog, _MAIN_THREAD, _span_writer
    if _start_for_child is None or _child_tried == os.getpid():
        return None
    _child_tried = os.getpid()
    try:
        started = _start_for_child()
    except Exception:
        from ..core.faults import FAULTS  # footprint: host side only (loads wrapt and the SDK)

        FAULTS.record(COMPONENT, SETTING)
        return None
    if started is None:
        return None
    area, process = started
    _loops.clear()  # the parent's loops, copied by the fork
    if _stacks_file is not None:  # the parent's file: this child's stacks go to its own, if it can arm the timer
        _stacks_file.close()
        _stacks_file = None
        if _armed_by == 0:
            _stacks_file = open(stacks_path(area.path), "w", opener=opener)  # noqa: SIM115 - as in start()
    AREA, _watchdog, _span_writer = area, process, area
    _MAIN_THREAD = threading.get_ident()
    ensure_beating()
    return area


def _send_loop_beats() -> None:
    """From the heartbeat task: ask each running loop for a beat, unless one still waits there.

    A `call_soon_threadsafe` rather than a `call_later` chain on the loop: a loop with a timer in
    its heap pays for it on every iteration (clock reads, and an epoll_wait with a timeout, which
    arms a kernel timer).
    """
    for beats in list(_loops.values()):
        if beats.waiting:
            continue
        beats.sent, beats.waiting = time.monotonic(), True
        try:
            beats.loop.call_soon_threadsafe(_beat, beats)
        except RuntimeError:  # closed between run_forever's end and our look
            _loops.pop(id(beats.loop), None)


def _beat(beats: _LoopBeats) -> None:
    """On the loop: write the loop heartbeat and record how late this callback ran (loop lag)."""
    beats.waiting = False
    if AREA is not beats.area or _loops.get(id(beats.loop)) is not beats:  # stopped, or a later run_forever
        return
    now = time.monotonic()
    beats.beaten, beats.dumped = now, False
    beats.area.beat_loop()
    beats.area.current_span(0, 0)
    if _lag_histogram is not None:
        from ..core.faults import first_record  # footprint: host side only (loads wrapt and the SDK)

        first_record()
        _lag_histogram.record(max(0.0, now - beats.sent), {"stallwatch.loop": beats.kind})
