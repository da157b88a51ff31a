"""`setup()` and `shutdown()`: one stallwatch session per process."""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import wrapt
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

from . import config, journal, sdk_compat, telemetry
from ._version import __version__
from .config import ConfigError, Problem, Settings
from .core.faults import FAULTS, instrument, meter, on_first_record
from .export.budget import Budget
from .forksafe import ForkSafety, guard, otel_compat, uvloop_spawn

if TYPE_CHECKING:
    from opentelemetry.instrumentation.instrumentor import BaseInstrumentor  # type: ignore[attr-defined]

_log = logging.getLogger("stallwatch")


class Session:
    """The running stallwatch session, returned by `setup()`.

    Attributes:
        settings: the validated settings in force (None when `setup()` ran after `shutdown()`).
        fork_safety: what `import stallwatch` did to make forks safe.
        files: where the `file` exporter writes each signal (`traces`, `metrics`, `logs`).
        error: why telemetry is off, when building the pipeline failed without `strict`.

    Equal to a session with equal fields, unhashable, shown by its fields (as a dataclass would be).
    """

    _FIELDS = ("settings", "fork_safety", "files", "error", "_pipeline", "_watchdog", "_journal")

    def __init__(
        self,
        settings: Settings | None,
        fork_safety: ForkSafety,
        files: dict[str, Path] | None = None,
        error: str | None = None,
        _pipeline: Any = None,
        _watchdog: Any = None,
        _journal: Any = None,
    ) -> None:
        self.settings = settings
        self.fork_safety = fork_safety
        self.files: dict[str, Path] = {} if files is None else files
        self.error = error
        self._pipeline = _pipeline
        self._watchdog = _watchdog  # (HeartbeatArea, subprocess.Popen) while the freeze watchdog runs
        self._journal = _journal  # the crash-safe journal (STALLWATCH_JOURNAL), made at its first use

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Session) or type(other) is not type(self):
            return NotImplemented
        fields = self._FIELDS
        return tuple(getattr(self, name) for name in fields) == tuple(getattr(other, name) for name in fields)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Session({', '.join(f'{name}={getattr(self, name)!r}' for name in self._FIELDS)})"

    @property
    def watchdog_pid(self) -> int | None:
        """Pid of the freeze watchdog process, or None when it is off (STALLWATCH_WATCHDOG)."""
        return self._watchdog[1].pid if self._watchdog is not None else None

    def wait_for_watchdog(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until the freeze watchdog watches this process.

        True once it reads this process's heartbeats from its poll loop: a freeze from then on is
        reported. False when `timeout` passes first, and at once when no watchdog watches this
        process: it is off (STALLWATCH_WATCHDOG) or dead, stallwatch was shut down, or this is a
        forked worker whose first event loop has not started its own watchdog yet. Blocks the
        calling thread (polls every 10 ms): call it off the event loop, or with `timeout=0` to ask.
        """
        # footprint: with the watchdog only
        from .detect import heartbeat

        deadline = time.monotonic() + timeout
        while True:
            watchdog = self._watchdog
            if watchdog is None:
                return False
            area, process = watchdog
            current = heartbeat.AREA
            if current is None or current is not area or not current.writable:
                return False
            if not _running(process):
                return False
            if current.watched_by() == process.pid:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    @property
    def config_problems(self) -> tuple[Problem, ...]:
        """The settings `setup()` refused, each logged once: `setting` (the variable or keyword), `error`
        (its value, secrets redacted, and what it accepts) and `fallback` (what is used instead)."""
        return self.settings.problems if self.settings is not None else ()

    @property
    def prometheus_address(self) -> tuple[str, int] | None:
        """(host, port) of the Prometheus scrape endpoint, when the `prometheus` exporter is on."""
        return self._pipeline.prometheus_address if self._pipeline is not None else None

    def wait_for_scrape(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds until the Prometheus endpoint has answered a scrape that began
        after this call, so it carried every value set before the call. True then; False when the
        time is up first, and at once without the `prometheus` metrics exporter."""
        scrapes = self._pipeline.scrapes if self._pipeline is not None else None
        return scrapes is not None and scrapes.wait(scrapes.mark(), timeout)

    @property
    def telemetry_enabled(self) -> bool:
        """True when stallwatch exports telemetry (its own providers or the host's)."""
        return self.settings is not None and not self.settings.disabled and self.error is None

    def shutdown(self, timeout: float | None = None) -> bool:
        """Same as `stallwatch.shutdown()`."""
        return shutdown(timeout)


def _running(process: subprocess.Popen[bytes]) -> bool:
    """Whether `process` still runs. `Popen.poll()` alone says so too while another thread (the
    heartbeat's check of the watchdog) holds its wait lock, even for a dead or reaped child."""
    if process.poll() is not None:
        return False
    try:
        with open(f"/proc/{process.pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # reaped meanwhile
        return False


_lock = threading.RLock()  # re-entrant: the SIGTERM handler may run in the main thread inside setup()
_session: Session | None = None
_shut_down = False


def current() -> Session | None:
    """The running session, or None before `setup()`."""
    return _session


def setup(fork_safety: ForkSafety, **overrides: Any) -> Session:
    return _setup(fork_safety, overrides, raises=False)


def setup_or_raise(fork_safety: ForkSafety, **overrides: Any) -> Session:
    """`setup()`, but a telemetry pipeline that cannot be built raises, `STALLWATCH_STRICT` or not: for a caller
    that says it on a line of its own (the freeze watchdog, `detect.freeze_report.Reporting`)."""
    return _setup(fork_safety, overrides, raises=True)


def _setup(fork_safety: ForkSafety, overrides: dict[str, Any], raises: bool) -> Session:
    global _session
    with _lock:
        if _session is not None:
            if overrides:
                _log.warning("stallwatch: setup() already ran; ignoring the new settings %s", sorted(overrides))
            return _session
        if _shut_down:
            # OpenTelemetry lets a global provider be set once per process; the old ones are shut down.
            message = "setup() after shutdown() cannot restart telemetry in this process; telemetry is off"
            _log.error("stallwatch: %s.", message)
            return Session(None, fork_safety, error=message)
        _session = _start(fork_safety, overrides, raises)
        return _session


def _start(fork_safety: ForkSafety, overrides: dict[str, Any], raises: bool) -> Session:
    """A bad setting costs only itself (`config`); its line is logged once the pipeline is built, so
    that it is exported as a log record too. `strict` raises `ConfigError` before anything starts;
    `raises`, the pipeline's failure once the settings are reported."""
    settings = Settings.load(**overrides)
    sdk_compat.use_fast_paths(settings.fast_paths)
    # Fork safety, like the guard: applies with telemetry off too. Installed at import, under the guard's
    # and the subprocess instrumentation's uvloop wrappers; this only switches it.
    if settings.uvloop_spawn == "vfork":
        uvloop_spawn.install()
    else:
        uvloop_spawn.disable()
    if settings.disabled:
        config.report(settings.problems)
        return Session(settings, fork_safety)
    settings = config.prepare_directories(settings, overrides)
    settings = _identified(settings)
    config.withhold_from_sdk(settings.problems)  # before the SDK, or the watchdog, reads the environment
    watchdog = _start_watchdog(settings) if settings.watchdog else None  # before any thread of ours
    pipeline = None
    if settings.providers == "stallwatch":
        # footprint: the pipeline loads at setup(), not at import
        from . import pipeline as pipeline_module

        try:
            pipeline = pipeline_module.build(settings)
        except Exception as exc:
            _stop_unused_watchdog(watchdog)
            if settings.strict:
                raise
            config.report(settings.problems)
            if raises:
                raise
            if isinstance(exc, ConfigError):
                _log.error("stallwatch: %s. Telemetry is off; the fork guard stays on.", exc)
            else:
                _log.exception(
                    "stallwatch: building the telemetry pipeline failed (%s: %s). Telemetry is off; the fork "
                    "guard stays on (STALLWATCH_STRICT=true raises instead).",
                    type(exc).__name__,
                    exc,
                )
            return Session(settings, fork_safety, error=str(exc) if isinstance(exc, ConfigError) else repr(exc))
    config.report(settings.problems)
    if settings.providers == "host":
        # footprint: export/ loads at setup(), not at import
        from .export import exit_check

        exit_check.check_host_providers()  # before any instrumentor asks for a tracer
        on_first_record(_warn_when_the_host_exports_nothing)
    _register_instruments()
    _instrument(settings)
    journal = _start_journal(settings) if settings.journal else None
    if watchdog is not None:
        # footprint: with the watchdog only
        from .detect import heartbeat

        heartbeat.start(
            watchdog[0],
            instrument(meter(), telemetry.LOOP_LAG),
            settings.freeze_threshold,
            settings.faulthandler,
            watchdog=watchdog[1],
            start_for_child=(lambda: _watch_fork_child(settings)) if settings.watchdog_forked_workers else None,
        )
    atexit.register(_shutdown_at_exit)
    _keep_the_tail_on_sigterm(settings.shutdown_timeout)
    _flush_when_uvicorn_stops(settings.shutdown_timeout)
    _shut_down_when_multiprocessing_workers_end()
    return Session(settings, fork_safety, dict(pipeline.files) if pipeline else {}, None, pipeline, watchdog, journal)


# Seconds from stallwatch's first record for a host to install its providers: dstack does it in its own
# start-up, after its first spawns were recorded (and dropped).
HOST_PROVIDERS_GRACE = 30.0


class _HostProviders:
    """With STALLWATCH_PROVIDERS=host: whether the host's providers were looked for, and until when."""

    def __init__(self) -> None:
        self.deadline: float | None = None  # set at stallwatch's first record
        self.decided = False


_host_providers = _HostProviders()


def _host_has_no_providers() -> bool:
    from opentelemetry import trace

    proxy_tracer_provider, proxy_meter_provider, _ = sdk_compat.proxy_providers()
    return isinstance(trace.get_tracer_provider(), proxy_tracer_provider) and isinstance(
        metrics.get_meter_provider(), proxy_meter_provider
    )


def _warn_when_the_host_exports_nothing(at_exit: bool = False) -> bool:
    """With STALLWATCH_PROVIDERS=host, from stallwatch's first record on: one line if the host has not
    installed a tracer or a meter provider within `HOST_PROVIDERS_GRACE` seconds (or by its exit, if
    sooner), since everything stallwatch records is then dropped. True once decided."""
    state = _host_providers
    if state.decided or not _host_has_no_providers():
        state.decided = True
        return True
    if state.deadline is None:  # the first record; at exit, none: nothing was dropped
        if not at_exit:
            state.deadline = time.monotonic() + HOST_PROVIDERS_GRACE
        return at_exit
    if not at_exit and time.monotonic() < state.deadline:
        return False
    state.decided = True
    _log.warning(
        "stallwatch: STALLWATCH_PROVIDERS=host, but the host has installed no OpenTelemetry tracer or meter "
        "provider: nothing stallwatch records will be exported. Unset STALLWATCH_PROVIDERS so that stallwatch "
        "installs its own, or turn the host's OpenTelemetry on (dstack: DSTACK_OTEL_TRACES_ENABLED=1 and "
        "DSTACK_OTEL_METRICS_ENABLED=1; or run it under opentelemetry-instrument)."
    )
    return True


def _register_instruments() -> None:
    """Fork metrics, read from plain counters at collection time (never inside a fork), and the
    count of stallwatch's own faults (the journal's and the watchdog's, whatever is instrumented)."""
    meter = metrics.get_meter(telemetry.INSTRUMENTATION_SCOPE, __version__)
    FAULTS.bind()
    # Every kind, gRPC state and loop at 0 until its first fork: Prometheus then sees that fork as an increase.
    no_forks = {
        (kind, grpc_active, loop): 0
        for kind in telemetry.FORK_KIND.values
        for grpc_active in (False, True)
        for loop in telemetry.SPAWN_LOOP.values
    }

    def observe_forks(options: CallbackOptions) -> Iterable[Observation]:
        return [
            Observation(
                count,
                {
                    telemetry.FORK_KIND.name: kind,
                    telemetry.GRPC_ACTIVE.name: grpc_active,
                    telemetry.SPAWN_LOOP.name: loop,
                },
            )
            for (kind, grpc_active, loop), count in (no_forks | dict(guard.fork_counts())).items()
        ]

    def observe(value: Any) -> Any:
        return lambda options: [Observation(value())]

    for metric, callback in (
        (telemetry.FORK_COUNT, observe_forks),
        (telemetry.FORK_HANDLERS_SKIPPED, observe(lambda: guard.STATE.handlers_skipped)),
        (telemetry.FORK_WORKERS_DEFERRED, observe(lambda: guard.STATE.workers_deferred)),
    ):
        meter.create_observable_counter(
            metric.name, callbacks=[callback], unit=metric.unit, description=metric.description
        )


def _start_journal(settings: Settings) -> journal.FirstUse:
    """Replay the journals of dead processes, then journal this one (STALLWATCH_JOURNAL) from its first
    journaled operation on (`journal.FirstUse`)."""
    import functools

    problem = (
        f"cannot use the journal in {settings.journal_dir}; the host goes on without the records it could not "
        "write (STALLWATCH_JOURNAL_DIR chooses another directory)"
    )
    report = functools.partial(FAULTS.record, "journal", "STALLWATCH_JOURNAL", problem)
    if journal.has_segments(settings.journal_dir):
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider

        provider = trace.get_tracer_provider()
        journal.replay(  # it warns of each leak candidate and keeps it in the directory until it is confirmed
            settings.journal_dir,
            tracer_provider=provider if isinstance(provider, TracerProvider) else None,
            on_error=report,
        )
    observer = journal.UnconfirmedObserver(settings.journal_dir, report)
    instrument(meter(), telemetry.CLOUD_RESOURCES_UNCONFIRMED, observer.observe)
    current = journal.FirstUse(settings.journal_dir, report)
    journal.activate(current)
    return current


def _identified(settings: Settings) -> Settings:
    """`settings` with a `service.instance.id`: the one set, else a new UUID (as the OpenTelemetry
    semantic conventions recommend), decided before the watchdog starts so that it carries the same."""
    if telemetry.SERVICE_INSTANCE_ID.name in settings.resource_attributes:
        return settings
    identity = {**settings.resource_attributes, telemetry.SERVICE_INSTANCE_ID.name: str(uuid.uuid4())}
    return dataclasses.replace(settings, resource_attributes=identity)


def _watchdog_environment(settings: Settings, forked: bool) -> dict[str, str]:
    """The host's settings, as the environment the watchdog's own setup() reads (`forked`: for a
    worker forked from the host, whose watchdog cannot take the host's watchdog's port). Without the
    variables the host refused: the watchdog uses their defaults too, and logs no second line."""
    env = dict(os.environ)
    for problem in settings.problems:
        env.pop(problem.setting, None)
    env["STALLWATCH_FILE_DIR"] = str(settings.file_dir)
    for signal_name, chosen in (("TRACES", settings.traces_exporter), ("METRICS", settings.metrics_exporter),
                                ("LOGS", settings.logs_exporter)):  # fmt: skip
        env[f"OTEL_{signal_name}_EXPORTER"] = ",".join(chosen) or "none"
    if "prometheus" in settings.metrics_exporter:
        # Its own scrape endpoint: the host's hangs while the host is frozen.
        env["OTEL_EXPORTER_PROMETHEUS_PORT"] = "0" if forked else str(settings.watchdog_prometheus_port)
        env["STALLWATCH_PROMETHEUS_TARGETS_DIR"] = str(settings.prometheus_targets_dir)
    if settings.otlp_endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = settings.otlp_endpoint
    env["OTEL_EXPORTER_OTLP_PROTOCOL"] = settings.otlp_protocol
    env["STALLWATCH_JOURNAL"] = "false"  # the watchdog writes the host's freeze records itself, and never replays
    env["STALLWATCH_PROVIDERS"] = "stallwatch"  # the host's providers, if any, are in the host's process only
    if settings.service_name:
        env["OTEL_SERVICE_NAME"] = settings.service_name
    if settings.resource_attributes:
        env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(f"{k}={v}" for k, v in settings.resource_attributes.items())
    return env


def _start_watchdog(settings: Settings, forked: bool = False) -> tuple[Any, subprocess.Popen[bytes]] | None:
    """Spawn the freeze watchdog (vfork/posix_spawn: never a fork of the host) and its heartbeat file."""
    # footprint: with the watchdog only
    from .detect import heartbeat

    try:
        swept = 0 if forked else heartbeat.sweep(heartbeat.area_directory())  # a worker: its host swept
        if swept:
            _log.debug("stallwatch: removed the heartbeat files of %d hosts that are gone", swept)
        area = heartbeat.HeartbeatArea()
        command = [*heartbeat.watchdog_command(), "--pid", str(os.getpid()), "--heartbeat", str(area.path),
                   "--threshold", str(settings.freeze_threshold)]  # fmt: skip
        if settings.journal:
            command += ["--journal-dir", str(settings.journal_dir)]
        # stderr is shared so its WARNINGs reach the host's log. A session of its own: Ctrl-C (SIGINT to the
        # terminal's process group) and a supervisor signalling the host's group stop the host, not its
        # watchdog, which leaves when the host has gone and keeps reporting a host too frozen to stop.
        process = subprocess.Popen(
            command, env=_watchdog_environment(settings, forked), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    except OSError as exc:
        _log.warning("stallwatch: cannot start the freeze watchdog (%s); STALLWATCH_WATCHDOG=false silences this.", exc)
        return None
    return area, process


def _watch_fork_child(settings: Settings) -> tuple[Any, subprocess.Popen[bytes]] | None:
    """A heartbeat file and watchdog of its own for a fork child that lives on and runs an event
    loop (`detect.heartbeat` calls this there), and its own Prometheus endpoint; the session's
    shutdown in the child then stops them."""
    spawns = sys.modules.get("stallwatch.instrument.subprocess")  # installed: the host's spawns are recorded
    with spawns.unrecorded() if spawns is not None else contextlib.nullcontext():
        started = _start_watchdog(_as_fork_child(settings), forked=True)
    session = _session
    if started is not None and session is not None:
        session._watchdog = started
    if session is not None and session._pipeline is not None:
        session._pipeline.serve_fork_child()
    return started


def _as_fork_child(settings: Settings) -> Settings:
    """The host's settings with the resource attributes its providers take on in this fork child (a
    `service.instance.id` of its own on SDKs that detect one per process), for its watchdog to carry."""
    refreshed = {key: str(value) for key, value in otel_compat.process_resource().attributes.items()}
    return dataclasses.replace(settings, resource_attributes={**settings.resource_attributes, **refreshed})


def _stop_unused_watchdog(watchdog: tuple[Any, subprocess.Popen[bytes]] | None) -> None:
    """Stop the watchdog of a `setup()` that failed after starting it: no heartbeat would ever come."""
    if watchdog is None:
        return
    area, process = watchdog
    area.close()  # first: a watchdog whose host still has its heartbeat file ignores SIGTERM
    process.terminate()
    try:
        process.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _instrument(settings: Settings) -> None:
    """Install the instrumentations the settings ask for (they report through the global providers);
    one the host turned on already is left as it is. With the fast paths on, through their
    `Installation`s, without loading `BaseInstrumentor` (an instrumentor's
    `is_instrumented_by_opentelemetry` still says so: `sdk_compat.mirror_installation`); off, through
    their instrumentors' `instrument()`."""
    fast = sdk_compat.fast_paths()
    if settings.instrument_subprocess:
        if fast:
            # footprint: loaded only when its instrumentation is on
            from .instrument.subprocess import installation as spawns

            spawns.INSTALLATION.switch_on(settings=settings)
        else:
            # footprint: BaseInstrumentor's module, loaded at setup() only with the fast paths off
            from .instrument.subprocess import SubprocessInstrumentor

            _instrument_once(SubprocessInstrumentor(), settings=settings)
    if settings.instrument_ssh:
        if fast:
            # footprint: loaded only when its instrumentation is on
            from .instrument import tunnels

            tunnels.INSTALLATION.switch_on()  # a host without dstack: nothing to wrap, nothing to log
        else:
            # footprint: BaseInstrumentor's module, loaded at setup() only with the fast paths off
            from .instrument.ssh import SSHTunnelInstrumentor

            _instrument_once(SSHTunnelInstrumentor(), skip_dep_check=True)
        _when_imported("paramiko", _instrument_paramiko, settings, "ssh", "STALLWATCH_INSTRUMENT_SSH")
    if settings.instrument_nebius:
        _when_imported("nebius", _instrument_nebius, settings, "nebius", "STALLWATCH_INSTRUMENT_NEBIUS")
    if settings.instrument_executor:
        # footprint: with the executor instrumentation only
        from .detect import wedge

        if fast:
            # footprint: loaded only when its instrumentation is on
            from .instrument import pools

            installed = pools.INSTALLATION.switch_on(settings=settings)
        else:
            # footprint: BaseInstrumentor's module, loaded at setup() only with the fast paths off
            from .instrument.executor import ExecutorInstrumentor

            installed = _instrument_once(ExecutorInstrumentor(), settings=settings)
        if installed:
            wedge.install(
                wedge.WedgeSettings(settings.wedge_check_interval, settings.queue_stall_seconds, settings.executor_heal)
            )


def _when_imported(
    package: str, install: Callable[[Settings], object], settings: Settings, component: str, setting: str
) -> None:
    """Run `install(settings)` when the host imports `package`, now if it has: the instrumentation of
    a library the host never imports is never loaded. An error is counted and logged once naming
    `setting`, never raised into the host's import."""

    def installed(module: object) -> None:
        try:
            install(settings)
        except Exception:
            FAULTS.record(component, setting)

    wrapt.register_post_import_hook(installed, package)  # one per setup(): installing again is a no-op


def _instrument_paramiko(settings: Settings) -> None:
    # footprint: loaded when the host imports paramiko
    from .instrument.paramiko import ParamikoInstrumentor

    _instrument_once(ParamikoInstrumentor(), settings=settings)


def _instrument_nebius(settings: Settings) -> None:
    # footprint: loaded when the host imports nebius
    from .instrument.nebius import NebiusInstrumentor

    # Outside the declared range the check of the private methods at import decides, and its warning
    # names the setting.
    _instrument_once(NebiusInstrumentor(), skip_dep_check=True)


def _instrument_once(instrumentor: BaseInstrumentor, **kwargs: Any) -> bool:
    """Instrument `instrumentor` (one instance per class) unless it already is, by the host or an
    earlier `setup()`; True when this call did."""
    if instrumentor.is_instrumented_by_opentelemetry:
        return False
    instrumentor.instrument(**kwargs)
    return True


def shutdown(timeout: float | None = None) -> bool:
    """Flush and stop stallwatch's providers within `timeout` seconds.

    Defaults to `STALLWATCH_SHUTDOWN_TIMEOUT` (1 s). Returns True when everything finished in
    time; telemetry still queued after the timeout is dropped, the host is never held up.
    """
    global _session, _shut_down
    with _lock:
        session, _session = _session, None
        _shut_down = _shut_down or session is not None
    if session is None:
        return True
    if timeout is None:
        timeout = session.settings.shutdown_timeout if session.settings else 1.0
    deadline = time.monotonic() + timeout  # one budget for everything below
    if session._watchdog is not None:
        # footprint: with the watchdog only
        from .detect import heartbeat

        area, watchdog = session._watchdog
        heartbeat.stop()
        if area.writable:  # not in a fork child that lives on: the watchdog is its parent's
            watchdog.terminate()
    if session.settings is not None and session.settings.instrument_subprocess:
        # footprint: loaded only when its instrumentation is on
        from .instrument import subprocess as subprocess_instrumentation

        subprocess_instrumentation.end_open_spans()  # and builds the spans still waiting
    nebius_instrumentation = sys.modules.get("stallwatch.instrument.nebius")
    if nebius_instrumentation is not None:
        nebius_instrumentation.complete_waiting()  # calls that ended and were not completed yet
    if session.settings is not None and session.settings.providers == "host":
        _warn_when_the_host_exports_nothing(at_exit=True)
    if session._journal is not None:
        journal.activate(None)
        session._journal.close(max(deadline - time.monotonic(), 0.0))
    if session._pipeline is None:
        return True
    # The pipeline logs once what it could not export in time (STALLWATCH_SHUTDOWN_TIMEOUT).
    return bool(session._pipeline.shutdown(max(deadline - time.monotonic(), 0.0)))


def _shutdown_at_exit() -> None:
    # Also runs in a forked child that lives on and exits normally: it flushes its own telemetry.
    try:
        shutdown()
    except Exception as exc:  # the host's exit must not print a traceback of ours
        _log.warning(
            "stallwatch: telemetry shutdown at exit failed (%s: %s); what was not exported is lost. "
            "STALLWATCH_SHUTDOWN_TIMEOUT bounds it; OTEL_SDK_DISABLED=true turns telemetry off.",
            type(exc).__name__,
            exc,
        )


def _keep_the_tail_on_sigterm(timeout: float) -> None:
    """Export what was recorded before a SIGTERM that ends the process by its default action.

    That action skips `atexit`, so a stock OpenTelemetry host loses every queued span there
    (uvicorn, after its graceful shutdown, restores the handler it found and raises SIGTERM again).
    Installed only from the main thread and only while SIGTERM has its default action: a handler
    the host installed before, or SIG_IGN, is never replaced, and one it installs later replaces
    this one. The handler shuts stallwatch down and flushes the host's own providers (`atexit` would
    have shut them down: with STALLWATCH_PROVIDERS=host they hold stallwatch's records too) within
    `timeout` seconds (STALLWATCH_SHUTDOWN_TIMEOUT), restores the default action and raises SIGTERM
    again, so the process still dies by SIGTERM (exit status -15) without running `atexit`
    handlers, as it would without stallwatch.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda signum, frame: _flush_then_die(signum, timeout))


def _flush_when_uvicorn_stops(timeout: float) -> None:
    """Export what was recorded when a uvicorn server's graceful shutdown ends, before uvicorn
    restores the signal handlers it found and raises the signal that stopped it again.

    A worker of `uvicorn --workers` or of gunicorn's `UvicornWorker` with `--preload` has SIGTERM at
    its default action when uvicorn captures it, and imports stallwatch (or was forked) with
    uvicorn's handler in place: `_keep_the_tail_on_sigterm` cannot stand in for the default there,
    and uvicorn's re-raised SIGTERM would end the worker with its queued telemetry. So every
    `uvicorn.server.Server.shutdown` is followed by a flush of stallwatch's pipeline (`Pipeline.flush`)
    and of the host's providers (`_flush_host_providers`), within `timeout` seconds
    (STALLWATCH_SHUTDOWN_TIMEOUT). The flush runs on a thread of its own: the event loop goes on
    running whatever else it has (and beating for the watchdog) while a collector is slow, and the
    shutdown returns once the flush has finished or its time is up. Nothing is stopped: a process
    that lives on keeps recording. A forked worker's own Prometheus endpoint is withdrawn from
    discovery first (`Pipeline.withdraw_fork_child`), since that worker ends by the signal.
    """

    def flush_after(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        async def shutdown_then_flush() -> Any:
            try:
                return await wrapped(*args, **kwargs)
            finally:
                await _flush_off_the_loop(timeout)

        return shutdown_then_flush()

    _wrap_once("uvicorn.server", "Server.shutdown", flush_after)


def _shut_down_when_multiprocessing_workers_end() -> None:
    """Shut stallwatch down (`_shutdown_at_exit`) in a multiprocessing worker once its target returned.

    The fork and forkserver contexts end a worker with `os._exit` right after its
    `BaseProcess._bootstrap` returns, which skips `atexit`: a worker forked from a set-up host
    (`multiprocessing.Process`, a `ProcessPoolExecutor` on Linux up to Python 3.13) would lose what it
    recorded since its last export. A spawned worker exits normally afterwards, and `atexit` then
    finds nothing left to do.
    """

    def shut_down_after(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
        try:
            return wrapped(*args, **kwargs)
        finally:
            _shutdown_at_exit()

    _wrap_once("multiprocessing.process", "BaseProcess._bootstrap", shut_down_after)


_wrapped_once: set[tuple[str, str]] = set()  # a second setup() must not wrap (and so flush) twice


def _wrap_once(module: str, name: str, wrapper: Callable[..., Any]) -> None:
    """Wrap `module.name` with the wrapt `wrapper` once per process, now or when `module` is imported. A
    module without it (a version that renamed it) is left as it is, with one WARNING: the host's import of
    that module must not fail for it."""
    if (module, name) in _wrapped_once:
        return
    _wrapped_once.add((module, name))

    def wrap(imported: Any) -> None:
        try:
            wrapt.wrap_function_wrapper(imported, name, wrapper)
        except Exception as exc:
            _log.warning("stallwatch: cannot wrap %s.%s (%s: %s); what it would flush is exported at exit only.",
                         module, name, type(exc).__name__, exc)  # fmt: skip

    wrapt.register_post_import_hook(wrap, module)


async def _flush_off_the_loop(timeout: float) -> None:
    """Flush the global providers on a thread of its own within `timeout` seconds (`Budget`), and
    wait for it (half a second longer, as `_flush_then_die` does) without blocking the running
    event loop."""
    import asyncio

    loop = asyncio.get_running_loop()
    done = loop.create_future()
    budget = Budget(timeout)

    def finish() -> None:
        if not done.done():
            done.set_result(None)

    def flush() -> None:
        try:
            pipeline = _session._pipeline if _session is not None else None
            if pipeline is not None:
                pipeline.withdraw_fork_child()
                pipeline.flush(budget)
            _flush_host_providers(_providers_of(pipeline), budget)
        except Exception as exc:  # uvicorn's shutdown keeps its own outcome
            _log.warning("stallwatch: flushing telemetry after uvicorn's shutdown failed (%s: %s); what was "
                         "queued is exported at exit, if the process gets there.", type(exc).__name__, exc)  # fmt: skip
        finally:
            with contextlib.suppress(RuntimeError):  # the loop has closed: no one waits any more
                loop.call_soon_threadsafe(finish)

    # A timer, not asyncio.wait_for: stallwatch counts the host's wait_for expiries by call site, and
    # this wait running out (a flush slower than its budget) is none of the host's. An exporter built
    # meanwhile extends the budget, so the timer is set again until what is left is spent.
    def time_up() -> None:
        left = budget.left() + 0.5
        if left > 0.001 and not done.done():
            timers[0] = loop.call_later(left, time_up)
        else:
            finish()

    try:
        threading.Thread(target=flush, name="stallwatch-uvicorn-flush", daemon=True).start()
    except RuntimeError:  # no thread can start (the interpreter is exiting): on the loop, as bounded
        flush()
    timers = [loop.call_later(timeout + 0.5, time_up)]
    try:
        await done
    finally:
        timers[0].cancel()


def _flush_then_die(signum: int, timeout: float) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    try:
        # On a thread of its own: the handler runs between two bytecodes of the main thread, which
        # may hold a lock the shutdown needs; the wait is bounded either way, and an exporter built
        # meanwhile extends it as it extends the shutdown's own wait (`Budget`).
        finished = threading.Event()

        def flush() -> None:
            try:
                _flush_at_sigterm(timeout)
            finally:
                finished.set()

        threading.Thread(target=flush, name="stallwatch-sigterm", daemon=True).start()
        Budget(timeout + 0.5).wait(finished)
    finally:
        signal.raise_signal(signum)


def _flush_at_sigterm(timeout: float) -> None:
    budget = Budget(timeout)
    session = _session
    ours = _providers_of(session._pipeline if session is not None else None)
    _shutdown_at_exit()
    _flush_host_providers(ours, budget)


def _providers_of(pipeline: Any) -> set[int]:
    """The ids of the providers `pipeline` (None: no pipeline) built, for `_flush_host_providers` to skip."""
    built = [pipeline.tracer_provider, pipeline.meter_provider, pipeline.logger_provider] if pipeline else []
    return {id(provider) for provider in built if provider is not None}


def _flush_host_providers(ours: set[int], budget: Budget) -> None:
    """Flush, within `budget`, every OpenTelemetry SDK provider the host made that is not one of `ours`:
    the global ones and those of OpenTelemetry logging handlers on the root logger (dstack's handler keeps
    a logger provider of its own when stallwatch's is the global one). Each failure is logged and skipped."""
    from opentelemetry import _logs, trace

    found: list[Any] = [trace.get_tracer_provider(), metrics.get_meter_provider(), _logs.get_logger_provider()]
    found += [otel_compat.logging_handler_provider(handler) for handler in logging.getLogger().handlers]
    seen = set(ours)
    for provider in found:
        flush = getattr(provider, "force_flush", None)  # the API's proxies and no-op providers have none
        left = budget.left()
        if id(provider) in seen or flush is None or left <= 0:
            continue
        seen.add(id(provider))
        try:
            flush(timeout_millis=left * 1000)
        except Exception as exc:
            _log.warning("stallwatch: flushing the host's %s at SIGTERM failed (%s: %s); what it held is lost.",
                         type(provider).__name__, type(exc).__name__, exc)  # fmt: skip
