"""`stallwatch doctor`: what would happen in this process's fork children, measured in a real one.

The report lists versions, the event loop uvicorn would pick, gRPC state, and every at-fork
handler registered after `import stallwatch` with the threads it starts when run in a real fork
child (a throw-away child runs them one at a time, counts thread starts and OS tasks, reports
over a pipe and `_exit`s). Handlers registered earlier cannot be told apart, so the threads they
start are one unattributed figure. It also says whether the host's journal directory is usable.

`Sandbox` is what lets the `stallwatch doctor` command run `setup()` on a machine where hosts run:
the doctor's own journal, telemetry files and heartbeat file go to a temporary directory, so
nothing of the hosts' is replayed, archived, swept or written.
"""

from __future__ import annotations

import json
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from . import forksafe, session
from .config import Settings
from .forksafe import grpc_guard, guard, uvloop_spawn
from .forksafe.loop import loop_report, package_version

_PROBE_TIMEOUT = 10.0
_JOURNAL_SETTINGS = (("journal", "STALLWATCH_JOURNAL"), ("journal_dir", "STALLWATCH_JOURNAL_DIR"))


@dataclass
class HandlerProbe:
    """Threads one after_in_child handler started in a real fork child."""

    name: str
    thread_starts: int
    threads: list[str] = field(default_factory=list)
    os_tasks_added: int = 0
    error: str | None = None


@dataclass
class Report:
    """Structured result of `doctor()`; `ok` is False while a fork hazard remains."""

    versions: dict[str, str | None]
    loop: dict[str, str | None]
    grpc: dict[str, Any]
    fork_guard: dict[str, Any]
    handlers: list[HandlerProbe]
    unattributed_thread_starts: int
    unattributed_threads: list[str]
    sentry: dict[str, Any]
    watchdog: dict[str, Any]
    journal: dict[str, Any]
    nebius: str
    hazards: list[str]
    advice: list[str]

    @property
    def ok(self) -> bool:
        return not self.hazards

    @property
    def verdict(self) -> str:
        if self.hazards:
            return f"FORK HAZARD ({len(self.hazards)}): " + self.hazards[0]
        return "OK: no thread starts in fork children; exec-bound children skip at-fork handlers."

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["ok"] = self.ok
        data["verdict"] = self.verdict
        return data

    def format_text(self) -> str:
        lines = ["stallwatch doctor", ""]
        lines += [f"  {k:<22} {v or '-'}" for k, v in self.versions.items()]
        lines += [
            f"  {'event loop':<22} running: {self.loop['running']}; uvicorn loop=auto picks: "
            f"{self.loop['uvicorn_auto_picks'] or '-'}",
            f"  {'gRPC':<22} loaded: {self.grpc['loaded']}; threads: {self.grpc['threads'] or 'none'}; "
            + ", ".join(f"{k}={v}" for k, v in self.grpc["env"].items()),
            f"  {'fork guard':<22} {'on' if self.fork_guard['enabled'] else 'OFF'}; patched: "
            f"{len(self.fork_guard['patched'])} SDK methods",
            f"  {'sentry-sdk':<22} {self.sentry['version'] or 'not installed'}"
            + (f" ({self.sentry['fork_safety']})" if self.sentry["version"] else ""),
            f"  {'freeze watchdog':<22} "
            + (
                "off (setup() not run, or STALLWATCH_WATCHDOG=false)"
                if self.watchdog["pid"] is None
                else f"pid {self.watchdog['pid']}, {'running' if self.watchdog['alive'] else 'NOT RUNNING'}"
            ),
            f"  {'journal':<22} " + _journal_text(self.journal),
            f"  {'nebius calls':<22} {self.nebius}",
            "",
            "  at-fork handlers registered after import stallwatch (threads started in a real fork child):",
        ]
        if not self.handlers:
            lines.append("    (none)")
        for probe in self.handlers:
            extra = f" {probe.threads}" if probe.threads else ""
            error = f" error: {probe.error}" if probe.error else ""
            lines.append(f"    {probe.thread_starts} thread(s)  {probe.name}{extra}{error}")
        lines.append(
            f"  registered before import (unattributed): {self.unattributed_thread_starts} thread start(s)"
            + (f" {self.unattributed_threads}" if self.unattributed_threads else "")
        )
        lines.append("")
        lines += [f"  hazard: {h}" for h in self.hazards]
        lines += [f"  advice: {a}" for a in self.advice]
        lines += ["", self.verdict]
        return "\n".join(lines)


