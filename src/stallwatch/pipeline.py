"""Builds the OpenTelemetry providers, processors and exporters that `setup()` installs.

The SDK classes used here are the stock ones (the batch processors subclassed only to count
queue-full drops, the exporters wrapped only to count failed batches: `export.guarded`);
`forksafe.otel_compat` has already made them fork-aware at `import stallwatch`. The OTLP gRPC
exporter (and with it grpc) is imported only when the settings ask for it.

Export timeouts stay the SDK's (10 s per OTLP request, `OTEL_EXPORTER_OTLP[_<SIGNAL>]_TIMEOUT` in
seconds): they only bound how long a background worker waits, never the host. What bounds the host
is the shutdown: `Pipeline.shutdown()` runs the providers' shutdowns on stallwatch's worker thread,
started while the host runs (`_Closer`, `background`), and waits for it `STALLWATCH_SHUTDOWN_TIMEOUT`
seconds at most on the collector: building exporters made at their first export is local work left
out of it (`export.budget`). The thread is started beforehand because Python 3.12+ refuses new
threads at interpreter exit, which is when `atexit` calls us; a flush run inline on the exiting
thread would hold the exit for every export timeout against a collector that never answers.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as _log_export
from opentelemetry.sdk._logs.export import LogExportResult
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import ConsoleMetricExporter, MetricExportResult, MetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExportResult

from . import sdk_compat, telemetry
from ._version import __version__
from .config import ConfigError, Settings
from .core import background, histograms
from .core.faults import FAULTS, instrument, meter
from .core.scrub import scrub_text
from .export import exit_check, log_bridge
from .export.batching import SharedThreadMetricReader
from .export.budget import Budget
from .export.guarded import (
    SHUTDOWN_TIMEOUT,
    CountingLogProcessor,
    CountingSpanProcessor,
    ExportGate,
    GuardedExporter,
    GuardedMetricExporter,
    drop_early,
    leftovers,
)
from .export.shedding import SheddingTracerProvider, exemplar_filter
from .forksafe import grpc_guard, guard, otel_compat
from .forksafe.loop import package_version
from .journal.names import LOGGER_NAME as LEDGER_LOGGER

if TYPE_CHECKING:
    from .export.scrapes import ScrapeCounter
    from .export.targets import Target

_log = logging.getLogger("stallwatch")
_HTTP_PATHS = {"traces": "v1/traces", "metrics": "v1/metrics", "logs": "v1/logs"}


class _Closer:
    """Runs the pipeline's shutdown, once, on stallwatch's worker thread (`background`).

    The worker is started by `build()` (the host's own thread, never a fork handler) and again in a
    fork child that lives on, by its first export (`ExportGate`), since a child inherits no thread.
    """

    def __init__(self, work: Callable[[], None]) -> None:
        self._work = work
        self._job: background.Job | None = None
        self._job_pid = 0

    def start(self) -> bool:
        """Make sure this process has the worker; False when no thread can start (interpreter exit)."""
        return background.ensure()

    def finish(self, timeout: float) -> bool:
        """Run the shutdown on the worker; True if it finished within `timeout` seconds, not counting
        the time its exporters took to be built (`Budget`)."""
        if self._job is None or self._job_pid != os.getpid():
            self._job, self._job_pid = background.submit(self._work), os.getpid()
        return self._job is not None and Budget(timeout).wait(self._job.done)


class _Deadline(BaseException):
    """Raised by SIGALRM into an inline shutdown that ran out of time (the SDK catches Exception)."""


def _bounded_inline(work: Callable[[], None], timeout: float) -> bool:
    """Run `work` in this thread and interrupt it after `timeout` seconds; True if it finished.

    Reached only when no thread can start: at exit on Python 3.12+ in a fork child that exported
    nothing yet (its parent's shutdown thread is not inherited). Its flush is then bounded by the
    exporters' own timeouts and retries (10 s per OTLP request, up to a minute of backoff on SDK
    1.27-1.33), so a timer signal stops it; atexit handlers run on the main thread, where the
    signal lands. The time spent building exporters meanwhile re-arms the timer (`Budget`). The
    host's SIGALRM handler and timer are put back afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        work()
        return True
    armed = True
    budget = Budget(timeout)

    def on_alarm(signum: int, frame: object) -> None:
        if not armed:
            return
        owed = budget.left()
        if owed > 0.001:  # builds since the timer was set: local work, not the budget's
            signal.setitimer(signal.ITIMER_REAL, owed)
            return
        raise _Deadline

    started = time.monotonic()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    host_delay, host_interval = signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        work()
        armed = False
        return True
    except _Deadline:
        return False
    finally:
        armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if host_delay:
            remaining = max(host_delay - (time.monotonic() - started), 1e-6)
            signal.setitimer(signal.ITIMER_REAL, remaining, host_interval)


class Pipeline:
    """The providers stallwatch built and installed globally (None where the host owns one); `build()`
    fills it in."""

    def __init__(self) -> None:
        self.tracer_provider: TracerProvider | None = None
        self.meter_provider: MeterProvider | None = None
        self.logger_provider: LoggerProvider | None = None
        self.log_handler: logging.Handler | None = None
        self.files: dict[str, Path] = {}
        self.prometheus_address: tuple[str, int] | None = None
        self.scrapes: ScrapeCounter | None = None  # answered by the Prometheus endpoint
        self._serve_free_port: Callable[[], Target | None] | None = None  # another endpoint, for a fork child
        self._served_by = 0  # the pid whose endpoint `prometheus_address` is
        self._fork_child_target: Target | None = None  # registered by `serve_fork_child`
        self._closers: list[Callable[[], Any]] = []
        self._processors: list[CountingSpanProcessor | CountingLogProcessor] = []
        self._metric_exporters: list[GuardedMetricExporter] = []
        self._push_readers: list[MetricReader] = []
        self._closer = _Closer(self._stop)
        self._gate = ExportGate(self._closer.start)

    def _stop(self) -> None:
        for processor in self._processors:
            processor.guard.final = True  # the last exports: made during a back-off too, within the budget
        for exporter in self._metric_exporters:
            exporter.final = True  # the readers' last collection: not sent if it repeats the last export
        try:
            guard.drain_pending()  # a fork child's telemetry made at exit, where no worker could start
        except Exception:
            _log.warning("stallwatch: exporting a fork child's telemetry at exit failed", exc_info=True)
        # The meter's shutdown makes the last collection, which must count what the span and log exports
        # dropped; the log records are flushed before it, and stopped after it, so that a record made during
        # it (a failed metric export logged through a host's OpenTelemetry logging handler) is still sent.
        tracer, meter, logger = self.tracer_provider, self.meter_provider, self.logger_provider
        steps = [(tracer, "shutdown"), (logger, "force_flush"), (meter, "shutdown"), (logger, "shutdown")]
        for provider, step in steps:
            if provider is None:
                continue
            try:
                getattr(provider, step)()
            except Exception:  # one failing provider must not keep the others from stopping
                _log.warning("stallwatch: %s.%s() failed", type(provider).__name__, step, exc_info=True)
        for close in self._closers:
            close()

    def flush(self, budget: Budget) -> None:
        """Export what is queued, then the metric readers' collections, within `budget`, stopping
        nothing. The collections come last so that they count what the spans' and log records'
        exports dropped: the process's last collection then repeats them, and is not sent
        (`GuardedMetricExporter.final`). A pull reader (Prometheus) is left to its scrapes: a
        collection there would be served beside the next scrape's own, every series twice.

        Each exporter's first export is made during a back-off too (`attempt_next`), whole: a worker
        that uvicorn's re-raised SIGTERM ends at the default action exports nothing after this flush.
        The rest keep to the back-off, which the process still needs if it lives on."""
        exporters = [processor.guard for processor in self._processors] + self._metric_exporters
        for exporter in exporters:
            exporter.attempt_next = True
        flushes: list[Callable[..., Any]] = [self.tracer_provider.force_flush] if self.tracer_provider else []
        if self.logger_provider is not None:
            flushes.append(self.logger_provider.force_flush)
        flushes += [reader.force_flush for reader in self._push_readers]
        try:
            for flush in flushes:
                left = budget.left()
                if left <= 0:
                    return
                try:
                    flush(timeout_millis=left * 1000)
                except Exception as exc:  # one failing flush must not keep the others from running
                    _log.warning("stallwatch: flushing telemetry failed (%s: %s)", type(exc).__name__, exc)
        finally:
            for exporter in exporters:
                exporter.attempt_next = False  # a queue that was empty: the next export is the workers'

    def serve_fork_child(self) -> None:
        """Serve this fork child's own series on a free port, registered for discovery like any endpoint.

        A worker forked after `setup()` (gunicorn --preload) inherits the Prometheus reader, which
        collects this process's metrics, but not the parent's server thread: the parent's endpoint
        serves the parent's series only. Called on the child's own thread (a loop starting), never
        in a fork handler; once per process, and only with the `prometheus` exporter. Never raises."""
        if self._serve_free_port is None or self._served_by == os.getpid():
            return
        self._served_by = os.getpid()
        try:
            self._fork_child_target = self._serve_free_port()
        except OSError as exc:
            _log.warning("stallwatch: this forked worker cannot serve its Prometheus endpoint (%s); its series "
                         "are not scraped", exc.strerror or exc)  # fmt: skip

    def withdraw_fork_child(self) -> None:
        """Withdraw the endpoint `serve_fork_child` registered, for the worker's server has stopped
        (uvicorn's shutdown), its scrape server left running. Such a worker (gunicorn's UvicornWorker
        after `--preload`) then dies by the SIGTERM uvicorn raises again, skipping `atexit` and the
        shutdown that withdraws it: its target would stay behind, down, and fire HostDown."""
        if self._fork_child_target is not None:
            self._fork_child_target.remove()

    def shutdown(self, timeout: float) -> bool:
        """Flush and stop everything within `timeout` seconds; True if it finished in time.

        What is still queued or in flight when the time is up is dropped, counted as
        `shutdown_timeout` and logged once at WARNING (the count itself can no longer be exported).
        """
        if self.log_handler is not None and log_bridge.installed_handler() is self.log_handler:
            log_bridge.uninstall()
        finished = self._closer.finish(timeout) if self._closer.start() else _bounded_inline(self._stop, timeout)
        if not finished:
            self._gate.cut_off = True  # the shutdown left behind stops exporting instead of waiting
            self._report_leftovers(timeout)
        return finished

    def _report_leftovers(self, timeout: float) -> None:
        lost = leftovers(self._processors, self._metric_exporters)
        for signal_name, count in lost.items():
            self._gate.drop(signal_name, SHUTDOWN_TIMEOUT, count)
        _log.warning(
            "stallwatch: telemetry shutdown did not finish within %.1fs (STALLWATCH_SHUTDOWN_TIMEOUT); dropped "
            "%d spans, %d log records and %d metric exports the backend had not taken.",
            timeout,
            lost["traces"],
            lost["logs"],
            lost["metrics"],
        )


def build_resource(settings: Settings) -> Resource:
    attributes: dict[str, Any] = {
        telemetry.RESOURCE_VERSION.name: __version__,
        telemetry.RESOURCE_GRPC_FORK_SUPPORT.name: os.environ.get(grpc_guard.VARIABLE, "unset"),
    }
    uvloop_version = _uvloop_version()
    if uvloop_version:
        attributes[telemetry.RESOURCE_UVLOOP_VERSION.name] = uvloop_version
    attributes.update(settings.resource_attributes)
    if settings.service_name:
        attributes["service.name"] = settings.service_name
    return Resource.create(attributes)


_VERSION_LINE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.MULTILINE)


