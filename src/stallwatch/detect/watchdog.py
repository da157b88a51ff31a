"""The freeze watchdog: a second process that sees a frozen host while the freeze lasts (docs/freezes.md).

Started by `setup()` through vfork/posix_spawn as `python -S -c BOOTSTRAP` (`heartbeat.watchdog_command`), which
runs `stallwatch._watchdog` without `site` and the package's `__init__`. While the host beats on time it runs on
one thread and loads only `os`, `select`, `fcntl`, `struct`, `warnings` and `heartbeat_file` beside what the
interpreter loads at start (`time`, `_signal`); a heartbeat late by `PREPARE_NS` imports `freeze_report` and
the telemetry pipeline on a thread. When its reporting is set up, once and never again, is `_Reporter`'s
policy: never in a poll while a heartbeat is late, which a slow set-up would hold, delaying the detection.
Every `POLL_SECONDS` it reads the heartbeats: an interpreter heartbeat older than the threshold is `gil_held`, a
loop heartbeat alone `loop_blocked`, unless a thread of the host waits for a CPU (`waiting_for_cpu`: a starved
host is not frozen). A freeze is reported while it lasts and at the thaw (`freeze_report`). A poll that raises an
`Exception` is logged (the first) and counted (`freeze_report.poll_failed`), and the next poll runs. It leaves when
the host exits or execs another program, and at SIGTERM once the host's shutdown has removed the heartbeat file; it
runs in a session of its own, and its stderr lines start `stallwatch watchdog (host pid N):`.
"""

from __future__ import annotations

import os
import select
import sys
import time
import warnings

from . import heartbeat_file

TYPE_CHECKING = False  # `typing` and what it loads stay out of the idle watchdog
if TYPE_CHECKING:
    import signal as _signal  # for the type checker, which knows `_signal` by this name
    import threading
    from collections.abc import Callable
    from types import ModuleType
    from typing import Any

    from .freeze_report import Freeze, FreezeTelemetry, Reporting
else:
    import _signal  # what `signal` wraps in enums: `enum` would be most of the idle watchdog's modules

POLL_SECONDS = 0.1
STARVED_TURNS_PER_SECOND = 10  # a thread waiting for a CPU gets fewer turns; one waiting for the GIL far more
STARVED_CPU_SHARE = 100  # ...and under 1/100 of the CPU
FRESH_NS = int(3 * heartbeat_file.BEAT_SECONDS * 1e9)  # younger than this: the beating thread runs now
PREPARE_NS = int(1.5 * heartbeat_file.BEAT_SECONDS * 1e9)  # a heartbeat older than this: load the pipeline
OVERDUE_NS = PREPARE_NS  # a heartbeat older than this is overdue: the host's threads are read in /proc
REDIAGNOSE_SECONDS = 2.0
OPTIONS = ("--pid", "--heartbeat", "--threshold", "--journal-dir")
_host_pid = 0  # the host watched, which the watchdog's stderr lines name (`freeze_report.name_the_source`)


def _report() -> ModuleType:
    """`freeze_report`, loaded on first need; the watchdog's stderr lines are named from then on."""
    from . import freeze_report  # footprint: loaded when there is something to report, never while idle

    freeze_report.name_the_source(_host_pid)
    return freeze_report


def _uncaught(kind: type[BaseException], error: BaseException, trace: Any) -> None:
    """`sys.excepthook` until `freeze_report.name_the_source` puts its own: hands the exception to it."""
    _report()
    sys.excepthook(kind, error, trace)


def _show_warning(*args: Any, **kwargs: Any) -> None:
    """`warnings.showwarning` until `freeze_report.name_the_source` captures the warnings: hands it on."""
    _report()
    warnings.showwarning(*args, **kwargs)


class Arguments:
    """The watchdog's command line: `--pid N --heartbeat FILE [--threshold S] [--journal-dir DIR]`."""

    def __init__(self, pid: int, heartbeat: str, threshold: float, journal_dir: str | None) -> None:
        self.pid = pid
        self.heartbeat = heartbeat
        self.threshold = threshold
        self.journal_dir = journal_dir


def _arguments(argv: list[str]) -> Arguments | None:
    """The command line as `setup()` writes it (each option once, its value the next word, a positive
    threshold), or None for any other, which `_parse` hands to `argparse` for its usage and errors."""
    values: dict[str, str] = {}
    words = iter(argv)
    for option in words:
        value = next(words, None)
        if option not in OPTIONS or option in values or value is None:
            return None
        values[option] = value
    try:
        pid, threshold = int(values["--pid"]), float(values.get("--threshold", "1.0"))
        heartbeat = values["--heartbeat"]
    except (KeyError, ValueError):
        return None
    return Arguments(pid, heartbeat, threshold, values.get("--journal-dir")) if threshold > 0 else None