def doctor(probe: bool = True, journal: dict[str, Any] | None = None) -> Report:
    """Report the fork hazards left in this process; `probe=False` skips the test fork.

    `journal` is a `check_journal()` result made beforehand (the command's, made for the host's
    settings rather than its sandbox's); by default the journal directory checked is this process's.
    """
    fork_safety = forksafe.INSTALLED
    assert fork_safety is not None  # installed by `import stallwatch`, which importing this module ran
    hazards: list[str] = []
    advice: list[str] = []
    versions = {
        "python": platform.python_version(),
        "opentelemetry-sdk": package_version("opentelemetry-sdk"),
        "grpcio": package_version("grpcio"),
        "uvloop": package_version("uvloop"),
        "stallwatch": package_version("stallwatch"),
    }
    loops = loop_report()
    versions["libuv"] = loops.libuv_version
    versions["uvicorn"] = loops.uvicorn_version

    grpc_env = {k: v for k, v in os.environ.items() if k.startswith("GRPC_")}
    grpc_info: dict[str, Any] = {
        "loaded": "grpc" in sys.modules,
        "threads": sorted(set(grpc_guard.grpc_threads())),
        "env": grpc_env,
    }
    if fork_safety.grpc.hazard:
        hazards.append(fork_safety.grpc.hazard)

    if not fork_safety.guard_enabled:
        hazards.append("the fork guard is off (STALLWATCH_FORK_GUARD=false); unset it")
    if fork_safety.preexisting:
        built = ", ".join(f"{n} {cls}" for cls, n in sorted(fork_safety.preexisting.items()))
        hazards.append(
            f"OpenTelemetry objects built before `import stallwatch` ({built}) still start threads in "
            f"fork children; {_import_first_fix()}"
        )

    handlers: list[HandlerProbe] = []
    unattributed_starts, unattributed = 0, []
    if probe and guard.installed():
        result = probe_fork_handlers()
        handlers = [HandlerProbe(**h) for h in result["handlers"]]
        unattributed_starts = result["unattributed_thread_starts"]
        unattributed = result["unattributed_threads"]
        for h in handlers:
            if h.thread_starts or h.os_tasks_added or h.error:
                hazards.append(f"after-fork handler {h.name} started {h.thread_starts} thread(s) in a fork child")
        if unattributed_starts or unattributed:
            hazards.append(
                f"handlers registered before `import stallwatch` started {unattributed_starts} Python "
                f"thread(s) and left OS threads {unattributed} in a fork child; {_import_first_fix()}"
            )

    if loops.uvicorn_auto_picks == "uvloop" or loops.running == "uvloop":
        fix = _uvloop_fix()
        if fix is not None:
            advice.append(f"uvloop forks for every subprocess and holds the GIL until exec; {fix}")
    sentry = _sentry_report()
    if sentry["version"] and not sentry["safe"]:
        advice.append(f"upgrade sentry-sdk to 2.59 or newer: {sentry['fork_safety']}")
    watchdog = _watchdog_report()
    if watchdog["pid"] is not None and not watchdog["alive"]:
        advice.append(
            f"the freeze watchdog (pid {watchdog['pid']}) is not running (exit status {watchdog['exit_status']}): "
            "freezes go unseen until setup() runs in a new process; check its stderr, or set STALLWATCH_WATCHDOG=false"
        )
    journal = check_journal() if journal is None else journal
    if journal["problem"]:
        advice.append(
            f"{journal['problem']}: the journal cannot be kept, so what a killed process left in flight is lost; "
            "set STALLWATCH_JOURNAL_DIR to a directory the host can write, or STALLWATCH_JOURNAL=false"
        )

    # footprint: the Nebius instrumentation loads when the report runs
    from .instrument import nebius

    nebius_status = nebius.status()
    if nebius_status.startswith("UNSUPPORTED"):
        advice.append(
            f"{nebius_status}: Nebius calls are not traced; pin nebius to 0.6.13-0.6.29, "
            "or set STALLWATCH_INSTRUMENT_NEBIUS=false"
        )
    return Report(
        versions=versions,
        loop={
            "uvloop_version": loops.uvloop_version,
            "libuv_version": loops.libuv_version,
            "uvicorn_version": loops.uvicorn_version,
            "uvicorn_auto_picks": loops.uvicorn_auto_picks,
            "running": loops.running,
        },
        grpc=grpc_info,
        fork_guard={
            "enabled": fork_safety.guard_enabled,
            "patched": list(fork_safety.patched),
            "preexisting_objects": fork_safety.preexisting,
            "sdk_loaded_before_stallwatch": fork_safety.sdk_loaded_before,
        },
        handlers=handlers,
        unattributed_thread_starts=unattributed_starts,
        unattributed_threads=unattributed,
        sentry=sentry,
        watchdog=watchdog,
        journal=journal,
        nebius=nebius_status,
        hazards=hazards,
        advice=advice,
    )