def _uvloop_version() -> str | None:
    """The installed uvloop's version, None if it is not installed, without reading the metadata of
    every installed distribution: the module's `__version__` once it is imported, else the
    `_version.py` it is imported from (uvloop's `__init__` takes its `__version__` from there), read
    as text; the distribution's metadata only when neither says."""
    module = sys.modules.get("uvloop")
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        spec = importlib.util.find_spec("uvloop")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return None
    try:
        found = _VERSION_LINE.search(Path(spec.origin or "").with_name("_version.py").read_text())
    except (OSError, ValueError):
        found = None
    return found.group(1) if found else package_version("uvloop")


def build(settings: Settings) -> Pipeline:
    """Build providers for every signal whose global provider is still unset, then install them.

    Everything is built before anything is installed, so a failure (a bad exporter, a busy
    Prometheus port) leaves no half-installed pipeline behind.
    """
    pipeline = Pipeline()
    resource = build_resource(settings)
    proxy_tracer_provider, proxy_meter_provider, proxy_logger_provider = sdk_compat.proxy_providers()
    owners = {
        "TracerProvider": _unset(trace.get_tracer_provider(), proxy_tracer_provider),
        "MeterProvider": _unset(metrics.get_meter_provider(), proxy_meter_provider),
        "LoggerProvider": _unset(_logs.get_logger_provider(), proxy_logger_provider),
    }
    try:
        if owners["TracerProvider"]:
            pipeline.tracer_provider = _build_traces(settings, resource, pipeline)
        if owners["MeterProvider"]:
            pipeline.meter_provider = _build_metrics(settings, resource, pipeline)
        if owners["LoggerProvider"]:
            pipeline.logger_provider = _build_logs(settings, resource, pipeline)
    except BaseException:
        pipeline.shutdown(settings.shutdown_timeout)
        raise
    # Counted in plain integers, observed at collection time (see export.guarded).
    instrument(meter(pipeline.meter_provider), telemetry.TELEMETRY_DROPPED, pipeline._gate.observe)
    pipeline._closer.start()
    for name, ours in owners.items():
        if not ours:
            _log.warning("stallwatch: a %s was already installed; using it (STALLWATCH_PROVIDERS=host).", name)
    if pipeline.tracer_provider:
        trace.set_tracer_provider(pipeline.tracer_provider)
    if pipeline.meter_provider:
        metrics.set_meter_provider(pipeline.meter_provider)
    if pipeline.logger_provider:
        _logs.set_logger_provider(pipeline.logger_provider)
        if settings.logs_exporter:
            level = min(settings.log_level, logging.INFO)  # ledger records are INFO
            processors = [p for p in pipeline._processors if isinstance(p, CountingLogProcessor)]
            handler = _LoggingHandler(level, pipeline.logger_provider, processors)
            handler.addFilter(_LevelOrLedger(settings.log_level))
            pipeline.log_handler = handler
            exit_check.check_log_handlers()
            log_bridge.install(handler)  # never a handler on the root logger: the host's output stays its own
    return pipeline