def _parse(argv: list[str]) -> Arguments:
    """The watchdog's arguments; `argparse` (loaded then only) reads a command line `setup()` does not
    write, and exits with its usage or error as before."""
    known = _arguments(argv)
    if known is not None:
        return known
    import argparse  # footprint: only for a command line that setup() does not write

    parser = argparse.ArgumentParser(prog="stallwatch watchdog", description=__doc__.splitlines()[0])
    parser.add_argument("--pid", type=int, required=True, help="the host process to watch")
    parser.add_argument("--heartbeat", required=True, help="the host's heartbeat file")
    parser.add_argument("--threshold", type=float, default=1.0, help="seconds without a heartbeat = frozen")
    parser.add_argument("--journal-dir", help="the host's journal directory (STALLWATCH_JOURNAL_DIR)")
    args = parser.parse_args(argv)
    if args.threshold <= 0:
        parser.error("--threshold must be positive (STALLWATCH_FREEZE_THRESHOLD)")
    return Arguments(args.pid, args.heartbeat, args.threshold, args.journal_dir)


class _Reporter:
    """What reports the freezes (`freeze_report.Reporting`), under the watchdog's one set-up policy. Its imports
    run on a thread of their own from the first late heartbeat (`late`); its set-up on the main thread (where
    `setup()` installs its SIGTERM flush), between two polls while the host beats on time (`on_time`), at a
    freeze's detection (`now`), or at the start with a Prometheus exporter, to serve scrapes; never in a poll
    while a heartbeat is late, which a slow set-up would hold. It runs once, and is never retried: what fails
    there (settings, installation) does not change while the watchdog lives, and `Reporting.set_up` contains
    each part's failure and reports the freezes with the parts that work."""

    def __init__(
        self, args: Arguments, setup: Callable[..., Any], shutdown: Callable[[], object], prepare: Callable[[], None]
    ) -> None:
        self._args = args
        self._parts = (setup, shutdown, prepare)
        self.reporting: Reporting | None = None  # made with its module, on the thread that first needs it
        self._preparing: threading.Thread | None = None
        self.telemetry: FreezeTelemetry | None = None  # set up: once, whatever of it failed

    def _reporting(self) -> Reporting:
        if self.reporting is None:
            self.reporting = _report().Reporting(self._args, *self._parts)
        return self.reporting

    def _prepare(self) -> None:
        self._reporting().prepare()

    def late(self) -> None:
        """A heartbeat is late: a freeze may be coming, so load what the set-up needs, on a thread."""
        if self._preparing is None:
            import threading  # footprint: the idle watchdog runs on its main thread alone

            self._preparing = threading.Thread(target=self._prepare, name="stallwatch-prepare", daemon=True)
            self._preparing.start()

    def on_time(self) -> None:
        """The host beats on time: set up now if the imports a late heartbeat began are done."""
        if self.telemetry is None and self._preparing is not None and not self._preparing.is_alive():
            self._set_up()

    def now(self) -> FreezeTelemetry:
        """The freeze telemetry, set up now (once the imports begun are done) if it is not yet."""
        if self.telemetry is None:
            if self._preparing is not None:
                self._preparing.join()  # `Reporting` is made by one thread at a time
            self._set_up()
        assert self.telemetry is not None
        return self.telemetry

    def _set_up(self) -> None:
        reporting = self._reporting()
        self.telemetry = reporting.telemetry  # before the set-up: one that raised all the same is not run again
        reporting.set_up()