def _watchdog_report() -> dict[str, Any]:
    process = _watchdog_process()
    if process is None:
        return {"pid": None, "alive": False, "exit_status": None}
    status = process.poll()
    return {"pid": process.pid, "alive": status is None, "exit_status": status}


def _watchdog_process() -> subprocess.Popen[bytes] | None:
    running = session.current()
    return running._watchdog[1] if running is not None and running._watchdog is not None else None


def _launched_by_its_own_entry_point() -> str | None:
    """The command of a host whose server starts uvicorn itself (its code cannot be edited), if loaded."""
    return "dstack server" if "dstack._internal.server.app" in sys.modules else None


def _uvloop_fix() -> str | None:
    """What makes this host's uvloop spawn without fork, or None when it already does (the default)."""
    command = _launched_by_its_own_entry_point()
    asyncio_loop = 'run uvicorn with loop=stallwatch.uvicorn_loop() ("asyncio") or --loop asyncio'
    if not uvloop_spawn.installed():  # opted out, by the variable or by setup(uvloop_spawn="fork")
        said_fork = os.environ.get(uvloop_spawn.SETTING, "").strip().lower() == "fork"
        opt_out = f"{uvloop_spawn.SETTING}=fork" if said_fork else 'uvloop_spawn="fork" from setup()'
        if command is not None:  # it builds its own uvicorn: only stallwatch's spawn method applies
            return f"remove {opt_out} for `{command}` (the default, vfork, spawns without fork)"
        return f"remove {opt_out} (the default, vfork, spawns without fork), or {asyncio_loop}"
    reason = uvloop_spawn.unsupported_reason({})
    if reason is None:
        return None
    cannot = f"stallwatch's vfork spawn cannot run here ({reason}; see docs/uvloop.md)"
    if command is not None:
        return f"{cannot}, and `{command}` builds its own uvicorn, so no setting avoids it"
    return f"{cannot}; {asyncio_loop}"


def _import_first_fix() -> str:
    command = _launched_by_its_own_entry_point()
    if command is not None:
        return f"start it with `stallwatch run -- {command}`"
    return "import stallwatch (or stallwatch.auto) first, or start the server with `stallwatch run -- COMMAND`"