class _LoggingHandler(LoggingHandler):
    """The SDK's handler, minus the work on a record that would be dropped, and minus `flush()`.

    While every log queue is full (the backend is down or slow), the record is counted as dropped
    before the SDK translates it into an OpenTelemetry log record: the host's thread does no work for
    a record that is lost anyway.

    The SDK's `flush()` forces an export of every log record: on the calling thread up to SDK 1.38
    (up to 30 s against a collector that never answers), on a new thread since 1.39, which Python
    3.12+ refuses at exit, where `logging.shutdown()` calls it: the RuntimeError then stops
    `logging.shutdown()` before it flushes and closes the host's own handlers. Ours does nothing:
    the batch processors export on their own and `shutdown()` flushes within its budget.
    """

    def __init__(self, level: int, logger_provider: LoggerProvider, processors: list[CountingLogProcessor]) -> None:
        with warnings.catch_warnings():
            # SDK 1.45 deprecates this handler for the one of opentelemetry-instrumentation-logging, a
            # package stallwatch does not use. The warning is not the host's to act on, and under
            # `-W error` (a common pytest setting) it failed setup().
            warnings.simplefilter("ignore", DeprecationWarning)
            super().__init__(level=level, logger_provider=logger_provider)
        self._processors = processors

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if not drop_early(self._processors):
                super().emit(record)
        except Exception:  # the SDK failing must not reach the host's logging call
            FAULTS.record("logs", "OTEL_LOGS_EXPORTER", "a log record could not be handed to OpenTelemetry", off="none")

    def flush(self) -> None:
        return


