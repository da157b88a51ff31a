"""Builds the OpenTelemetry providers, processors and exporters that `setup()` installs.

The SDK classes used here are the stock ones; `forksafe.otel_compat` has already made them
fork-aware at `import stallwatch`. The OTLP gRPC exporter (and with it grpc) is imported only when
the settings ask for it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import _logs, metrics, trace
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs import export as _log_export
from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider, sampling
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

from . import telemetry
from ._version import __version__
from .config import ConfigError, Settings
from .export.file import FileLogExporter, FileMetricExporter, FileSpanExporter
from .forksafe import grpc_guard
from .forksafe.loop import package_version
from .ledger import LOGGER_NAME as LEDGER_LOGGER

_log = logging.getLogger("stallwatch")
_HTTP_PATHS = {"traces": "v1/traces", "metrics": "v1/metrics", "logs": "v1/logs"}


@dataclass
class Pipeline:
    """The providers stallwatch built and installed globally (None where the host owns one)."""

    tracer_provider: TracerProvider | None = None
    meter_provider: MeterProvider | None = None
    logger_provider: LoggerProvider | None = None
    log_handler: logging.Handler | None = None
    stderr_handler: logging.Handler | None = None
    files: dict[str, Path] = field(default_factory=dict)
    prometheus_address: tuple[str, int] | None = None
    _closers: list[Callable[[], Any]] = field(default_factory=list)

    def shutdown(self, timeout: float) -> bool:
        """Flush and stop everything within `timeout` seconds; True if it finished in time."""
        for handler in (self.log_handler, self.stderr_handler):
            if handler is not None:
                logging.getLogger().removeHandler(handler)
        providers = [p for p in (self.tracer_provider, self.meter_provider, self.logger_provider) if p]

        def run() -> None:
            for provider in providers:
                try:
                    provider.shutdown()
                except Exception:  # one failing provider must not keep the others from stopping
                    _log.warning("stallwatch: %s.shutdown() failed", type(provider).__name__, exc_info=True)
            for close in self._closers:
                close()

        # Shutdown may block on a slow backend; the host's exit must not (STALLWATCH_SHUTDOWN_TIMEOUT).
        worker = threading.Thread(target=run, name="stallwatch-shutdown", daemon=True)
        try:
            worker.start()
        except RuntimeError:
            # Python 3.12+ refuses new threads once the interpreter is finalizing (atexit): flush
            # inline, bounded only by the exporters' own timeouts.
            run()
            return True
        worker.join(timeout)
        return not worker.is_alive()


def build_resource(settings: Settings) -> Resource:
    attributes: dict[str, Any] = {
        telemetry.RESOURCE_VERSION.name: __version__,
        telemetry.RESOURCE_GRPC_FORK_SUPPORT.name: os.environ.get(grpc_guard.VARIABLE, "unset"),
    }
    uvloop_version = package_version("uvloop")
    if uvloop_version:
        attributes[telemetry.RESOURCE_UVLOOP_VERSION.name] = uvloop_version
    attributes.update(settings.resource_attributes)
    if settings.service_name:
        attributes["service.name"] = settings.service_name
    return Resource.create(attributes)


def build(settings: Settings) -> Pipeline:
    """Build providers for every signal whose global provider is still unset, then install them.

    Everything is built before anything is installed, so a failure (a bad exporter, a busy
    Prometheus port) leaves no half-installed pipeline behind.
    """
    pipeline = Pipeline()
    resource = build_resource(settings)
    owners = {
        "TracerProvider": _unset(trace.get_tracer_provider(), trace.ProxyTracerProvider),
        "MeterProvider": _unset(metrics.get_meter_provider(), metrics._internal._ProxyMeterProvider),
        "LoggerProvider": _unset(_logs.get_logger_provider(), _logs._internal.ProxyLoggerProvider),
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
            root = logging.getLogger()
            if not root.handlers and logging.lastResort is not None:
                # Without handlers, Python prints WARNING and above to stderr (logging.lastResort);
                # our handler on the root would silence that, so keep it explicitly.
                pipeline.stderr_handler = logging.lastResort
                root.addHandler(logging.lastResort)
            level = min(settings.log_level, logging.INFO)  # ledger records are INFO
            handler = LoggingHandler(level=level, logger_provider=pipeline.logger_provider)
            handler.addFilter(_LevelOrLedger(settings.log_level))
            pipeline.log_handler = handler
            root.addHandler(handler)
    return pipeline


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
        file_exporter = {"traces": FileSpanExporter, "metrics": FileMetricExporter, "logs": FileLogExporter}[signal]
        exporter = file_exporter(settings.file_dir)
        pipeline.files[signal] = exporter.path
        return exporter
    if name == "console":
        # The log exporter was renamed ConsoleLogRecordExporter in SDK 1.39; the old name warns there.
        console_log = getattr(_log_export, "ConsoleLogRecordExporter", None) or _log_export.ConsoleLogExporter
        return {"traces": ConsoleSpanExporter, "metrics": ConsoleMetricExporter, "logs": console_log}[signal]()
    return _otlp_exporter(settings, signal)


def _build_traces(settings: Settings, resource: Resource, pipeline: Pipeline) -> TracerProvider:
    provider = TracerProvider(resource=resource, sampler=_sampler(settings), shutdown_on_exit=False)
    for name in settings.traces_exporter:
        provider.add_span_processor(BatchSpanProcessor(_exporter(settings, "traces", name, pipeline)))
    return provider


def _build_metrics(settings: Settings, resource: Resource, pipeline: Pipeline) -> MeterProvider:
    readers: list[MetricReader] = [
        _prometheus_reader(settings, pipeline)
        if name == "prometheus"
        else PeriodicExportingMetricReader(
            _exporter(settings, "metrics", name, pipeline), export_interval_millis=settings.metric_export_interval_ms
        )
        for name in settings.metrics_exporter
    ]
    return MeterProvider(resource=resource, metric_readers=readers, shutdown_on_exit=False)


def _build_logs(settings: Settings, resource: Resource, pipeline: Pipeline) -> LoggerProvider:
    provider = LoggerProvider(resource=resource, shutdown_on_exit=False)
    for name in settings.logs_exporter:
        provider.add_log_record_processor(BatchLogRecordProcessor(_exporter(settings, "logs", name, pipeline)))
    return provider


def _prometheus_reader(settings: Settings, pipeline: Pipeline) -> MetricReader:
    try:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
    except ImportError as exc:
        raise ConfigError(
            "OTEL_METRICS_EXPORTER=prometheus needs the prometheus extra: pip install 'stallwatch[prometheus]'"
        ) from exc
    try:
        server, _thread = start_http_server(settings.prometheus_port, addr=settings.prometheus_host)
    except OSError as exc:
        raise ConfigError(
            f"OTEL_EXPORTER_PROMETHEUS_PORT={settings.prometheus_port}: cannot listen on "
            f"{settings.prometheus_host}:{settings.prometheus_port} ({exc.strerror}); choose a free port, or 0"
        ) from exc
    pipeline.prometheus_address = server.server_address[:2]
    pipeline._closers += [server.shutdown, server.server_close]
    return PrometheusMetricReader()


def _otlp_endpoint(settings: Settings, signal: str, http: bool) -> str | None:
    specific = os.environ.get(f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT")
    if specific:
        return specific
    if settings.otlp_endpoint is None:
        return None
    base = settings.otlp_endpoint
    return f"{base.rstrip('/')}/{_HTTP_PATHS[signal]}" if http else base


def _otlp_exporter(settings: Settings, signal: str) -> Any:
    protocol = settings.protocol_for(signal)
    if protocol == "grpc":
        try:
            if signal == "traces":
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter as GrpcExporter,
                )
            elif signal == "metrics":
                from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                    OTLPMetricExporter as GrpcExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.grpc._log_exporter import (
                    OTLPLogExporter as GrpcExporter,
                )
        except ImportError as exc:
            raise ConfigError(
                "OTEL_EXPORTER_OTLP_PROTOCOL=grpc needs the grpc extra: pip install 'stallwatch[grpc]'"
            ) from exc
        return GrpcExporter(endpoint=_otlp_endpoint(settings, signal, http=False))
    if signal == "traces":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=_otlp_endpoint(settings, signal, http=True))
    if signal == "metrics":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        return OTLPMetricExporter(endpoint=_otlp_endpoint(settings, signal, http=True))
    from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter

    return OTLPLogExporter(endpoint=_otlp_endpoint(settings, signal, http=True))