def check_journal(
    environ: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """Whether the journal could be kept in the host's journal directory; looks, never creates.

    The directory is usable when it is a directory the process can write into, or when it does not
    exist and its nearest existing parent is one (the journal creates it). The settings are those
    of the running session; with `environ` or `overrides`, or without a session, those that
    `STALLWATCH_JOURNAL` and `STALLWATCH_JOURNAL_DIR` in `environ` (default: the environment) and
    the `journal`/`journal_dir` keyword `overrides` make. Returns `enabled`, `directory`, `usable`
    (None while the journal is off) and `problem` (None, or why it is unusable, naming the setting).
    """
    running = session.current()
    if environ is None and overrides is None and running is not None and running.settings is not None:
        settings = running.settings
    else:
        env, given = os.environ if environ is None else environ, overrides or {}
        settings = Settings.load(
            {v: env[v] for _, v in _JOURNAL_SETTINGS if v in env},
            **{k: given[k] for k, _ in _JOURNAL_SETTINGS if k in given},
        )
    names = {name for pair in _JOURNAL_SETTINGS for name in pair}
    problem = next((p for p in settings.problems if p.setting in names), None)
    if problem is not None:  # the settings layer turned the journal off, and says why
        return {"enabled": True, "directory": str(settings.journal_dir), "usable": False, "problem": problem.error}
    if not settings.journal:
        return {"enabled": False, "directory": str(settings.journal_dir), "usable": None, "problem": None}
    return {"enabled": True, "directory": str(settings.journal_dir), "usable": True, "problem": None}


def _journal_text(journal: dict[str, Any]) -> str:
    if not journal["enabled"]:
        return "off (STALLWATCH_JOURNAL=false)"
    if journal["usable"]:
        return f"{journal['directory']} (usable)"
    return f"UNUSABLE: {journal['problem']}"


class Sandbox:
    """`with Sandbox():` every `setup()` in this process writes only to a temporary directory.

    The `setup()` of `stallwatch doctor --setup`, and one that an `--import`ed module runs, keep
    their journal, telemetry files and heartbeat file in the directory and serve Prometheus on free
    ports registered there, even where the code passes those settings to `setup()` as keywords. So the journals of
    the hosts on the machine are neither replayed nor archived, the shared heartbeat directory is
    not swept, no file outside the directory is made or changed, and no host's port is taken.
    On leaving, the session is shut down, its watchdog waited for, the directory removed and the
    environment restored. What the first `setup()` asked for is kept (`host_journal`).
    """

    def __init__(self) -> None:
        self.directory = Path()
        self.requested: dict[str, Any] | None = None  # the replaced keyword overrides of the first setup()
        self._environ: dict[str, str | None] = {}  # the replaced variables' own values
        self._setup = session.setup

    def __enter__(self) -> Sandbox:
        # footprint: the heartbeat loads when the report runs
        from .detect import heartbeat

        self.directory = Path(tempfile.mkdtemp(prefix="stallwatch-doctor-"))
        replaced = {
            ("journal_dir", "STALLWATCH_JOURNAL_DIR"): self.directory / "journal",
            ("file_dir", "STALLWATCH_FILE_DIR"): self.directory / "telemetry",
            ("prometheus_port", "OTEL_EXPORTER_PROMETHEUS_PORT"): 0,
            ("watchdog_prometheus_port", "STALLWATCH_WATCHDOG_PROMETHEUS_PORT"): 0,
            ("prometheus_targets_dir", "STALLWATCH_PROMETHEUS_TARGETS_DIR"): self.directory / "prometheus",
        }
        keywords = {keyword: value for (keyword, _), value in replaced.items()}
        for (_, variable), value in replaced.items():
            self._environ[variable] = os.environ.get(variable)
            os.environ[variable] = str(value)
        heartbeat.use_directory(self.directory)
        original = self._setup

        def sandboxed_setup(fork_safety: Any, **overrides: Any) -> session.Session:
            if self.requested is None:
                self.requested = {k: v for k, v in overrides.items() if k in keywords}
            return original(fork_safety, **{**overrides, **{k: v for k, v in keywords.items() if k in overrides}})

        session.setup = sandboxed_setup
        return self

    def host_journal(self) -> dict[str, Any]:
        """`check_journal()` for the settings the host would run with, not the sandbox's."""
        environ = {k: v for k, v in os.environ.items() if k not in self._environ}
        environ.update({k: v for k, v in self._environ.items() if v is not None})
        return check_journal(environ, self.requested or {})

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        # footprint: the heartbeat loads when the report runs
        from .detect import heartbeat

        try:
            watchdog = _watchdog_process()
            session.shutdown()
            if watchdog is not None:  # shutdown() only signals it: wait, so that it writes nothing after the removal
                try:
                    watchdog.wait(timeout=_PROBE_TIMEOUT)
                except subprocess.TimeoutExpired:
                    watchdog.kill()
                    watchdog.wait()
        finally:
            session.setup = self._setup
            heartbeat.use_directory(None)
            for variable, value in self._environ.items():
                if value is None:
                    os.environ.pop(variable, None)
                else:
                    os.environ[variable] = value
            shutil.rmtree(self.directory, ignore_errors=True)


def _sentry_report() -> dict[str, Any]:
    version = package_version("sentry-sdk")
    if version is None:
        return {"version": None, "safe": True, "fork_safety": "not installed"}
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    safe = major_minor >= (2, 59)
    text = (
        "workers start lazily by pid; its fork handlers only reset state"
        if safe
        else "workers start lazily, but an inherited held lock can deadlock a fork child (sentry #6148)"
    )
    return {"version": version, "safe": safe, "fork_safety": text}


# ---- the probe child ----------------------------------------------------------------------------


def probe_fork_handlers(stock: bool = False) -> dict[str, Any]:
    """Fork a throw-away child that runs each guarded after_in_child handler and counts threads.

    With `stock=True` the handlers run as the unpatched SDK would (outside the guard), which is
    what the stock pipeline does in every fork child.
    """
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    starts: list[str] = []
    original_start = threading.Thread.start

    def counting_start(self: threading.Thread) -> None:
        if os.getpid() != parent:
            starts.append(self.name)
        original_start(self)

    threading.Thread.start = counting_start  # type: ignore[method-assign]
    guard.STATE.probe = True
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # "process is multi-threaded"
            pid = os.fork()
    finally:
        if os.getpid() == parent:
            guard.STATE.probe = False
            threading.Thread.start = original_start  # type: ignore[method-assign]
    if pid == 0:
        try:
            os.close(read_fd)
            payload = _measure_in_child(starts, stock)
            os.write(write_fd, json.dumps(payload).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    return _collect(pid, read_fd)


def _other_tasks() -> list[str]:
    """Names of the OS threads of this process other than the calling (main) one."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == threading.get_native_id():
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue
    return names


def _measure_in_child(starts: list[str], stock: bool) -> dict[str, Any]:
    early_starts = list(starts)
    unattributed = _other_tasks()
    guard.STATE.probe = False
    results = []
    for registration in list(guard.REGISTRATIONS):
        handler = registration.after_in_child
        if handler is None:
            continue
        del starts[:]
        tasks_before = len(_other_tasks())
        error = None
        try:
            handler() if stock else guard.run_child_handler(handler)
        except Exception as exc:  # a failing handler is a finding, not a doctor crash
            error = f"{type(exc).__name__}: {exc}"
        results.append(
            {
                "name": registration.description,
                "thread_starts": len(starts),
                "threads": list(starts),
                "os_tasks_added": max(0, len(_other_tasks()) - tasks_before - len(starts)),
                "error": error,
            }
        )
    return {
        "handlers": results,
        "unattributed_thread_starts": len(early_starts),
        "unattributed_threads": unattributed,
    }


def _collect(pid: int, read_fd: int) -> dict[str, Any]:
    chunks = []
    deadline = time.monotonic() + _PROBE_TIMEOUT
    try:
        while (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([read_fd], [], [], remaining)
            if not ready:
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_fd)
    done, _status = os.waitpid(pid, os.WNOHANG)
    if done == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not chunks:
        return {
            "handlers": [
                {
                    "name": "(probe child hung or crashed while running at-fork handlers)",
                    "thread_starts": 0,
                    "threads": [],
                    "os_tasks_added": 0,
                    "error": f"no report within {_PROBE_TIMEOUT:.0f}s",
                }
            ],
            "unattributed_thread_starts": 0,
            "unattributed_threads": [],
        }
    return json.loads(b"".join(chunks))