def waiting_for_cpu(before: dict[str, tuple[bytes, int, int]], now: dict[str, tuple[bytes, int, int]],
                    interval_ns: int) -> bool:  # fmt: skip
    """Whether a thread of the host waits for a CPU: `now` runnable, and since `before` (`host_threads` of the
    previous poll, `interval_ns` ago) it has had turns on a CPU at under `STARVED_TURNS_PER_SECOND` and CPU
    time under 1/`STARVED_CPU_SHARE` of the interval (or was not there).

    A late heartbeat is a freeze only if no thread of the host waits for a CPU. A GIL-blocked thread sleeps
    on a futex and wakes every switch interval (`sys.getswitchinterval()`) to ask for the GIL again, so it
    keeps getting turns; a thread blocked in a syscall sleeps; one running code gets CPU time. One waiting
    for a CPU is the heartbeat's own thread, or one the GIL was handed to, or that holds it, preempted (a
    thread that drops the GIL on request waits, asleep, until another has taken it): the host is starved
    of CPU (hogs at a higher weight, a CPU quota), not frozen.
    """
    turns = max(1, interval_ns * STARVED_TURNS_PER_SECOND // 1_000_000_000)
    for tid, (state, cpu_ns, turns_now) in now.items():
        then = before.get(tid)
        if state == b"R" and (
            then is None or (turns_now - then[2] <= turns and (cpu_ns - then[1]) * STARVED_CPU_SHARE < interval_ns)
        ):
            return True
    return False


def host_threads(pid: int) -> dict[str, tuple[bytes, int, int]]:
    """Each thread of `pid` by id: its state (`/proc/PID/task/TID/stat`), CPU time in ns and turns on a CPU
    (`schedstat`'s first and third fields; its second, the run-queue wait, counts a wait only once it is over).
    A thread gone meanwhile, or unreadable, is left out."""
    threads = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            stat, schedstat = (_read_proc(f"/proc/{pid}/task/{tid}/{name}") for name in ("stat", "schedstat"))
            cpu_ns, _, turns = schedstat.split()
            threads[tid] = (stat.rsplit(b")", 1)[1].split()[0], int(cpu_ns), int(turns))
        except (OSError, ValueError, IndexError):
            continue
    return threads


def _read_proc(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


class Watchdog:
    """Watches one host process; `run()` returns when the host is gone."""

    def __init__(
        self,
        pid: int,
        heartbeat_path: str,
        threshold: float,
        reporter: _Reporter,
    ) -> None:
        """`reporter` is told at each poll whether a heartbeat is late by `PREPARE_NS` (or the threshold, if
        shorter), and asked for the freeze telemetry at a freeze."""
        self.pid = pid
        self.heartbeat_path = heartbeat_path
        self.threshold_ns = int(threshold * 1e9)
        self._reporter = reporter
        self.freeze: Freeze | None = None
        self._threads: tuple[int, dict[str, tuple[bytes, int, int]]] = (0, {})  # at the last overdue poll
        self._first_beat_ns: int | None = None  # the interpreter heartbeat first read, until the host beats
        self._beating = False  # the host has begun to beat: its set-up is over
        self.host_left = False  # the host exec'd another program: nothing of stallwatch's is left to watch
        self._stopping = False  # a SIGTERM came while a freeze was being reported
        self.failed_polls = 0  # polls that raised (`freeze_report.poll_failed`)
        _signal.signal(_signal.SIGTERM, self._on_sigterm)  # before any setup(): this one, not its flush-and-die

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        """The host's shutdown removes its heartbeat file, then sends SIGTERM and does not wait: leave
        through `main`'s cleanup (which flushes a pipeline set up), at once or, during a freeze, once
        its report is made. A SIGTERM while the file is still there went to every process of the
        host's cgroup (systemd stopping a unit): keep watching, and leave when the host has gone."""
        if os.path.exists(self.heartbeat_path):
            return
        if self.freeze is None:
            raise SystemExit(0)
        self._stopping = True

    def run(self) -> None:
        pidfd = os.pidfd_open(self.pid)
        try:
            while not self.host_left and not self._stopping and not select.select([pidfd], [], [], POLL_SECONDS)[0]:
                try:
                    self.check()
                except Exception:  # a bug, or a race with the host no check rules out: the next poll runs
                    self.failed_polls += 1
                    _report().poll_failed(self.pid, self.failed_polls == 1, self._reporter.telemetry is not None)
        finally:
            os.close(pidfd)
        if self._stopping:  # the freeze is reported: now leave as the SIGTERM asked
            raise SystemExit(0)
        if self.host_left:
            _report().log.info("stallwatch: host %d exec'd another program; its freeze watchdog leaves", self.pid)
        if self.freeze is not None:
            self.freeze.host_exit = _report().host_exit_status(self.pid)
            self.thaw(outcome="host_killed")

    def check(self) -> None:
        now = time.monotonic_ns()  # before the read: a watchdog that waits for a CPU after it never ages a beat
        snapshot = heartbeat_file.read(self.heartbeat_path)
        if snapshot is None:
            return
        if not self._beating:  # the file is made before the host's set-up, the heartbeats start after it
            if self._first_beat_ns is None:
                self._first_beat_ns = snapshot["interpreter_ns"]
            if snapshot["interpreter_ns"] == self._first_beat_ns:
                self.host_left = not heartbeat_file.in_use(self.heartbeat_path)  # exec'd before its first beat
                return
            self._beating = True
        if snapshot["watchdog_pid"] != os.getpid():  # it judges the heartbeats from now on, or the file is new
            heartbeat_file.mark_watched(self.heartbeat_path)
        interpreter_age = now - snapshot["interpreter_ns"]
        loop_age = now - snapshot["loop_ns"] if snapshot["loop_tracked"] else 0
        if max(interpreter_age, loop_age) > min(PREPARE_NS, self.threshold_ns):
            self._reporter.late()  # a freeze may be coming: be ready to report it at the threshold
        else:
            self._reporter.on_time()
        starved = False  # a thread of the host waits for a CPU: looked at from a heartbeat's first overdue poll on
        if max(interpreter_age, loop_age) > OVERDUE_NS:
            (then, before), threads = self._threads, host_threads(self.pid)
            starved = waiting_for_cpu(before, threads, now - then)
            self._threads = (now, threads)
        else:
            self._threads = (0, {})
        kind = None
        if interpreter_age > self.threshold_ns:
            if starved or self._beat_since(snapshot, "interpreter_ns"):
                return  # judged once the host has had the CPU (a freeze stays as it is until then)
            kind = "gil_held"
        elif loop_age > self.threshold_ns:
            # Only a *fresh* interpreter heartbeat proves other Python threads still run; one that
            # is merely under the threshold may be going stale too (GIL held): decide next poll.
            if interpreter_age > FRESH_NS or starved or self._beat_since(snapshot, "loop_ns"):
                return
            kind = "loop_blocked"
        if kind is None:
            if self.freeze is not None:
                self.thaw(outcome="thawed")
            return
        if self.freeze is not None and self.freeze.kind != kind and kind == "gil_held":
            self.freeze.kind = kind  # a blocked loop that turned into a held GIL
            self.freeze.diagnosed_at = 0.0  # report the new kind at once
        if not heartbeat_file.in_use(self.heartbeat_path):  # stale because nobody writes it any more
            self.host_left = True
            self.thaw(outcome="thawed")
            return
        if self.freeze is None:
            last = snapshot["interpreter_ns"] if kind == "gil_held" else snapshot["loop_ns"]
            wall = time.time_ns() - (now - last)
            report = _report()
            freeze = report.Freeze(kind, last, wall, report.Diagnosis(), snapshot)
            freeze.rediagnose(self.pid)  # before it is taken as reported: one that raises is detected next poll
            report.read_stacks(freeze, self.heartbeat_path)  # before the set-up, which the host's exit may outlast
            self.freeze = freeze
            self._reporter.now().frozen(freeze, now)
        elif time.monotonic() - self.freeze.diagnosed_at >= REDIAGNOSE_SECONDS or (
            self.freeze.diagnosis.cause != "child_core_dump" and _report().core_dumping_child(self.pid)
        ):  # a core dump that began after the last look is reported now: it may be over before the next
            self.freeze.rediagnose(self.pid)
            _report().read_stacks(self.freeze, self.heartbeat_path)  # a held GIL after a blocked loop dumps anew
            self._reporter.now().still_frozen(self.freeze, now)

    def _beat_since(self, snapshot: dict[str, Any], field: str) -> bool:
        """Whether the heartbeat `field` has beaten since `snapshot`: /proc is read after it, and the
        threads of a host that beat in between are not those of a late one."""
        again = heartbeat_file.read(self.heartbeat_path)
        return again is not None and again[field] != snapshot[field]

    def thaw(self, outcome: str) -> None:
        freeze, self.freeze = self.freeze, None
        if freeze is not None:
            self._reporter.now().thawed(freeze, outcome)


def main(
    setup: Callable[..., Any],
    shutdown: Callable[[], object],
    prepare: Callable[[], None],
    argv: list[str] | None = None,
) -> int:
    """Run the watchdog process (`stallwatch._watchdog`, started by `heartbeat.watchdog_command`). `setup` and
    `shutdown` build and stop its own telemetry pipeline, `prepare` imports what `setup` needs; all three
    are handed down by the caller and run only when the pipeline is needed (`_Reporter`)."""
    global _host_pid
    args = _parse(sys.argv[1:] if argv is None else argv)
    _host_pid = args.pid
    sys.excepthook = _uncaught
    warnings.showwarning = _show_warning
    os.environ["STALLWATCH_WATCHDOG"] = "false"  # the watchdog never watches itself
    for part in ("EXECUTOR", "SUBPROCESS", "SSH", "NEBIUS"):  # it runs none of these
        os.environ[f"STALLWATCH_INSTRUMENT_{part}"] = "false"
    reporter = _Reporter(args, setup, shutdown, prepare)
    try:
        if "prometheus" in os.environ.get("OTEL_METRICS_EXPORTER", "").split(","):
            reporter.now()
        Watchdog(args.pid, args.heartbeat, args.threshold, reporter).run()
        if reporter.reporting is not None and reporter.telemetry is not None and reporter.telemetry.host_died_frozen:
            _report().serve_last_word(reporter.reporting.session, args.pid)
    except ProcessLookupError:
        pass
    finally:
        if reporter.reporting is not None:
            reporter.reporting.close()
    heartbeat_file.remove_files(args.heartbeat)  # the host is gone: a killed host could not remove them
    return 0
