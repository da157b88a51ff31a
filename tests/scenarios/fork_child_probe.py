"""Scenario: a process with OTel on forks a child that lives on (gunicorn/multiprocessing style).

Usage: python fork_child_probe.py {setup|host|stock} DIR
  setup: stallwatch.setup() builds the providers (file exporter into DIR)
  host:  stallwatch imported first, then the host builds stock providers itself (dstack style)
  stock: no stallwatch; the host builds the same providers
Prints one JSON line with what the child saw right after fork (before any telemetry use), the
threads it had after emitting a span, a log and a metric, and what reached the files.
"""

import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

mode, out = sys.argv[1], Path(sys.argv[2])
if mode in ("setup", "host"):
    import stallwatch

from opentelemetry import _logs, metrics, trace

if mode == "setup":
    stallwatch.setup(file_dir=str(out), log_level="INFO", metric_export_interval_ms=100)
else:
    from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if mode == "host":
        from stallwatch.export.file import FileLogExporter, FileMetricExporter, FileSpanExporter

        span_exporter, metric_exporter, log_exporter = (
            FileSpanExporter(out),
            FileMetricExporter(out),
            FileLogExporter(out),
        )
    else:  # stock: nothing from stallwatch may be imported, so the SDK's console exporters
        from opentelemetry.sdk._logs import export as log_export
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        devnull = open(os.devnull, "w")
        log_exporter_class = getattr(log_export, "ConsoleLogRecordExporter", None) or log_export.ConsoleLogExporter
        span_exporter, metric_exporter, log_exporter = (
            ConsoleSpanExporter(out=devnull),
            ConsoleMetricExporter(out=devnull),
            log_exporter_class(out=devnull),
        )

    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(tracer_provider)
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=100)
    metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
    logger_provider = LoggerProvider()
    logger_provider.add_log_record_processor(BatchLogRecordProcessor(log_exporter))
    _logs.set_logger_provider(logger_provider)
    logging.getLogger().addHandler(LoggingHandler(level=logging.INFO, logger_provider=logger_provider))

tracer = trace.get_tracer("probe")
counter = metrics.get_meter("probe").create_counter("probe.work")
with tracer.start_as_current_span("parent-work"):
    counter.add(1, {"who": "parent"})

read_fd, write_fd = os.pipe()
pid = os.fork()
if pid == 0:
    report = {
        "stallwatch_loaded": "stallwatch" in sys.modules,
        "python_threads_after_fork": [t.name for t in threading.enumerate()],
        "os_tasks_after_fork": len(os.listdir("/proc/self/task")),
    }
    with tracer.start_as_current_span("child-work") as span:
        span.set_attribute("child.pid", os.getpid())
        counter.add(1, {"who": "child"})
        with ThreadPoolExecutor(1, thread_name_prefix="child-pool") as pool:  # an executor span, if instrumented
            pool.submit(int).result()
    logging.getLogger("probe").warning("child says hello")
    report["python_threads_after_use"] = sorted(t.name for t in threading.enumerate())
    for provider in (trace.get_tracer_provider(), metrics.get_meter_provider(), _logs.get_logger_provider()):
        provider.force_flush()
    os.write(write_fd, json.dumps(report).encode())
    os._exit(0)
os.close(write_fd)
child = json.loads(os.read(read_fd, 65536))
_, status = os.waitpid(pid, 0)
child["exit_status"] = status
child["child_pid"] = pid
print(json.dumps(child))