class _LevelOrLedger(logging.Filter):
    """Records at STALLWATCH_LOG_LEVEL or above, and every cloud resource ledger record."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= self.level or record.name == LEDGER_LOGGER


def _unset(provider: object, proxy_type: type) -> bool:
    return isinstance(provider, proxy_type)


def _sampler(settings: Settings) -> sampling.Sampler:
    ratio = settings.sampler_arg
    return {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBased(sampling.TraceIdRatioBased(ratio)),
    }[settings.sampler]()


def _exporter(settings: Settings, signal: str, name: str, pipeline: Pipeline) -> Any:
    """One `file`, `console` or `otlp` exporter for a signal."""
    if name == "file":
        # footprint: the file exporters (and protobuf's json_format) only where a signal uses them
        from .export.file import FileLogExporter, FileMetricExporter, FileSpanExporter

        exporters: dict[str, type[FileSpanExporter | FileMetricExporter | FileLogExporter]] = {
            "traces": FileSpanExporter,
            "metrics": FileMetricExporter,
            "logs": FileLogExporter,
        }
        file_exporter = exporters[signal]
        try:
            exporter = file_exporter(settings.file_dir)
        except OSError as exc:
            raise ConfigError(
                f"STALLWATCH_FILE_DIR={str(settings.file_dir)!r} is unusable for the `file` exporter "
                f"({exc.strerror or exc}): choose a writable directory, or another exporter"
            ) from exc
        pipeline.files[signal] = exporter.path
        return exporter
    if name == "console":
        # The log exporter was renamed ConsoleLogRecordExporter in SDK 1.39; the old name warns there.
        console_log = getattr(_log_export, "ConsoleLogRecordExporter", None) or _log_export.ConsoleLogExporter
        return {"traces": ConsoleSpanExporter, "metrics": ConsoleMetricExporter, "logs": console_log}[signal]()
    if settings.protocol_for(signal) == "grpc" or not _builds_later(settings, signal):
        return _otlp_exporter(settings, signal)
    preferences = sdk_compat.otlp_http_metric_preferences() if signal == "metrics" else None
    if signal == "metrics" and preferences is None:
        return _otlp_exporter(settings, signal)
    # footprint: the OTLP/HTTP exporter (its modules, protobuf, requests) is built at its first export
    from .export.lazy import LazyExporter

    failure = {"traces": SpanExportResult.FAILURE, "metrics": MetricExportResult.FAILURE}.get(signal)
    return LazyExporter(
        lambda: _otlp_exporter(settings, signal), LogExportResult.FAILURE if failure is None else failure, preferences
    )


# The OTLP variables an OTLP/HTTP exporter reads without ever refusing them: the endpoints and protocols
# (checked by `config`), the timeouts (`config` refuses what the exporters would), the headers (the SDK
# skips a malformed one with a warning). With any other set, the exporter is built at `setup()`, which
# reports it if the exporter refuses it (`_otlp_exporter`).
_NEVER_REFUSED = ("ENDPOINT", "PROTOCOL", "TIMEOUT", "HEADERS")
_TEMPORALITY_PREFERENCE = "OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE"
_HISTOGRAM_AGGREGATION = "OTEL_EXPORTER_OTLP_METRICS_DEFAULT_HISTOGRAM_AGGREGATION"
_CHECKED_VALUES = {
    _TEMPORALITY_PREFERENCE: ("cumulative", "delta", "lowmemory"),
    _HISTOGRAM_AGGREGATION: ("explicit_bucket_histogram", "base2_exponential_bucket_histogram"),
}


def _builds_later(settings: Settings, signal: str) -> bool:
    """Whether `signal`'s OTLP/HTTP exporter may be built at its first export: only in the host (the
    watchdog builds its pipeline to export a freeze at once) and when building it now could neither
    fail nor log a warning about the settings (see `_NEVER_REFUSED`)."""
    if settings.resource_attributes.get(telemetry.RESOURCE_PROCESS_ROLE.name) == "watchdog":
        return False
    for name, value in os.environ.items():
        if not name.startswith(("OTEL_EXPORTER_OTLP_", "OTEL_PYTHON_EXPORTER_OTLP_")):
            continue
        accepted = _CHECKED_VALUES.get(name)
        if accepted is not None:
            if signal == "metrics" and value.strip().lower() not in accepted:
                return False
            continue
        if name.startswith("OTEL_PYTHON_") or not name.endswith(_NEVER_REFUSED):
            return False
    return True


def _build_traces(settings: Settings, resource: Resource, pipeline: Pipeline) -> TracerProvider:
    provider_class = SheddingTracerProvider if sdk_compat.fast_paths() else TracerProvider
    provider = provider_class(resource=resource, sampler=_sampler(settings), shutdown_on_exit=False)
    if not sdk_compat.fast_paths() and settings.watchdog:  # the heartbeat's current span, from the spans
        # footprint: with the watchdog only
        from .detect import heartbeat

        provider.add_span_processor(heartbeat.current_span_processor())
    for name in settings.traces_exporter:
        exporter = _exporter(settings, "traces", name, pipeline)
        guarded = GuardedExporter(
            exporter, "traces", pipeline._gate, SpanExportResult.FAILURE, settings.slow_export_seconds
        )
        processor = CountingSpanProcessor(guarded, shed=settings.shed_spans)
        pipeline._processors.append(processor)
        provider.add_span_processor(processor)
    return provider


def _build_metrics(settings: Settings, resource: Resource, pipeline: Pipeline) -> MeterProvider:
    readers: list[MetricReader] = []
    for name in settings.metrics_exporter:
        if name == "prometheus":
            readers.append(_prometheus_reader(settings, pipeline))
            continue
        exporter = GuardedMetricExporter(_exporter(settings, "metrics", name, pipeline), pipeline._gate)
        pipeline._metric_exporters.append(exporter)
        pushing = SharedThreadMetricReader(exporter, settings.metric_export_interval_ms)
        pipeline._push_readers.append(pushing)
        readers.append(pushing)
    # Every reader gets stallwatch's own duration histograms, unless one wants them as deltas: not a fast
    # path (the fast paths bench), but the only way to series that exist at zero before their first value.
    own = all(_cumulative_histograms(reader) for reader in readers)
    histograms.activate(resource if own else None)
    chosen = exemplar_filter()
    extra: dict[str, Any] = {"exemplar_filter": chosen} if chosen is not None else {}
    if not own:  # the SDK's histograms: the contract's buckets by Views (the API has no advisory before 1.30)
        extra["views"] = [
            View(instrument_name=metric.name, aggregation=ExplicitBucketHistogramAggregation(metric.buckets))
            for metric in telemetry.METRICS
            if metric.buckets
        ]
    return MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False, **extra)


def _cumulative_histograms(reader: MetricReader) -> bool:
    """Whether `reader` takes histograms cumulative (a delta preference keeps the SDK's histograms).

    The reader keys its temporalities by instrument class: `Histogram` on recent SDKs, the internal
    `_Histogram` on older ones."""
    from opentelemetry.sdk.metrics.export import AggregationTemporality

    chosen = sdk_compat.histogram_temporalities(reader)
    return bool(chosen) and all(t is AggregationTemporality.CUMULATIVE for t in chosen)


def _build_logs(settings: Settings, resource: Resource, pipeline: Pipeline) -> LoggerProvider:
    provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    for name in settings.logs_exporter:
        exporter = _exporter(settings, "logs", name, pipeline)
        slow = settings.slow_export_seconds
        guarded = GuardedExporter(exporter, "logs", pipeline._gate, LogExportResult.FAILURE, slow)
        processor = CountingLogProcessor(guarded)
        pipeline._processors.append(processor)
        provider.add_log_record_processor(processor)
    return provider


def _prometheus_reader(settings: Settings, pipeline: Pipeline) -> MetricReader:
    try:
        # optional: the prometheus extra
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise ConfigError(
            "OTEL_METRICS_EXPORTER=prometheus needs the prometheus extra: pip install 'stallwatch[prometheus]'"
        ) from exc

    def serve_free_port() -> Target | None:
        return _serve(settings, pipeline, start_http_server(0, addr=settings.prometheus_host)[0])

    pipeline._serve_free_port = serve_free_port
    try:
        _serve(settings, pipeline, start_http_server(settings.prometheus_port, addr=settings.prometheus_host)[0])
    except OSError as exc:
        watchdog = settings.resource_attributes.get(telemetry.RESOURCE_PROCESS_ROLE.name) == "watchdog"
        if exc.errno == errno.EADDRINUSE and _taken_by_this_server(settings, watchdog):
            _log.info("stallwatch: port %d is taken by another process of this server; serving Prometheus on a "
                      "free port (STALLWATCH_PROMETHEUS_TARGETS_DIR)", settings.prometheus_port)  # fmt: skip
            serve_free_port()
        elif exc.errno == errno.EADDRINUSE and watchdog and settings.watchdog_last_scrape_timeout > 0:
            _serve_when_free(settings, pipeline, start_http_server)
        else:
            raise ConfigError(
                f"OTEL_EXPORTER_PROMETHEUS_PORT={settings.prometheus_port}: cannot listen on "
                f"{settings.prometheus_host}:{settings.prometheus_port} ({exc.strerror}); choose a free port, or 0"
            ) from exc

    reader_class = sdk_compat.prometheus_reader_class(
        PrometheusMetricReader,
        lambda metrics_data: histograms.note_exemplars(histograms.inject(metrics_data)),
        "The stock reader, whose scrapes also carry stallwatch's own histograms (`histograms`) with their "
        "exemplars, and the resource's `PROMETHEUS_RESOURCE_LABELS` as labels of every series.",
    )
    labelled = [attribute.name for attribute in telemetry.PROMETHEUS_RESOURCE_LABELS]
    reader: MetricReader = otel_compat.labelled_prometheus_reader(reader_class, labelled)
    otel_compat.transform_prometheus_families(reader, histograms.with_exemplars)  # the stock drops exemplars
    return reader


def _taken_by_this_server(settings: Settings, watchdog: bool) -> bool:
    """Whether the busy Prometheus port is held by another process of the server this process belongs
    to (`targets.shared_with_this_server`): its host's process group, for a watchdog the group of its
    parent, the host (a watchdog whose host has died waits for the port instead: `_serve_when_free`)."""
    # footprint: with the prometheus exporter only
    from .export import targets

    try:
        group = os.getpgid(os.getppid()) if watchdog else os.getpgrp()
    except OSError:  # the watchdog's host is gone
        return False
    return targets.shared_with_this_server(settings.prometheus_port, group)


def _serve(settings: Settings, pipeline: Pipeline, server: Any) -> Target | None:
    """Count the scrapes `server` (prometheus_client's, serving already) answers, register it for
    Prometheus's file-based discovery (`export.targets`), and withdraw and stop it at shutdown.
    Returns its registration, None when it could not be written (a WARNING says so)."""
    pipeline.prometheus_address = server.server_address[:2]
    pipeline._served_by = owner = os.getpid()
    # footprint: with the prometheus exporter only
    from .export import targets
    from .export.scrapes import ScrapeCounter

    pipeline.scrapes = ScrapeCounter(server.get_app())
    server.set_app(pipeline.scrapes)
    role = settings.resource_attributes.get(telemetry.RESOURCE_PROCESS_ROLE.name)
    kind = "watchdog" if role == "watchdog" else "host"
    port = server.server_address[1]
    target: Target | None = None
    try:
        target = targets.register(
            settings.prometheus_targets_dir, kind, targets.target_address(settings.prometheus_host, port), port
        )
    except OSError as exc:
        _log.warning("stallwatch: cannot register the Prometheus endpoint on port %d for discovery in %s (%s); "
                     "Prometheus finds it only if listed by hand (STALLWATCH_PROMETHEUS_TARGETS_DIR)",
                     port, settings.prometheus_targets_dir, exc.strerror or exc)  # fmt: skip

    def stop() -> None:
        if os.getpid() != owner:  # a fork child's copy: no thread of this process serves it
            return
        if target is not None:
            target.remove()  # first: Prometheus stops scraping before the port closes
        server.shutdown()
        server.server_close()

    pipeline._closers.append(stop)
    return target


def _serve_when_free(settings: Settings, pipeline: Pipeline, start_http_server: Callable[..., Any]) -> None:
    """Bind the watchdog's port from a thread as soon as it is free, trying every 0.2 s until the
    shutdown; a WARNING once it has stayed busy `STALLWATCH_WATCHDOG_LAST_SCRAPE_TIMEOUT` seconds
    and a second more (the longest a previous watchdog waits for its last scrape), then a try
    every 2 s.

    The watchdog of a host that died frozen keeps the port until a scrape has carried the death; a
    restarted host's new watchdog, meanwhile, watches and exports over OTLP at once and serves its
    endpoint when the old one leaves (later, if the old one's OTLP flush was slow)."""
    stopping = threading.Event()
    lock = threading.Lock()  # a server bound while the shutdown runs is closed at once

    def stop() -> None:
        with lock:
            stopping.set()

    def bind() -> None:
        warn_at = time.monotonic() + settings.watchdog_last_scrape_timeout + 1.0
        while not stopping.wait(0.2 if warn_at else 2.0):  # after the warning, a try every 2 s
            try:
                server = start_http_server(settings.prometheus_port, addr=settings.prometheus_host)[0]
            except OSError:
                if warn_at and time.monotonic() > warn_at:
                    warn_at = 0.0
                    _log.warning("stallwatch: port %d is busy; the watchdog serves Prometheus once it is free "
                                 "(STALLWATCH_WATCHDOG_PROMETHEUS_PORT)", settings.prometheus_port)  # fmt: skip
                continue
            with lock:
                if stopping.is_set():
                    server.shutdown()
                    server.server_close()
                else:
                    _serve(settings, pipeline, server)
            return

    pipeline._closers.append(stop)
    threading.Thread(target=bind, name="stallwatch-prometheus-bind", daemon=True).start()


def _otlp_endpoint(settings: Settings, signal: str, http: bool) -> str | None:
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    if settings.otlp_endpoint is None:
        return None
    base = settings.otlp_endpoint
    return f"{base.rstrip('/')}/{_HTTP_PATHS[signal]}" if http else base


def _otlp_exporter(settings: Settings, signal: str) -> Any:
    """The OTLP exporter of `signal`. The exporters read more `OTEL_EXPORTER_OTLP_*` variables than
    stallwatch checks, and some raise on a bad one (with gRPC, a compression other than `gzip` on
    SDK 1.45, an unknown credential provider): any such failure becomes a `ConfigError` that names
    the variables set, so `setup()` reports it and keeps the host running like any bad setting."""
    try:
        return _new_otlp_exporter(settings, signal)
    except ConfigError:
        raise
    except Exception as exc:
        prefixes = ("OTEL_EXPORTER_OTLP_", "OTEL_PYTHON_EXPORTER_OTLP_")
        named = ", ".join(sorted(name for name in os.environ if name.startswith(prefixes))) or "none"
        raise ConfigError(
            f"the OTLP {signal} exporter ({settings.protocol_for(signal)}) cannot be built from the "
            f"OTEL_EXPORTER_OTLP_* variables (set: {named}): {scrub_text(f'{type(exc).__name__}: {exc}')}"
        ) from exc


def _new_otlp_exporter(settings: Settings, signal: str) -> Any:
    protocol = settings.protocol_for(signal)
    if protocol == "grpc":
        GrpcExporter: type[Any]  # the signal's OTLP/gRPC exporter class
        try:
            if signal == "traces":
                # optional: the grpc extra
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
            elif signal == "metrics":
                # optional: the grpc extra
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter as GrpcExporter,
                )
            else:
                # optional: the grpc extra
                from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
                    OTLPLogExporter as GrpcExporter,
                )
        except ImportError as exc:
            raise ConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the grpc extra: pip install 'stallwatch[grpc]'"
            ) from exc
        return sdk_compat.encode_once(GrpcExporter)(endpoint=_otlp_endpoint(settings, signal, http=False))
    if signal == "traces":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        # footprint: loaded only for the exporters the settings name
        from .export.span_protobuf import with_fast_encoding

        span_class = with_fast_encoding(OTLPSpanExporter) if sdk_compat.fast_paths() else OTLPSpanExporter
        return span_class(endpoint=_otlp_endpoint(settings, signal, http=True))
    if signal == "metrics":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=_otlp_endpoint(settings, signal, http=True))
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

    # footprint: loaded only for the exporters the settings name
    from .export.log_protobuf import with_fast_encoding as with_fast_log_encoding

    log_class = with_fast_log_encoding(OTLPLogExporter) if sdk_compat.fast_paths() else OTLPLogExporter
    return log_class(endpoint=_otlp_endpoint(settings, signal, http=True))
